"""A worker the harness launches: its timeline handler attached first, then the training script
run as ``python script.py args`` would run it. The demo, the chaos soak and the benchmarks put it
between torchrun (or ``trainer_client.warm_start``) and the script, so the script and the library
stay as users run them and the event files are the harness's own doing:

    torchrun ... -m ffplane_harness.worker --events DIR [--no-batches] train.py --its --args
    torchrun ... -m trainer_client.warm_start -m ffplane_harness.worker --events DIR train.py ...
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from ffplane_harness.timeline import attach_timeline

MODULE = "ffplane_harness.worker"


def entry(events: str | os.PathLike[str], batches: bool = True) -> list[str]:
    """The launcher arguments that put a script under this entry (torchrun's ``-m`` flag and
    warm_start's both take a module this way): ``[*entry(d), script, *args]``."""
    return ["-m", MODULE, "--events", os.fspath(events), *([] if batches else ["--no-batches"])]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", required=True, help="the folder the timeline's events-<pid>.jsonl files go in")
    ap.add_argument("--no-batches", action="store_true", help="leave out the per-step batch lines (a digest and an append a step)")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    attach_timeline(args.events, batches=not args.no_batches)
    sys.argv = [args.script, *args.args]
    sys.path[0] = os.path.dirname(os.path.abspath(args.script))  # as ``python script.py`` has it
    runpy.run_path(args.script, run_name="__main__")  # its SystemExit and exceptions end this process as they would it


if __name__ == "__main__":
    main(sys.argv[1:])
