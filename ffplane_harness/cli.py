"""The ``ffplane`` command: ``job create|list|show|delete``, ``status``, ``export``, ``demo``.

Settings come from flags, ``$FFPLANE_<FLAG>`` (``$FFPLANE_DATASERVER``, ``$FFPLANE_TOKEN_FILE``),
the ``[ffplane.<command>]`` tables of ``--config``, then defaults (``ffplane_contract.settings``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dataserver.jobs import LAYOUT_LIMIT, SEED_LIMIT
from ffplane_contract.auth import load_token
from ffplane_contract.errors import FFPlaneError, NotFoundError
from ffplane_contract.limits import MAX_STEP, STEP_LIMIT
from ffplane_contract.settings import ConfigError, Number, command_parser, parse, positive_int, positive_seconds, subcommand

_LAYOUT = Number(int, 1, LAYOUT_LIMIT)
_SEED = Number(int, 0, SEED_LIMIT - 1)
_STEP = Number(int, 0, MAX_STEP)
_MAX_STEPS = Number(int, 1, STEP_LIMIT)


def _parser() -> argparse.ArgumentParser:
    p = command_parser("ffplane", "ffplane: jobs, the cluster's state, exports, and a demo on this machine")
    sub = p.add_subparsers(dest="command", required=True)

    job = subcommand(sub, "job", "create, list, show or delete jobs on the data servers")
    jobs = job.add_subparsers(dest="job_command", required=True)
    create = subcommand(jobs, "create", "create a job (an identical one that exists is left as it is)")
    create.add_argument("name", help="the job's name (letters, digits, '-', '_', '.')")
    create.add_argument("--dataset", required=True, help="a dataset the data server serves (GET /v1/datasets)")
    create.add_argument("--dp", type=_LAYOUT, required=True, help="data-parallel ranks")
    create.add_argument("--batch-per-rank", type=_LAYOUT, required=True, help="samples per rank per step")
    create.add_argument("--seed", type=_SEED, default=0, help="the plan's shuffle seed")
    create.add_argument("--max-steps", type=_MAX_STEPS, default=None, help="the job's length in optimizer steps (none: unbounded)")
    for name, help_ in (
        ("list", "the jobs' names"),
        ("show", "a job's record as JSON"),
        ("delete", "forget a job (daemons keep its checkpoints)"),
    ):
        cmd = subcommand(jobs, name, help_)
        if name != "list":
            cmd.add_argument("name", help="the job's name")
    for cmd in (create, *(jobs.choices[n] for n in ("list", "show", "delete"))):
        _server_flags(cmd)

    status = subcommand(sub, "status", "the cluster as a table: nodes, roles and their restorable step, replicas, cache, gate")
    status.add_argument("--job", default=None, help="only this job (default: every job)")
    status.add_argument("--json", action="store_true", help="print the gathered JSON instead of the table")
    _server_flags(status)

    exp = subcommand(sub, "export", "a saved step as a plain DCP checkpoint directory (+ model.safetensors), readable without ffplane")
    exp.add_argument("job", help="the job")
    exp.add_argument("step", type=_STEP, help="the step to export")
    exp.add_argument("directory", type=Path, help="where the DCP checkpoint goes")
    exp.add_argument(  # dest daemon_socket: its variable is the one every process reads, $FFPLANE_DAEMON_SOCKET
        "--daemon-socket",
        "--socket",
        dest="daemon_socket",
        type=Path,
        default=None,
        help="the node daemon's socket (default: /dev/shm/ffplane/daemon.sock)",
    )
    exp.add_argument("--durable-dir", type=Path, default=None, help="read the durable tier here when no daemon answers")
    exp.add_argument("--model-key", default="model", help="the state key whose tensors go to model.safetensors")

    from ffplane_harness.job_runner import MODELS  # the demo's jobs (imported only to build this parser)

    demo = subcommand(sub, "demo", "two nodes, a killed worker, a lost node: timelines and a bitwise check")
    demo.add_argument(
        "--out", type=Path, default=None, help="where demo.json and the PNGs go (default: a new folder in the temp dir, printed)"
    )
    demo.add_argument("--steps", type=positive_int, default=40, help="training steps of the demo job")
    demo.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="gpt",
        help="gpt: the GPT under DDP; fsdp2: sharded with fully_shard, saved by the Checkpointer; fsdp2-dcp: the same through dcp.save/load",
    )
    demo.add_argument("--keep", action="store_true", help="keep the work folder (logs, events)")
    return p


def _server_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--dataserver", default=None, help="data server URL(s), comma-separated")
    cmd.add_argument("--token-file", default=None, help="the job token's file (else $FFPLANE_TOKEN)")
    cmd.add_argument("--timeout-s", type=positive_seconds, default=10.0, help="per request")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(_parser(), argv)
        if args.command == "demo":
            from ffplane_harness.demo import run_demo

            return run_demo(args.out, args.steps, args.model, args.keep)
        if args.command == "export":
            from trainer_client.export import export

            done = export(
                args.job, args.step, args.directory, socket_path=args.daemon_socket, durable_dir=args.durable_dir, model_key=args.model_key
            )
            print(
                f"step {done.step} of {args.job}: {done.items} items in {done.directory}, {done.model_tensors} tensors in model.safetensors"
            )
            return 0
        from trainer_client.jobs import Jobs

        if not args.dataserver:  # Jobs() would say it in Python's words (dataserver='...')
            raise ValueError("no data server: pass --dataserver http://HOST:PORT or set $FFPLANE_DATASERVER")
        client = Jobs(args.dataserver, load_token(args.token_file), args.timeout_s)
        if args.command == "status":
            cluster = client.cluster()
            print(json.dumps(cluster, indent=1) if args.json else render_status(cluster, args.job))
            return 0
        return _job(client, args)
    except (ConfigError, ValueError, FFPlaneError) as exc:
        print(f"ffplane: error: {exc}", file=sys.stderr)
        return 2


def _job(client: Any, args: argparse.Namespace) -> int:
    if args.job_command == "create":
        job = client.create(args.name, args.dataset, args.dp, args.batch_per_rank, args.seed, args.max_steps)
        print(f"job {job['name']}: dataset {args.dataset}, dp {args.dp} x {args.batch_per_rank} per step, max_steps {job.get('max_steps')}")
    elif args.job_command == "list":
        print("\n".join(client.list()))
    elif args.job_command == "show":
        print(json.dumps(_known(client, "get", args.name), indent=1))
    else:
        _known(client, "delete", args.name)
        print(f"job {args.name} deleted")
    return 0


def _known(client: Any, method: str, name: str) -> Any:
    """``client.method(name)``, a 404 told in this command's words (the server's names its HTTP route)."""
    try:
        return getattr(client, method)(name)
    except NotFoundError as exc:
        raise NotFoundError(
            f"unknown job {name!r} on {client.client.url}; create it with ffplane job create {name} --dataset D --dp N --batch-per-rank B "
            "(ffplane job list names the jobs there are)",
            exc.status,
        ) from exc


# --- status ------------------------------------------------------------------------------------


def render_status(c: dict[str, Any], only_job: str | None = None) -> str:
    """``GET /v1/cluster`` as tables: nodes (ring order), each job's roles, recent failures."""
    ring = c["ring"]
    rows = [("NODE", "STATE", "ADDRESS", "ROLES (newest step)", "REPLICAS", "CACHE", "GATE", "WARM")]
    unreadable: list[str] = []
    order = sorted(c["members"], key=lambda n: (n not in ring, ring.index(n) if n in ring else 0, n))
    for node in order:
        m, d = c["members"][node], c["daemons"].get(node, {})
        state, cache, gate = d.get("state", {}), d.get("cache", {}), d.get("gate", {})
        roles = ", ".join(
            f"{r['job']}/{r['role']}@{max((v['step'] for v in r.get('versions', [])), default='-')}"
            for r in state.get("roles", [])
            if only_job in (None, r["job"])
        )
        replicas = len({(r["job"], r["role"]) for r in state.get("replicas", []) if r.get("kind") != "incoming"})
        used = f"{cache['bytes'] / 2**20:.0f}/{cache['budget_bytes'] / 2**20:.0f} MiB" if "bytes" in cache else "-"
        gate_s = ("open" if gate["open"] else f"closed: {gate.get('closed_because')}") if "open" in gate else "-"
        alive = "alive" if m["alive"] else ("unreachable" if m.get("unreachable") else "dead")
        if "unreadable" in d:  # its answer was odd: the reason goes below the table
            alive, unreadable = "unreadable", [*unreadable, f"{node}: {d['unreadable']}"]
        rows.append((node, alive, m["address"], roles or "-", str(replicas) if state else "-", used, gate_s, _warm(state.get("warm"))))
    out = [f"coordinator {c['leader']}", _table(rows)]
    if unreadable:
        out += ["\nunreadable daemons (alive, but their answer could not be read)", *unreadable]
    for name, j in sorted(c["jobs"].items()):
        if only_job not in (None, name):
            continue
        restorable, committed = j.get("restorable_step"), j.get("committed_step")
        restorable_s = "nothing restorable yet" if restorable is None else f"restorable step {restorable}"
        committed_s = "nothing committed yet" if committed is None else f"newest committed {committed}"
        out.append(f"\njob {name}: {restorable_s}, {committed_s}")
        role_rows = [("ROLE", "STEP: NODES WITH A COPY")]
        for role, steps in sorted((j.get("shard_locations") or {}).items()):
            newest = sorted(steps.items(), key=lambda kv: -int(kv[0]))[:2]
            role_rows.append((role, "; ".join(f"{step}: {', '.join(nodes)}" for step, nodes in newest)))
        out.append(_table(role_rows))
    failures = [("WHEN", "WHAT", "NODE", "JOB", "RECOVERED AFTER")]
    for f in c.get("failures", []):
        when = time.strftime("%H:%M:%S", time.localtime(f["at"]))
        rec = f"{f['recovered_after_s']:.2f} s" if f.get("recovered_after_s") is not None else "-"
        failures.append((when, f["kind"], str(f.get("node")), str(f.get("job") or "-"), rec))
    if len(failures) > 1:
        out += ["\nrecent failures", _table(failures)]
    return "\n".join(out)


def _warm(warm: Any) -> str:
    """A node's warm-start zygotes: ``ready`` (a restarted or spare worker forks with torch
    imported), ``starting`` (still importing), ``-`` (none: a worker here starts cold)."""
    if not isinstance(warm, dict) or not (warm.get("ready") or warm.get("starting")):
        return "-"
    return "ready" if warm.get("ready") else "starting"


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    sys.exit(main())
