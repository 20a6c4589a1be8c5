"""The checkpoint razor: who saves which bytes of a state replicated across a dp group.

Every rank of a data-parallel group holds the same replicated state (model, and the optimizer
unless it is sharded), so each saves only its ``1/dp`` slice of the replicated byte stream and a
restore reassembles it from the group's shards. Private state (a sharded optimizer's own part)
is saved whole by its owner. A shard is laid out as ``[private bytes][replicated slice]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# mesh dimensions whose ranks hold the same state (plain data parallel, HSDP's replicate
# dimension, an unnamed 1-D mesh): the razor's dp group spans them
DP_DIMS = frozenset({"", "dp", "dp_replicate", "replicate", "ddp"})


@dataclass(frozen=True)
class Layout:
    """The job's parallel shape and this worker's role in it."""

    dp: int = 1
    dp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    # the names of the mesh's dimensions ("" where unnamed) when the layout came from a mesh
    # (``from_mesh``): DTensors replicated over its dp dimensions are then razored like plain state
    mesh_dims: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, size, rank in (("dp", self.dp, self.dp_rank), ("pp", self.pp, self.pp_rank), ("tp", self.tp, self.tp_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank={rank} must be in [0, {name}={size})")

    @property
    def role(self) -> str:
        """The role's name: stable across restarts, independent of network ranks."""
        return role_name(self.dp_rank, self.pp_rank, self.tp_rank)

    def dp_peers(self) -> list[str]:
        """Roles of this role's dp group (same pp and tp ranks), in dp-rank order."""
        return [role_name(d, self.pp_rank, self.tp_rank) for d in range(self.dp)]

    def all_roles(self) -> list[str]:
        return [role_name(d, p, t) for d in range(self.dp) for p in range(self.pp) for t in range(self.tp)]

    @classmethod
    def from_mesh(cls, mesh: Any) -> Layout:
        """This rank's layout from a torch ``DeviceMesh``. Dimensions whose ranks hold the same
        state (``dp``, ``dp_replicate``, ``replicate``, unnamed) are dp: the razor splits what
        they replicate. ``pp`` is pipeline. Every other dimension (``tp``, ``dp_shard``, ``cp``,
        ``ep``...) gives its ranks state of their own and counts towards tp. Flattened in mesh
        order. So with HSDP each replica group saves 1/``dp_replicate`` of its FSDP shards."""
        names = tuple(mesh.mesh_dim_names or ())
        return layout_of(tuple(mesh.shape), names, tuple(int(mesh.get_local_rank(i)) for i in range(mesh.ndim)))

    def dp_dims_of(self, mesh_dim_names: tuple[str, ...] | None, ndim: int) -> list[int] | None:
        """Which dimensions of a DTensor's mesh are this layout's dp (its ranks hold the same
        state), or None when the layout cannot tell: given by hand, or a mesh it does not know."""
        names = tuple(mesh_dim_names or ("",) * ndim)
        if self.mesh_dims is None or not set(names) <= set(self.mesh_dims):
            return None
        return [i for i, name in enumerate(names) if name in DP_DIMS]


def layout_of(shape: tuple[int, ...], names: tuple[str, ...], coords: tuple[int, ...]) -> Layout:
    """The layout of the rank at ``coords`` of a mesh of ``shape`` whose dimensions are ``names``."""
    if names and len(names) != len(shape):
        raise ValueError(f"a mesh of shape {shape} with dimension names {names}")
    names = names or ("",) * len(shape)
    sizes = {"dp": 1, "pp": 1, "tp": 1}
    ranks = {"dp": 0, "pp": 0, "tp": 0}
    for i, size in enumerate(shape):
        kind = "dp" if names[i] in DP_DIMS else "pp" if names[i] == "pp" else "tp"
        ranks[kind] = ranks[kind] * size + coords[i]
        sizes[kind] *= size
    return Layout(sizes["dp"], ranks["dp"], sizes["pp"], ranks["pp"], sizes["tp"], ranks["tp"], mesh_dims=names)


def role_name(dp_rank: int, pp_rank: int, tp_rank: int) -> str:
    return f"dp{dp_rank}-pp{pp_rank}-tp{tp_rank}"


ALIGN = 64  # slice boundaries, like storage offsets, fall on 64 bytes: every dtype view stays aligned


def slice_of(total: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of the replicated stream that ``dp_rank`` saves (even split,
    boundaries rounded down to 64 bytes; the last rank ends at ``total``)."""

    def cut(r: int) -> int:
        return total if r >= dp else total * r // dp // ALIGN * ALIGN

    return cut(dp_rank), cut(dp_rank + 1)
