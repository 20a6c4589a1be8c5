"""The ``ffplane`` command: ``job create|list|show|delete``, ``status``, ``export``, ``demo``.

Settings come from flags, ``$FFPLANE_<FLAG>`` (``$FFPLANE_DATASERVER``, ``$FFPLANE_TOKEN_FILE``),
the ``[ffplane.<command>]`` tables of ``--config``, then defaults: each declared once in
``ffplane_harness.config`` (``ffplane_contract.settings``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ffplane_contract.auth import TOKEN_ENV, read_token
from ffplane_contract.errors import FFPlaneError, NotFoundError
from ffplane_contract.settings import ConfigError
from ffplane_harness.config import PROGRAM


def main(argv: list[str] | None = None) -> int:
    try:
        command, cfg = PROGRAM.parse(argv, os.environ)
        if command == "demo":
            from ffplane_harness.demo import run_demo

            return run_demo(cfg.out, cfg.steps, cfg.model, cfg.keep)
        if command == "export":
            from trainer_client.export import export

            done = export(
                cfg.job, cfg.step, cfg.directory, socket_path=cfg.daemon_socket, durable_dir=cfg.durable_dir, model_key=cfg.model_key
            )
            print(
                f"step {done.step} of {cfg.job}: {done.items} items in {done.directory}, {done.model_tensors} tensors in model.safetensors"
            )
            return 0
        from trainer_client.jobs import Jobs

        if not cfg.dataserver:  # Jobs() would say it in Python's words (dataserver='...')
            raise ValueError("no data server: pass --dataserver http://HOST:PORT or set $FFPLANE_DATASERVER")
        client = Jobs(cfg.dataserver, read_token(cfg.token_file, os.environ.get(TOKEN_ENV)), cfg.timeout_s)
        if command == "status":
            cluster = client.cluster()
            print(json.dumps(cluster, indent=1) if cfg.as_json else render_status(cluster, cfg.job))
            return 0
        return _job(client, command.split()[1], cfg)
    except (ConfigError, ValueError, FFPlaneError) as exc:
        print(f"ffplane: error: {exc}", file=sys.stderr)
        return 2


def _job(client: Any, what: str, cfg: Any) -> int:
    if what == "create":
        job = client.create(cfg.name, cfg.dataset, cfg.dp, cfg.batch_per_rank, cfg.seed, cfg.max_steps)
        print(f"job {job.name}: dataset {cfg.dataset}, dp {cfg.dp} x {cfg.batch_per_rank} per step, max_steps {job.max_steps}")
    elif what == "list":
        print("\n".join(client.list()))
    elif what == "show":
        print(json.dumps(_known(client, "get", cfg.name).model_dump(), indent=1))
    else:
        _known(client, "delete", cfg.name)
        print(f"job {cfg.name} deleted")
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
    rows = [("NODE", "STATE", "ADDRESS", "ROLES (newest step)", "REPLICAS", "CHECKPOINTS", "CACHE", "GATE", "WARM")]
    memory: dict[tuple[str, str], dict[str, Any]] = {}  # (job, role) → what its copies take, from its daemon
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
        memory |= {(r["job"], r["role"]): r["memory"] for r in state.get("roles", []) if r.get("memory")}
        used = f"{cache['bytes'] / 2**20:.0f}/{cache['budget_bytes'] / 2**20:.0f} MiB" if "bytes" in cache else "-"
        gate_s = ("open" if gate["open"] else f"closed: {gate.get('closed_because')}") if "open" in gate else "-"
        alive = "alive" if m["alive"] else ("unreachable" if m.get("unreachable") else "dead")
        if "unreadable" in d:  # its answer was odd: the reason goes below the table
            alive, unreadable = "unreadable", [*unreadable, f"{node}: {d['unreadable']}"]
        held = _held(state.get("held"))
        rows.append(
            (node, alive, m["address"], roles or "-", str(replicas) if state else "-", held, used, gate_s, _warm(state.get("warm")))
        )
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
        role_rows = [("ROLE", "STEP: NODES WITH A COPY", "HOST MEMORY (here + successor)", "SURVIVES")]
        for role, steps in sorted((j.get("shard_locations") or {}).items()):
            newest = sorted(steps.items(), key=lambda kv: -int(kv[0]))[:2]
            mem = memory.get((name, role))
            copies = "; ".join(f"{step}: {', '.join(nodes)}" for step, nodes in newest)
            if mem is None:
                role_rows.append((role, copies, "-", "-"))
            else:
                taken = f"{mem['multiple']:.2f}x ({_mib(mem['here_bytes'])} + {_mib(mem['successor_bytes'])})"
                role_rows.append((role, copies, taken, mem["survives"]))
        out.append(_table(role_rows))
    failures = [("WHEN", "WHAT", "NODE", "JOB", "RECOVERED AFTER")]
    for f in c.get("failures", []):
        when = time.strftime("%H:%M:%S", time.localtime(f["at"]))
        rec = f"{f['recovered_after_s']:.2f} s" if f.get("recovered_after_s") is not None else "-"
        failures.append((when, f["kind"], str(f.get("node")), str(f.get("job") or "-"), rec))
    if len(failures) > 1:
        out += ["\nrecent failures", _table(failures)]
    return "\n".join(out)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _held(held: Any) -> str:
    """What a node holds of checkpoints: slots and replica files, and their multiple of the
    shards of the roles saving there."""
    if not isinstance(held, dict) or "slots_bytes" not in held:
        return "-"
    multiple = f" = {held['multiple']:.2f}x" if isinstance(held.get("multiple"), (int, float)) else ""
    return _mib(held["slots_bytes"] + held.get("replicas_bytes", 0)) + multiple


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
