"""A training-loop stand-in run as a real process: reads batches, records each, checkpoints.

Usage: python -m tests.trainer_client._reader_worker JOB DP_RANK OUT_DIR [--stall-after N] [--step-s S]
Appends ``step sha256`` per batch to OUT_DIR/steps.txt and saves the loader state to
OUT_DIR/state.json (atomically) after each step, resuming from it if present.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from trainer_client import DataLoader


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("dp_rank", type=int)
    p.add_argument("out", type=Path)
    p.add_argument("--stall-after", type=int, default=None, help="sleep forever after this many steps")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds of 'training' per step")
    args = p.parse_args()
    loader = DataLoader(args.job, args.dp_rank)
    state_file = args.out / "state.json"
    if state_file.exists():
        loader.load_state_dict(json.loads(state_file.read_text()))
    done = 0
    with open(args.out / "steps.txt", "a") as log:
        for batch in loader:
            step = loader.next_step - 1
            digest = hashlib.sha256()
            for name in sorted(batch):
                value = batch[name]
                digest.update(value.numpy().tobytes() if hasattr(value, "numpy") else b"".join(bytes(v) for v in value))
            log.write(f"{step} {digest.hexdigest()} {loader.source}\n")
            log.flush()
            tmp = state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(loader.state_dict()))
            os.replace(tmp, state_file)
            done += 1
            time.sleep(args.step_s)
            if args.stall_after is not None and done >= args.stall_after:
                while True:
                    time.sleep(1)


if __name__ == "__main__":
    main()
