"""Jobs from Python (``trainer_client.jobs``) and from the ``ffplane`` command, and
``ffplane status`` on a running cluster, against a real data server and daemons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from tests._servers import TOKEN, Proc, until
from trainer_client import Checkpointer, ConflictError, InvalidError, Layout, NotFoundError
from trainer_client.jobs import Jobs


def _ffplane(*argv: str, dataserver: str | None = None, token: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")}
    env |= ({"FFPLANE_TOKEN": TOKEN} if token else {}) | ({"FFPLANE_DATASERVER": dataserver} if dataserver else {})
    return subprocess.run([sys.executable, "-m", "ffplane_harness.cli", *argv], capture_output=True, text=True, timeout=60, env=env)


def test_jobs_from_python(dataserver: Proc) -> None:
    jobs = Jobs(dataserver.url, TOKEN)
    made = jobs.create("py", dataset="tokens", dp=2, batch_per_rank=4, max_steps=10)
    assert made.name == "py" and jobs.create("py", dataset="tokens", dp=2, batch_per_rank=4, max_steps=10).name == "py"
    with pytest.raises(ConflictError, match="different definition"):
        jobs.create("py", dataset="tokens", dp=4, batch_per_rank=4, max_steps=10)
    assert jobs.list() == ["py"] and jobs.get("py").generations[0].dp == 2
    jobs.add_generation("py", start_step=5, dp=1, batch_per_rank=8)  # nothing served yet: allowed
    assert [g.dp for g in jobs.get("py").generations] == [2, 1]
    with pytest.raises(InvalidError, match="dp"):  # refused here, as the server would
        jobs.add_generation("py", start_step=9, dp=0, batch_per_rank=8)
    jobs.delete("py")
    assert jobs.list() == []
    with pytest.raises(NotFoundError, match="unknown job 'py'"):
        jobs.delete("py")
    with pytest.raises(ValueError, match="no data server"):
        Jobs(None)


def test_the_ffplane_job_commands(dataserver: Proc) -> None:
    r = _ffplane("job", "create", "cli", "--dataset", "tokens", "--dp", "2", "--batch-per-rank", "4", dataserver=dataserver.url)
    assert r.returncode == 0 and "job cli: dataset tokens" in r.stdout, r.stderr
    assert _ffplane("job", "list", dataserver=dataserver.url).stdout.split() == ["cli"]
    shown = json.loads(_ffplane("job", "show", "cli", dataserver=dataserver.url).stdout)
    assert shown["dataset"]["name"] == "tokens" and shown["generations"][0]["batch_per_rank"] == 4
    bad = _ffplane("job", "create", "x", "--dataset", "nope", "--dp", "1", "--batch-per-rank", "1", dataserver=dataserver.url)
    assert bad.returncode == 2 and "ffplane: error:" in bad.stderr and "nope" in bad.stderr and "Traceback" not in bad.stderr
    no_token = _ffplane("job", "delete", "cli", dataserver=dataserver.url, token=False)
    assert no_token.returncode == 2 and "FFPLANE_TOKEN" in no_token.stderr
    nowhere = _ffplane("job", "list")
    assert nowhere.returncode == 2 and "no data server" in nowhere.stderr
    assert _ffplane("job", "delete", "cli", dataserver=dataserver.url).returncode == 0
    assert _ffplane("job", "list", dataserver=dataserver.url).stdout.split() == []


def test_a_job_posted_without_a_json_content_type_is_told_so(dataserver: Proc) -> None:
    body = '{"name": "c", "dataset": "tokens", "dp": 1, "batch_per_rank": 2}'
    r = httpx.post(
        dataserver.url + "/v1/jobs",
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["detail"]
    assert httpx.get(dataserver.url + "/v1/jobs").json() == []  # nothing was created


def test_ffplane_status_shows_nodes_roles_and_restorable_step(dataserver: Proc, start_daemon: Callable[..., Proc], shm_root: Path) -> None:
    start_daemon()
    Jobs(dataserver.url, TOKEN).create("st", dataset="tokens", dp=1, batch_per_rank=4, max_steps=10)
    until(lambda: httpx.get(dataserver.url + "/v1/nodes").json()["ring"], what="the daemon in the ring")
    ck = Checkpointer("st", Layout(), socket_path=shm_root / "daemon.sock")
    for step in (1, 2):
        ck.save(step, {"w": torch.full((1024,), float(step))})
    ck.close()
    until(lambda: Jobs(dataserver.url, TOKEN).status("st")["restorable_step"] == 2, what="step 2 restorable")
    r = _ffplane("status", dataserver=dataserver.url)
    assert r.returncode == 0, r.stderr
    (node,) = httpx.get(dataserver.url + "/v1/nodes").json()["ring"]
    assert node in r.stdout and "alive" in r.stdout and "st/dp0-pp0-tp0@2" in r.stdout
    assert "job st: restorable step 2" in r.stdout and "MiB" in r.stdout and "open" in r.stdout
    gathered = json.loads(_ffplane("status", "--json", dataserver=dataserver.url).stdout)
    assert gathered["jobs"]["st"]["restorable_step"] == 2 and node in gathered["daemons"]


def test_the_ffplane_command_speaks_in_its_own_flags(dataserver: Proc) -> None:
    nowhere = _ffplane("job", "list")  # the Python wording (dataserver='...') is for Python callers
    assert nowhere.returncode == 2 and "--dataserver" in nowhere.stderr and "$FFPLANE_DATASERVER" in nowhere.stderr
    assert "dataserver='" not in nowhere.stderr and len(nowhere.stderr.strip().splitlines()) == 1
    unknown = _ffplane("job", "show", "nope", dataserver=dataserver.url)
    assert unknown.returncode == 2 and "unknown job 'nope'" in unknown.stderr and "ffplane job create" in unknown.stderr
    assert "POST /v1/jobs" not in unknown.stderr
    assert (
        _ffplane(
            "job", "create", "fresh", "--dataset", "tokens", "--dp", "1", "--batch-per-rank", "4", dataserver=dataserver.url
        ).returncode
        == 0
    )
    status = _ffplane("status", dataserver=dataserver.url)
    assert status.returncode == 0 and "None" not in status.stdout, status.stdout
    assert "job fresh: nothing restorable yet, nothing committed yet" in status.stdout, status.stdout
    helped = _ffplane("export", "--help")
    assert "FFPLANE_DAEMON_SOCKET" in helped.stdout and "FFPLANE_SOCKET" not in helped.stdout, helped.stdout


def test_the_readme_sets_the_data_server_before_the_ffplane_commands_need_it() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("## Using it", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    assert "export FFPLANE_DATASERVER=" in block
    first_ffplane = min(i for i, line in enumerate(block.splitlines()) if line.startswith("ffplane "))
    assert any(line.startswith("export FFPLANE_DATASERVER=") for line in block.splitlines()[:first_ffplane])
