"""``GET /v1/cluster`` from a real data server when a daemon answers something odd: that node is
shown unreadable, with the reason, and everything else as usual (the answer, ``ffplane status``
and the status page). The daemons here are fault injectors: tiny HTTP servers that heartbeat."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests._servers import TOKEN, Proc, until
from tests.dataserver.test_status_page import NODE, run_page_script
from tests.trainer_client.test_jobs import _ffplane

GOOD = {
    "/v1/state": {"roles": [{"job": "j", "role": "dp0-pp0-tp0", "versions": [{"step": 7, "committed_at": 1.0}]}], "replicas": []},
    "/v1/cache": {"bytes": 1 << 20, "budget_bytes": 64 << 20},
    "/v1/gate": {"open": True},
}
ODD = {  # each part answered 200, none the shape a daemon answers
    "shape": {**GOOD, "/v1/state": {"roles": [{"job": 1, "versions": "many"}]}},
    "list": {**GOOD, "/v1/cache": [1, 2, 3]},
    "nan": {**GOOD, "/v1/cache": '{"bytes": NaN, "budget_bytes": 1}'},
    "not_json": {**GOOD, "/v1/gate": "<html>proxy error</html>"},
}


def _fake_daemon(answers: dict[str, Any]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            answer = answers.get(self.path, {}) if self.path != "/v1/health" else {"ok": True}
            body = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="fake daemon", daemon=True).start()
    return server


@pytest.fixture
def cluster(dataserver: Proc) -> Iterator[dict[str, Any]]:
    """The data server's view with a good fake daemon and one of each odd kind, all heartbeating."""
    nodes = {"good": _fake_daemon(GOOD)} | {kind: _fake_daemon(answers) for kind, answers in ODD.items()}
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            for node, server in nodes.items():
                body = {"node_id": node, "address": f"http://127.0.0.1:{server.server_address[1]}", "budget_bytes": 1 << 20}
                httpx.post(dataserver.url + "/v1/nodes/heartbeat", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
            stop.wait(0.3)

    beater = threading.Thread(target=beat, name="fake heartbeats", daemon=True)
    beater.start()
    try:
        until(lambda: len(httpx.get(dataserver.url + "/v1/nodes").json()["ring"]) == len(nodes), what="every fake daemon in the ring")
        yield {"url": dataserver.url}
    finally:
        stop.set()
        beater.join()
        for server in nodes.values():
            server.shutdown()
            server.server_close()


def test_an_odd_daemon_is_shown_unreadable_and_the_rest_as_usual(cluster: dict[str, Any]) -> None:
    r = httpx.get(cluster["url"] + "/v1/cluster", timeout=30)
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["daemons"]["good"]["state"]["roles"][0]["versions"][0]["step"] == 7
    assert view["daemons"]["good"]["cache"]["budget_bytes"] == 64 << 20
    for kind in ODD:
        assert view["members"][kind]["alive"], kind
        reason = view["daemons"][kind]["unreadable"]
        assert isinstance(reason, str) and reason, kind
    assert "/v1/state" in view["daemons"]["shape"]["unreadable"] and "/v1/cache" in view["daemons"]["list"]["unreadable"]
    assert "/v1/gate" in view["daemons"]["not_json"]["unreadable"]


def test_ffplane_status_shows_an_odd_daemon_unreadable(cluster: dict[str, Any]) -> None:
    r = _ffplane("status", dataserver=cluster["url"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
    assert "j/dp0-pp0-tp0@7" in rows["good"] and "alive" in rows["good"]
    for kind in ODD:
        assert "unreadable" in rows[kind], r.stdout


@pytest.mark.skipif(NODE is None, reason="no Node.js to run the page's script")
def test_the_status_page_shows_an_odd_daemon_unreadable(cluster: dict[str, Any]) -> None:
    view = httpx.get(cluster["url"] + "/v1/cluster", timeout=30).text
    html = run_page_script(f"{{ status: 200, ok: true, json: async () => ({view}) }}", "#nodes tbody")
    rows = {row.split("</td>")[0].removeprefix("<td>"): row for row in html.split("<tr>") if row}
    assert "j/dp0-pp0-tp0 @7" in rows["good"]
    for kind in ODD:
        assert "unreadable" in rows[kind], html
