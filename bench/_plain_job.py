"""examples/train_plain.py, unchanged, with the recovery timeline events ffplane's library emits
(restored, data_ready, saved = step done) so bench/recovery.py times both sides alike: its
``batches`` generator is wrapped and a global optimizer-step hook marks each step done.
torchrun ... _plain_job.py --data F --out D --steps N --save-every K [--job J, ignored]

With ``FFPLANE_FLOOR=1`` (bench/step_cost.py's ``floor``), the same hook also does, every step, the
least that keeping each step's state on another node costs: one copy of the model's and the
optimizer's tensors into a reused buffer, an XXH3 of it, a TCP send to a receiving process
(``_floor_sink.py``: receive into a reused buffer, XXH3, answer the digest), whose answer is read
at the next step — no control messages, no records, no Python per tensor beyond the copy.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_plain  # noqa: E402

from trainer_client.events import emit  # noqa: E402

_current = [-1]  # the step being trained


def _timed_batches(loader: Any, sampler: Any, start: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    emit("restored", step=start - 1, source="disk" if start else "none")  # -1: nothing on disk yet
    for i, (step, batch) in enumerate(_plain_batches(loader, sampler, start)):
        if i == 0:
            emit("data_ready", step=step)
        _current[0] = step
        yield step, batch


class _FloorSave:
    """FFPLANE_FLOOR: every step's state copied, hashed and sent to a receiving process."""

    def __init__(self) -> None:
        port_file = Path(tempfile.mkdtemp(prefix="ffplane-floor-")) / "port"
        self.sink = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_floor_sink.py")), str(port_file)])
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if time.monotonic() > deadline or self.sink.poll() is not None:
                raise RuntimeError("the floor sink did not start")
            time.sleep(0.01)
        self.sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
        shutil.rmtree(port_file.parent)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf: torch.Tensor | None = None
        self.answer = False  # the previous step's digest is still to be read

    def __call__(self, opt: torch.optim.Optimizer) -> None:
        import xxhash

        tensors = [p.detach() for g in opt.param_groups for p in g["params"]]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self.buf is None:
            self.buf = torch.empty(sum(t.nbytes for t in tensors), dtype=torch.uint8)
        if self.answer:
            self.sock.recv(8, socket.MSG_WAITALL)
        at = 0
        for t in tensors:
            self.buf[at : at + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            at += t.nbytes
        view = self.buf.numpy().data
        xxhash.xxh3_64_intdigest(view)
        self.sock.sendall(struct.pack("<Q", len(view)))
        self.sock.sendall(view)
        self.answer = True


_floor: list[_FloorSave] = []  # made at the first step, in the worker


def _step_done(opt: torch.optim.Optimizer, *_: Any) -> None:
    if os.environ.get("FFPLANE_FLOOR"):
        if not _floor:
            _floor.append(_FloorSave())
        _floor[0](opt)
    emit("saved", step=_current[0])  # "step done", as ffplane's save marks it


_plain_batches = train_plain.batches

if __name__ == "__main__":
    if "--job" in sys.argv:  # the harness launches either script alike
        i = sys.argv.index("--job")
        del sys.argv[i : i + 2]
    train_plain.batches = _timed_batches
    register_optimizer_step_post_hook(_step_done)
    train_plain.main()
