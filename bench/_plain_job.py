"""examples/train_plain.py, unchanged, with the recovery timeline events ffplane's library emits
(restored, data_ready, saved = step done) so bench/recovery.py times both sides alike: its
``batches`` generator is wrapped and a global optimizer-step hook marks each step done.
torchrun ... _plain_job.py --data F --out D --steps N --save-every K [--job J, ignored]
"""

from __future__ import annotations

import sys
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


def _step_done(*_: Any) -> None:
    emit("saved", step=_current[0])  # "step done", as ffplane's save marks it


_plain_batches = train_plain.batches

if __name__ == "__main__":
    if "--job" in sys.argv:  # the harness launches either script alike
        i = sys.argv.index("--job")
        del sys.argv[i : i + 2]
    train_plain.batches = _timed_batches
    register_optimizer_step_post_hook(_step_done)
    train_plain.main()
