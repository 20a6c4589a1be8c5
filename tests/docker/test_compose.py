"""docker/compose.yaml as shipped: its services' commands started as processes the way compose
would run them — each service in a network namespace of its own that resolves the others by
name, each named volume a folder (a tmpfs one on /dev/shm), the image's working directory the
repository — in dependency order, one-shot services to a clean exit, servers until their health
URL answers; the two-node torchrun job must train to the end. No Docker engine is needed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests._servers import TOKEN

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
WORKDIR = "/opt/ffplane"  # the image's WORKDIR: the repository here
OUR_COMMANDS = ("dataserver", "statestore", "ffplane")


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # merge keys (<<) as compose reads them
    return loaded


def _order(services: dict[str, Any]) -> list[str]:
    done: list[str] = []
    while len(done) < len(services):
        ready = [s for s in services if s not in done and all(d in done for d in services[s].get("depends_on", {}))]
        assert ready, f"depends_on has a cycle among {sorted(set(services) - set(done))}"
        done += sorted(ready)
    return done


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path → named volume."""
    return {m.split(":")[1]: m.split(":")[0] for m in service.get("volumes", [])}


def _interpolate(value: str, env: dict[str, str]) -> str:
    """``${NAME}``, ``${NAME:?error}`` and ``${NAME:-default}`` as Compose fills them in."""

    def fill(m: re.Match[str]) -> str:
        if m.group(1) in env or not m.group(2).startswith(":-"):
            return env[m.group(1)]
        return m.group(2)[2:]

    return re.sub(r"\$\{(\w+)((?::[?-][^}]*)?)\}", fill, value)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed (.ci/run installs Debian's)")
def test_compose_reads_the_file_as_shipped() -> None:
    """``docker-compose config``: the file parses as Compose does it, and refuses to run without
    the job token rather than with an empty one."""
    env = {k: v for k, v in os.environ.items() if k != "FFPLANE_TOKEN"}
    cmd = ["docker-compose", "-f", str(COMPOSE), "config"]
    refused = subprocess.run(cmd + ["-q"], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "set FFPLANE_TOKEN" in refused.stderr
    done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "FFPLANE_TOKEN": TOKEN}, timeout=120)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert set(resolved["services"]) == set(_compose()["services"])
    assert all(svc["environment"]["FFPLANE_TOKEN"] == TOKEN for svc in resolved["services"].values())
    assert {n: s.get("restart") for n, s in resolved["services"].items()} == RESTART
    (build,) = [s["build"] for s in resolved["services"].values() if "build" in s]
    assert build["args"]["TORCH_INDEX_URL"] == _dockerfile_torch_index()  # unset: the Dockerfile's own default
    mirror = "https://mirror.example/whl/cpu"
    done = subprocess.run(cmd, capture_output=True, text=True, env={**env, "FFPLANE_TOKEN": TOKEN, "TORCH_INDEX_URL": mirror}, timeout=120)
    assert done.returncode == 0, done.stderr
    (build,) = [s["build"] for s in yaml.safe_load(done.stdout)["services"].values() if "build" in s]
    assert build["args"]["TORCH_INDEX_URL"] == mirror  # a site with a mirror builds the image


# A server that crashed is started again; a trainer's torchrun restarts failed workers, and the
# trainer itself is started again while it has not ended the job (exit 0). One-shot services none.
RESTART = {
    "dataset": None,
    "job": None,
    "dataserver": "unless-stopped",
    "node0": "unless-stopped",
    "node1": "unless-stopped",
    "trainer0": "on-failure",
    "trainer1": "on-failure",
}


def _dockerfile_torch_index() -> str:
    """The Dockerfile's default TORCH_INDEX_URL, its ${TORCH_INDEX} filled in."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)$", dockerfile, re.MULTILINE))
    assert '--index-url "${TORCH_INDEX_URL}"' in dockerfile, "torch must come from TORCH_INDEX_URL"
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], args["TORCH_INDEX_URL"])


def test_the_compose_file_survives_a_crash_builds_once_and_advertises_a_reachable_url() -> None:
    """Issue 39: a daemon that crashed stayed down, both trainers exited and nothing started
    them again; every service built the image; the torch index was fixed in the Dockerfile; the
    data server advertised http://0.0.0.0:8470."""
    services = _compose()["services"]
    assert {n: s.get("restart") for n, s in services.items()} == RESTART
    for name, s in services.items():
        argv = [str(a) for a in s["command"]]
        if argv[0] == "torchrun":  # a worker that fails is restarted by torchrun, warm
            assert int(argv[argv.index("--max-restarts") + 1]) >= 3, name
            assert argv[argv.index("-m") + 1] == "trainer_client.warm_start", name
            assert s["environment"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1", f"{name}: a fresh rendezvous store per round"
    # one build: the others run its image and never pull it (Compose would try a registry)
    builders = [n for n, s in services.items() if "build" in s]
    assert len(builders) == 1, f"{builders} build the image"
    assert {s["image"] for s in services.values()} == {"ffplane:cpu"}
    assert all(s.get("pull_policy") == "never" for n, s in services.items() if n not in builders)
    args = services[builders[0]]["build"]["args"]
    assert _interpolate(args["TORCH_INDEX_URL"], {}) == _dockerfile_torch_index()
    # the coordinator names a URL the other services reach
    ds = [str(a) for a in services["dataserver"]["command"]]
    url = ds[ds.index("--advertise-url") + 1]
    assert url == f"http://dataserver:{ds[ds.index('--port') + 1]}"
    for name, s in services.items():
        argv = [str(a) for a in s["command"]]
        assert s["environment"]["FFPLANE_DATASERVER"] == url, name
        if "--dataserver" in argv:
            assert argv[argv.index("--dataserver") + 1] == url, name


def test_the_compose_file_is_consistent() -> None:
    c = _compose()
    services, volumes = c["services"], c["volumes"]
    for name, s in services.items():
        assert s.get("command"), f"{name} has no command"
        for dep, how in s.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on {dep}, which is no service"
            one_shot = services[dep].get("healthcheck", {}).get("disable")  # runs to its end; servers have a health URL
            expected = "service_completed_successfully" if one_shot else "service_healthy"
            assert how["condition"] == expected, f"{name} waits for {dep} with {how['condition']}, not {expected}"
        mounts = _mounts(s)
        assert set(mounts.values()) <= set(volumes), f"{name} mounts undeclared volumes"
        argv = [str(a) for a in s["command"]]
        for arg in " ".join(argv).split():
            if arg.startswith("/") and not arg.startswith(WORKDIR):
                assert any(arg == m or arg.startswith(m.rstrip("/") + "/") for m in mounts), f"{name}: {arg} is in none of its volumes"
        env = s.get("environment", {})
        if argv[0] in OUR_COMMANDS:  # the flags (and the service's variables) parse as the command parses them
            module = {"dataserver": "dataserver.cli", "statestore": "statestore.cli", "ffplane": "ffplane_harness.config"}[argv[0]]
            __import__(module, fromlist=["PROGRAM"]).PROGRAM.parse(argv[1:], {k: str(v) for k, v in env.items()})
        assert "FFPLANE_TOKEN" in env, f"{name} gets no token"
        if "FFPLANE_DAEMON_SOCKET" in env:  # a trainer shares its node daemon's root
            root = env["FFPLANE_DAEMON_SOCKET"].rsplit("/", 1)[0]
            daemons = [n for n, o in services.items() if "--root" in o["command"] and _mounts(o).get(root) == mounts.get(root)]
            assert len(daemons) == 1, f"{name}'s daemon socket is in the root of {daemons}, not of exactly one daemon"
    for vol in ("node0-shm", "node1-shm"):
        assert volumes[vol]["driver_opts"]["type"] == "tmpfs", "a daemon root must be tmpfs"


@pytest.mark.timeout(600)
def test_the_compose_services_run_as_processes(tmp_path: Path) -> None:
    from ffplane_harness.netns import Netns, available
    from trainer_client.warm_start import stop

    if available():
        pytest.skip(str(available()))
    c = _compose()
    services = c["services"]
    order = _order(services)
    tag = uuid.uuid4().hex[:6]
    folders = {
        vol: (
            Path("/dev/shm") / f"ffp-compose-{tag}-{vol}" if (spec or {}).get("driver_opts", {}).get("type") == "tmpfs" else tmp_path / vol
        )
        for vol, spec in c["volumes"].items()
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def warm_dir(name: str) -> Path:  # the zygote's socket: in the container's own /dev/shm
        return Path("/dev/shm") / f"ffp-compose-{tag}-{name}-warm"

    net = Netns(len(services), rate=None)
    etc = [Path("/etc/netns") / node.ns for node in net.nodes]
    try:
        for folder in folders.values():
            folder.mkdir(parents=True)
        ip = {name: node.addr for name, node in zip(order, net.nodes)}
        hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in ip.items())
        me = socket.gethostname()  # a container's own host name resolves to its address; here all share this one
        for d, node in zip(etc, net.nodes):
            d.mkdir(parents=True)
            (d / "hosts").write_text(hosts + f"{node.addr} {me}\n")  # ip netns exec mounts it over /etc/hosts
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("FFPLANE_")} | {
            "FFPLANE_TOKEN": TOKEN,
            "PYTHONPATH": str(REPO),
            "FFPLANE_DIE_WITH_PARENT": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",  # dataserver, statestore, ffplane, torchrun
        }
        for name, node in zip(order, net.nodes):
            s = services[name]
            mounts = _mounts(s)

            def local(value: str, mounts: dict[str, str] = mounts) -> str:
                for path, vol in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                    value = re.sub(rf"(?<![\w/]){re.escape(path)}(?=/|\b|$)", str(folders[vol]), value)
                return value

            env = base_env | {k: local(_interpolate(str(v), base_env)) for k, v in s.get("environment", {}).items()}
            env["FFPLANE_WARM_DIR"] = str(warm_dir(name))
            argv = [local(str(a)) for a in s["command"]]
            for dep in s.get("depends_on", {}):
                if dep in procs and services[dep].get("healthcheck", {}).get("disable"):
                    assert procs[dep].wait(timeout=180) == 0, f"{dep} failed: {_log(tmp_path, dep)}"
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            procs[name] = subprocess.Popen(node.exec_argv(argv), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            health = env.get("FFPLANE_HEALTH_URL")
            if health:  # a server: wait until it is healthy, as depends_on: service_healthy does
                url = health.replace("127.0.0.1", node.addr)
                deadline = time.monotonic() + 120
                while not _answers(url):
                    assert procs[name].poll() is None, f"{name} exited: {_log(tmp_path, name)}"
                    assert time.monotonic() < deadline, f"{name} never became healthy: {_log(tmp_path, name)}"
                    time.sleep(0.2)
        for trainer in ("trainer0", "trainer1"):
            assert procs[trainer].wait(timeout=400) == 0, f"{trainer}: {_log(tmp_path, trainer)}"
        assert (folders["out"] / "final.pt").exists()  # rank 0 wrote the trained weights
        assert "step 19 loss" in _log(tmp_path, "trainer0")
        status = httpx.get(f"http://{ip['dataserver']}:8470/v1/cluster").json()
        assert status["jobs"]["compose"]["committed_step"] == 19 and sorted(status["ring"]) == ["node0", "node1"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for name in services:  # a trainer's zygote, in a session of its own
            stop(warm_dir(name))
        net.close()
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _log(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
