"""Several nodes on one machine: network namespaces joined by veth links to a bridge, shaped by tc.

``Netns(n)`` builds a hub namespace holding a bridge, ``n`` node namespaces each linked to it by
a veth pair (the node's end shaped with ``tbf``, so "the link is busy" is real), and one more veth
from the caller's namespace to the bridge so the caller can reach every node directly (ops APIs,
readiness checks). ``cut(i)`` / ``heal(i)`` take a node's link down and up. ``close()`` deletes
the namespaces (their veth pairs go with them); every name carries one random prefix, so
leftovers of a killed run are found by ``leftovers()``. Needs root and iproute2; what works in
this kernel (tbf, htb; no netem) is in ../shared/NETNS.md.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ffp"


class NetnsError(RuntimeError):
    """Namespaces cannot be built here; the message says why (not root, no iproute2, ...)."""


@dataclass
class Node:
    index: int
    ns: str
    iface: str  # the node's end of its veth, inside ``ns``
    hub_iface: str  # the other end, on the bridge
    addr: str

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's namespace (``ip netns exec`` execs: same PID)."""
        return ["ip", "netns", "exec", self.ns, *argv]


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


def available() -> str | None:
    """None if namespaces can be built here, else the reason."""
    import os

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


class Netns:
    def __init__(self, n: int, rate: str | None = "1gbit", subnet: str = "10.99") -> None:
        why = available()
        if why:
            raise NetnsError(why)
        self.tag = f"{PREFIX}{secrets.token_hex(2)}"
        self.hub = f"{self.tag}hub"
        self.nodes: list[Node] = []
        self.subnet = f"{subnet}.{secrets.randbelow(200) + 20}"
        self._made: list[str] = []
        try:
            self._build(n, rate)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int, rate: str | None) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")
        for i in range(n):
            ns = f"{self.tag}n{i}"
            node = Node(i, ns, f"{self.tag}v{i}", f"{self.tag}h{i}", f"{self.subnet}.{i + 1}")
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", node.iface, "type", "veth", "peer", "name", node.hub_iface)
            _ip("link", "set", node.iface, "netns", ns)
            _ip("link", "set", node.hub_iface, "netns", self.hub)
            _ip("-n", self.hub, "link", "set", node.hub_iface, "master", "br0")
            _ip("-n", self.hub, "link", "set", node.hub_iface, "up")
            _ip("-n", ns, "addr", "add", f"{node.addr}/24", "dev", node.iface)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", node.iface, "up")
            if rate:
                self.shape(node, rate)
            self.nodes.append(node)
        # the caller's own link to the bridge, so tests reach ops APIs without entering a node
        self.mgmt_iface, self.mgmt_addr = f"{self.tag}m", f"{self.subnet}.254"
        _ip("link", "add", self.mgmt_iface, "type", "veth", "peer", "name", f"{self.tag}mh")
        _ip("link", "set", f"{self.tag}mh", "netns", self.hub)
        _ip("-n", self.hub, "link", "set", f"{self.tag}mh", "master", "br0")
        _ip("-n", self.hub, "link", "set", f"{self.tag}mh", "up")
        _ip("addr", "add", f"{self.mgmt_addr}/24", "dev", self.mgmt_iface)
        _ip("link", "set", self.mgmt_iface, "up")

    def shape(self, node: Node, rate: str) -> None:
        """Limit both directions of ``node``'s link to ``rate`` (tbf on each sending side)."""
        for ns, iface in ((node.ns, node.iface), (self.hub, node.hub_iface)):
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    iface,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "256kb",
                    "latency",
                    "10ms",
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                raise NetnsError(f"tc on {iface}: {r.stderr.strip()}")

    def cut(self, node: Node) -> None:
        _ip("-n", node.ns, "link", "set", node.iface, "down")

    def heal(self, node: Node) -> None:
        _ip("-n", node.ns, "link", "set", node.iface, "up")

    def tx_bytes(self, node: Node) -> int:
        out = subprocess.run(
            node.exec_argv(["cat", f"/sys/class/net/{node.iface}/statistics/tx_bytes"]), capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    def close(self) -> None:
        """Delete everything this object made; safe to call twice."""
        subprocess.run(["ip", "link", "del", f"{self.tag}m"], capture_output=True)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers() -> list[str]:
    """Namespaces and links named like ours (from a run that was killed), for cleanup."""
    names = [
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith(PREFIX)
    ]
    names += [p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(PREFIX)]
    return names
