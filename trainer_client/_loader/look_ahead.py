"""The look-ahead: the next step read on a thread of its own while the training thread computes."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait

from ffplane_contract.errors import FFTimeoutError
from trainer_client._loader.part import Fetched, Part, Stage, State

HELD_STEPS = 2  # steps handed out whose memory the look-ahead still holds (dropped on its thread)


class LookAhead(Stage[Fetched]):
    """``take()`` hands out the next step; ``look_ahead()`` starts reading the one after it on the
    look-ahead thread (``next()`` is both). The DataLoader calls ``look_ahead`` once its own Python
    for the step is done (tensor views, the timeline): the thread takes the GIL for its Python as
    soon as it wakes, so started earlier it ran while the training thread waited for the GIL
    rather than while it computed (docs/decisions.md, "Data path, third pass").

    A step the upstream has in hand (``cheap_next``: in the cache file it has mapped, nothing to
    stage) is read on the training thread instead: handing it over cost a wake-up, a switch and a
    wait for the GIL each step (docs/decisions.md, "The DataLoader's look-ahead thread").

    Each step handed out is held until the look-ahead thread drops it ``HELD_STEPS`` steps later:
    a step's mapping is unmapped by whoever drops the last reference, and without this the training
    thread did, as its loop let go of the previous batch — a munmap with a TLB shootdown to the
    other core in the middle of a step (docs/decisions.md, "Data path, fourth pass").

    The upstream is called on one thread at a time (a read on the look-ahead thread is over before
    the training thread makes one), so it needs no locking; the look-ahead thread's exceptions
    re-raise in ``take``. The state is the position of the step ``take`` hands out next.
    """

    def __init__(self, upstream: Part[Fetched], *, what: str, thread_name: str, timeout_s: float) -> None:
        super().__init__(upstream)
        self.what, self.thread_name, self.timeout_s = what, thread_name, timeout_s
        self._pool: ThreadPoolExecutor | None = None
        # the position of the step looked ahead at, and its read on the thread (None: read on the
        # training thread when taken; nothing calls the upstream before that)
        self._ahead: tuple[State, Future[Fetched] | None] | None = None
        self._held: deque[Fetched] = deque()

    def next(self) -> Fetched:
        item = self.take()
        self.look_ahead()
        return item

    def take(self) -> Fetched:
        """The next step (read ahead, or read now)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            ahead = (self.upstream.state_dict(), None if self.upstream.cheap_next() else self._submit())
        state, fut = ahead
        if fut is None:
            item = self._read(here=True)
        else:
            try:
                item = fut.result(timeout=self.timeout_s)
            except FutureTimeout as exc:
                raise FFTimeoutError(f"step {state['next_step']} of {self.what} not ready after {self.timeout_s}s") from exc
        self._held.append(item)
        return item

    def look_ahead(self) -> None:
        """Start reading the step after the one taken (at the end, the read finds the end)."""
        self._ahead = (self.upstream.state_dict(), None if self.upstream.cheap_next() else self._submit())

    def state_dict(self) -> State:
        return dict(self._ahead[0]) if self._ahead is not None else self.upstream.state_dict()

    def reset(self, state: State) -> None:
        self._settle()
        self.upstream.reset(state)

    def close(self) -> None:
        """Stop the thread, let go of the steps held, close the upstream; safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead = None
        while self._held:
            self._held.popleft().release()
        self.upstream.close()

    def _submit(self) -> Future[Fetched]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        return self._pool.submit(self._read)

    def _read(self, here: bool = False) -> Fetched:
        """The upstream's next step, on the look-ahead thread, or ``here`` on the training thread.
        Steps held past ``HELD_STEPS`` are dropped first — on the training thread only those
        in the memory the upstream has in hand (not a file's last reference: its unmap waits for
        the look-ahead thread)."""
        in_hand = self.upstream.in_hand() if here else None
        while len(self._held) > HELD_STEPS:
            if here and self._held[0].memory is not in_hand:
                break
            self._held.popleft().release()  # its copy done before the memory goes
        return self.upstream.next()

    def _settle(self) -> None:
        """Wait for a read under way (the loop moved elsewhere); its step is held, not handed out."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[1] is None:
            return
        done, _ = futures_wait([ahead[1]], timeout=self.timeout_s)
        if done and ahead[1].exception() is None:
            self._held.append(ahead[1].result())
