"""The daemon's one memory budget (``--budget-mb``) and the ledger of who holds what of it.

The data cache, the checkpoint slots and the replicas fill the same tmpfs, so they share one
budget: each is given this ledger when it is built and registers how to count what it holds.
Whoever needs room asks the ledger what is free, which counts every holder at that moment, so
the holders together never exceed the budget and none needs to know the others.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CACHE_HOLDER", "REPLICAS_HOLDER", "SLOTS_HOLDER", "Budget"]

# The holders' names (``/v1/state`` shows ``memory.<name>_bytes``).
CACHE_HOLDER, SLOTS_HOLDER, REPLICAS_HOLDER = "cache", "slots", "replicas"


class Budget:
    """``total_bytes`` of shared memory and its holders, each counted when asked (never cached:
    a holder's bytes change with every fetch, save and push)."""

    def __init__(self, total_bytes: int) -> None:
        if total_bytes < 0:
            raise ValueError(f"a budget is >= 0 bytes, got {total_bytes}")
        self.total = total_bytes
        self._holders: dict[str, Callable[[], int]] = {}

    def register(self, name: str, held: Callable[[], int]) -> None:
        """Count ``held()`` as holder ``name``'s bytes from now on (once per name)."""
        if name in self._holders:
            raise ValueError(f"{name!r} already holds part of the budget")
        self._holders[name] = held

    def held(self) -> dict[str, int]:
        """Each holder's bytes, in the order they registered."""
        return {name: held() for name, held in self._holders.items()}

    def used(self) -> int:
        return sum(self.held().values())

    def free(self) -> int:
        """What is left for anything new (negative when a smaller budget found more held)."""
        return self.total - self.used()

    def others(self, name: str) -> int:
        """What every holder but ``name`` holds: what ``name`` cannot make room from itself."""
        return sum(held() for other, held in self._holders.items() if other != name)

    def describe(self) -> dict[str, int]:
        """``<holder>_bytes`` for each holder and ``free_bytes`` (``/v1/state``'s ``memory``)."""
        held = self.held()
        return {**{f"{name}_bytes": n for name, n in held.items()}, "free_bytes": self.total - sum(held.values())}
