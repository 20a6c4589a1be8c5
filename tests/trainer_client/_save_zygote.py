"""Forks checkpointing workers on demand, so a test can SIGKILL fifty of them in seconds.

Usage: python -m tests.trainer_client._save_zygote SOCKET LOG. Each line "fork" on stdin forks a
worker and prints its PID. A worker restores (checking the restored state is exactly the state of
its step), then saves steps forever, logging ``restored S`` / ``saving S`` / ``committed S``.
Torch is imported and pinned to one thread before any fork, so children start clean.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch

from trainer_client import Checkpointer

torch.set_num_threads(1)
N = 1 << 20  # 4 MiB of fp32, plus a bf16 and a non-contiguous view


def state_for(step: int, buf: dict[str, torch.Tensor] | None = None) -> dict[str, object]:
    if buf is None:
        buf = {"w": torch.empty(N), "h": torch.empty(N // 2, dtype=torch.bfloat16), "i": torch.empty(1024, dtype=torch.int64)}
    buf["w"].fill_(float(step))
    buf["h"].fill_(float(step % 256))
    buf["i"].copy_(torch.arange(1024) + step)
    return {"model": {"w": buf["w"], "wt": buf["w"].view(1024, 1024).t(), "h": buf["h"]}, "optim": {"i": buf["i"]}, "step": step}


def check(state: dict[str, object], step: int) -> bool:
    m = state["model"]
    assert isinstance(m, dict)
    return bool(
        state["step"] == step
        and torch.all(m["w"] == float(step))
        and torch.all(m["h"] == float(step % 256))
        and torch.equal(m["wt"], m["w"].view(1024, 1024).t())
        and torch.equal(state["optim"]["i"], torch.arange(1024) + step)  # type: ignore[index]
    )


def worker(sock: str, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)
    ck = Checkpointer("kill", socket_path=sock)
    restored = ck.restore()
    start = 0
    if restored is not None:
        ok = check(restored.state, restored.step)
        detail = (
            ""
            if ok
            else " "
            + repr({k: (v.flatten()[:3].tolist() if hasattr(v, "flatten") else v) for k, v in restored.state["model"].items()})
            + repr(restored.state["optim"]["i"][:3].tolist())
            + str(restored.state["step"])
        )
        log.write(f"restored {restored.step} {'ok' if ok else 'BAD'}{detail}\n")
        start = restored.step + 1
    else:
        log.write("restored none ok\n")
    state = state_for(start)
    buf = {"w": state["model"]["w"], "h": state["model"]["h"], "i": state["optim"]["i"]}  # type: ignore[index]
    step = start
    while True:
        state = state_for(step, buf)
        log.write(f"saving {step}\n")
        ck.save(step, state)
        ck.wait()
        log.write(f"committed {step}\n")
        step += 1


def main() -> None:
    sock, log_path = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed children
    for line in sys.stdin:
        if line.strip() != "fork":
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                worker(sock, log_path)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
