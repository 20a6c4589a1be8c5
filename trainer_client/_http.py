"""Requests from a training process (or the ``ffplane`` command) to the data servers.

``dataserver`` may name several (comma-separated): a request goes to the one that answered last,
and to the next when a connection is refused, cut, or answered 5xx; a 421 (this server does not
coordinate now) goes to the server its ``X-FFplane-Leader`` header names. Errors come back as
the ffplane error their status stands for, with the server's message.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ffplane_contract.auth import bearer
from ffplane_contract.errors import FFPlaneError, TransportError, error_from
from ffplane_contract.servers import LEADER_HEADER, parse_urls


class ServerClient:
    def __init__(self, dataserver: str, token: str | None, timeout_s: float) -> None:
        self.urls = parse_urls(dataserver)
        self.url = self.urls[0]
        self.token, self.timeout_s = token, timeout_s

    def request(self, path: str, params: dict[str, Any] | None = None, method: str = "GET", body: Any = None) -> bytes:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        data = None if body is None else json.dumps(body).encode()
        headers = bearer(self.token) | ({"Content-Type": "application/json"} if data is not None else {})
        error: FFPlaneError | None = None
        redirected = False
        tries = 0
        while tries < len(self.urls):
            req = urllib.request.Request(f"{self.url}{path}{query}", data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    answer: bytes = resp.read()
                    return answer
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:500]
                leader = exc.headers.get(LEADER_HEADER) if exc.code == 421 else None
                if leader and not redirected:  # once: the coordinator's URL, as the follower knows it
                    self.url, redirected = leader.rstrip("/"), True
                    continue
                error = error_from(exc.code, f"data server {self.url}{path}: {exc.code} {_message(detail)}")
                if exc.code < 500:
                    raise error from exc
            except (OSError, http.client.HTTPException) as exc:  # incl. a body cut short
                error = TransportError(f"cannot reach the data server at {self.url}: {exc!r}")
            tries += 1
            at = self.urls.index(self.url) if self.url in self.urls else -1
            self.url = self.urls[(at + 1) % len(self.urls)]
        assert error is not None
        raise error

    def json(self, path: str, params: dict[str, Any] | None = None, method: str = "GET", body: Any = None) -> Any:
        answer = self.request(path, params, method, body)
        return json.loads(answer) if answer else None


def _message(body: str) -> str:
    """The ``detail`` of an error body, else the body."""
    try:
        detail = json.loads(body).get("detail")
    except (ValueError, AttributeError):
        return body
    return detail if isinstance(detail, str) else body
