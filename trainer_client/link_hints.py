"""Tell the node's link gate when this process's collectives are using the network.

The daemon's gate holds every STATE chunk while any local training process has a collective in
flight. Each process keeps one counter in ``<daemon root>/hints/<pid>`` (shared memory; the
daemon maps it read-only and drops it when the process is gone)::

    hints = LinkHints()
    with hints.collective():          # around a hand-written collective
        dist.all_reduce(t)
    ddp.register_comm_hook(None, hints.ddp_comm_hook(ddp))   # every DDP gradient bucket
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ffplane_contract import files


class LinkHints:
    def __init__(self, socket_path: str | os.PathLike[str] | None = None) -> None:
        root = files.socket_path(socket_path).parent
        directory = root / files.HINTS_DIR
        if not directory.is_dir():
            raise FileNotFoundError(f"no hints folder at {directory}: is the node daemon running with root {root}?")
        self.path = files.hint_path(root, os.getpid())
        # never truncate: the daemon may have this file mapped (a second LinkHints in the process)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < files.HINT.size:
                os.ftruncate(fd, files.HINT.size)
            self._mm = mmap.mmap(fd, files.HINT.size)
        finally:
            os.close(fd)
        self._depth = 0
        self._lock = threading.Lock()  # the DDP hook's completion runs on gloo's threads

    def _add(self, delta: int) -> None:
        with self._lock:
            self._depth = max(0, self._depth + delta)
            files.HINT.pack_into(self._mm, 0, self._depth)

    @property
    def busy(self) -> bool:
        return self._depth > 0

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Mark the network busy for the duration of the block."""
        self._add(1)
        try:
            yield
        finally:
            self._add(-1)

    def ddp_comm_hook(self, model: Any = None, reproducible: bool = True) -> Callable[[Any, Any], Any]:
        """DDP's averaging all-reduce, marked busy until it completes, run once the last
        ``Checkpointer.save`` is committed and replicated (see ``checkpointer.settle_all``).

        ``reproducible``: sum every gradient element in the same position whatever DDP's bucket
        layout. A ring all-reduce's float summation order depends on where an element sits in
        the buffer, and DDP lays out its buckets anew after its first iteration — which, after
        a restore, is a later step than in an uninterrupted run — so with more than two ranks a
        recovered run drifted by a few ulps (found by the node-loss test). With ``model`` (the
        DDP module) the hook gathers the step's buckets and all-reduces every gradient once, in
        the model's parameter order: one collective per step and dtype. Without it, one
        collective per gradient tensor. ``False`` gives DDP's usual one per bucket.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from trainer_client.checkpointer import settle_all

        if reproducible and model is not None:
            return _annotated(_StepReduce(model, self._add))

        def per_tensor(process_group: Any, bucket: Any) -> Any:
            group = process_group if process_group is not None else dist.group.WORLD
            world = dist.get_world_size(group)
            futs = []
            for grad in bucket.gradients():  # views into bucket.buffer()
                grad.div_(world)
                futs.append(dist.all_reduce(grad, group=group, async_op=True).get_future())
            buffer = bucket.buffer()
            return torch.futures.collect_all(futs).then(lambda _: buffer)

        reduce = per_tensor if reproducible else allreduce_hook

        def hook(process_group: Any, bucket: Any) -> Any:
            settle_all()  # the last save's replica exists before this step's all-reduce runs
            self._add(1)
            try:
                fut = reduce(process_group, bucket)
            except BaseException:
                self._add(-1)
                raise

            def done(f: Any) -> Any:
                self._add(-1)
                return f.value()

            return fut.then(done)

        return _annotated(hook)

    def close(self) -> None:
        self._add(-self._depth)
        try:
            self._mm.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> LinkHints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StepReduce:
    """A DDP comm hook: every bucket of a step waits, and the last one all-reduces all of the
    step's gradients in one flat buffer laid out in the model's parameter order (one buffer per
    dtype), so the result does not depend on DDP's bucket layout. The example job (4 ranks,
    bench/step_cost.py): 938 steps/min; per-tensor collectives 357; DDP's buckets 978.

    DDP keeps its bucket layout from its second step on, so the plan (which gradient goes where
    in the flat buffer, and the buffer itself) is made when the layout is new and reused while the
    step's buckets are the same buffers: a steady step is two list copies, a divide and the
    all-reduce, with no Python per gradient."""

    def __init__(self, model: Any, mark: Callable[[int], None]) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._order: dict[int, int] = {}
        self._mark = mark
        self._waiting: list[tuple[Any, Any]] = []  # (bucket, its future) until the step's last bucket
        self._plan: _Plan | None = None

    def __call__(self, process_group: Any, bucket: Any) -> Any:
        import torch

        from trainer_client.checkpointer import settle_all

        if not self._waiting:
            settle_all()  # the last save's replica exists before this step's all-reduce runs
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._waiting.append((bucket, fut))
        if bucket.is_last():
            waiting, self._waiting = self._waiting, []
            self._reduce(process_group, waiting)
        return fut

    def _plan_for(self, waiting: list[tuple[Any, Any]]) -> _Plan:
        layout = tuple((b.index(), (buf := b.buffer()).data_ptr(), buf.numel()) for b, _ in waiting)
        if self._plan is not None and self._plan.layout == layout:
            return self._plan
        if not self._order:  # parameters keep their storage for the run (optimizers update in place)
            self._order = {p.data_ptr(): i for i, p in enumerate(self.params)}
        grads = sorted(
            ((self._order[p.data_ptr()], g) for bucket, _ in waiting for p, g in zip(bucket.parameters(), bucket.gradients())),
            key=lambda item: item[0],
        )
        by_dtype: dict[Any, list[Any]] = {}
        for _, g in grads:  # views into the bucket buffers: they stay while the buffers do
            by_dtype.setdefault(g.dtype, []).append(g)
        self._plan = _Plan(layout, [_Flat.of(gs) for gs in by_dtype.values()])
        return self._plan

    def _reduce(self, process_group: Any, waiting: list[tuple[Any, Any]]) -> None:
        import torch
        import torch.distributed as dist

        from trainer_client._copy import copy_all

        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        try:
            flats = self._plan_for(waiting).flats
            for f in flats:
                copy_all(f.gather, None, 1)
                f.flat.div_(world)
        except BaseException as exc:
            for _, fut in waiting:
                fut.set_exception(exc)
            raise
        self._mark(1)  # the link is busy until finish() runs
        try:
            futs = [dist.all_reduce(f.flat, group=group, async_op=True).get_future() for f in flats]
        except BaseException as exc:
            self._mark(-1)
            for _, fut in waiting:
                fut.set_exception(exc)
            raise

        def finish(done: Any) -> None:
            self._mark(-1)
            try:
                for f in done.value():
                    f.value()  # re-raises a failed all-reduce
                for f in flats:
                    # one list copy, not a slice, view and copy per gradient on gloo's thread,
                    # which held the GIL for them
                    copy_all(f.scatter, None, 1)
            except BaseException as exc:
                for _, fut in waiting:
                    fut.set_exception(exc)
                return
            for bucket, fut in waiting:
                fut.set_result(bucket.buffer())

        torch.futures.collect_all(futs).then(finish)


@dataclass
class _Flat:
    """One dtype's flat buffer in parameter order and the copies into it and back out."""

    flat: Any
    gather: list[tuple[Any, Any]]  # (part of flat, gradient)
    scatter: list[tuple[Any, Any]]  # (gradient, part of flat)

    @classmethod
    def of(cls, grads: list[Any]) -> _Flat:
        """A new buffer holding ``grads`` (one dtype, any strides) one after another."""
        import torch

        flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype)
        parts = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
        return cls(flat, list(zip(parts, grads)), list(zip(grads, parts)))


@dataclass
class _Plan:
    layout: tuple[tuple[int, int, int], ...]  # (index, buffer address, numel) of each bucket of a step
    flats: list[_Flat]


def _annotated(hook: Any) -> Any:
    """DDP checks a hook's annotations as objects; this module's are strings."""
    import torch
    import torch.distributed as dist

    def call(process_group: Any, bucket: Any) -> Any:
        return hook(process_group, bucket)

    call.__annotations__ = {"process_group": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return call
