"""The Kubernetes manifests and the Dockerfile: valid (kubernetes-validate --strict) and saying
what a multi-host deployment needs, flag by flag against the commands they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = sorted((REPO / "docker" / "k8s").glob("*.yaml"))


def _docs() -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for f in K8S for d in yaml.safe_load_all(f.read_text()) if d}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_manifests_validate_strictly() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *map(str, K8S)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout and "failed" not in done.stdout.lower()


def test_the_pytorchjob_runs_the_same_pod(tmp_path: Path) -> None:
    """The Kubeflow PyTorchJob (a CRD, so kubernetes-validate has no schema for it): its pod
    template validates strictly as a PodTemplate, and it runs what the plain Job runs."""
    (job,) = yaml.safe_load_all((REPO / "docker" / "k8s" / "operators" / "pytorchjob.yaml").read_text())
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and sum(r["replicas"] for r in specs.values()) == 2
    template = specs["Master"]["template"]
    assert specs["Worker"]["template"] == template
    as_pod = tmp_path / "pod.yaml"
    as_pod.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "pytorch"}, "template": template}))
    done = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", str(as_pod)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (container,) = template["spec"]["containers"]
    assert container["name"] == "pytorch"  # the operator finds its container by that name
    plain = _docs()["Job/ffplane-train"]["spec"]["template"]["spec"]["containers"][0]
    assert container["env"] == plain["env"] and container["volumeMounts"] == plain["volumeMounts"]
    command = container["command"][-1]
    assert "$MASTER_ADDR:$MASTER_PORT" in command and "keep_alive_interval" in command and "examples/train_ffplane.py" in command


def test_the_manifests_say_what_multi_host_needs() -> None:
    docs = _docs()
    deploy = docs["Deployment/ffplane-dataserver"]["spec"]
    assert deploy["strategy"]["type"] == "Recreate"  # never two coordinators
    (ds,) = deploy["template"]["spec"]["containers"]
    udp = _arg(ds["args"], "--heartbeat-udp-port")
    service_ports = {(p["port"], p["protocol"]) for p in docs["Service/ffplane-dataserver"]["spec"]["ports"]}
    assert (int(udp), "UDP") in service_ports and (int(_arg(ds["args"], "--port")), "TCP") in service_ports
    daemonset = docs["DaemonSet/ffplane-statestore"]["spec"]["template"]["spec"]
    assert daemonset["hostNetwork"] and daemonset["dnsPolicy"] == "ClusterFirstWithHostNet"
    (daemon,) = daemonset["containers"]
    args = daemon["args"]
    assert _arg(args, "--host") == "0.0.0.0" and _arg(args, "--advertise-address") == "$(NODE_IP)"
    assert _arg(args, "--dataserver").startswith("http://ffplane-dataserver:")  # the Service name resolves
    bulk = int(_arg(args, "--bulk-port"))  # fixed, so a firewall between nodes can let it through
    assert {"containerPort": bulk, "name": "bulk", "protocol": "TCP"} in daemon["ports"]
    budget_mib = int(_arg(args, "--budget-mb"))
    (init,) = daemonset["initContainers"]
    size = int(init["command"][-1].split("size=")[1].split("m,")[0])
    assert budget_mib < size <= budget_mib * 1.2, "the tmpfs is sized from the budget"
    assert any(m["mountPath"] == _arg(args, "--root") for m in daemon["volumeMounts"])
    for container in (ds, daemon):
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["resources"]["limits"]["memory"]
        token = next(e for e in container["env"] if e["name"] == "FFPLANE_TOKEN")
        assert token["valueFrom"]["secretKeyRef"]["name"] == "ffplane-token"
    train = docs["Job/ffplane-train"]["spec"]["template"]["spec"]
    (worker,) = train["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["FFPLANE_DAEMON_SOCKET"].startswith(_arg(args, "--root"))  # the daemon's root, on the host
    assert "keep_alive_interval" in worker["command"][-1]  # the rendezvous setting node loss needs


def test_the_image_is_not_root_and_has_a_healthcheck() -> None:
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root"))
    assert "HEALTHCHECK" in dockerfile and "ARG TORCH_INDEX" in dockerfile  # CPU and CUDA variants
    assert "COPY examples examples" in dockerfile and "COPY ffplane_harness" in dockerfile  # what compose runs
