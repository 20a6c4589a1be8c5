"""Blocking client of the daemon's Unix control socket (the protocol: ``ffplane_contract.control``)."""

from __future__ import annotations

import json
import select
import socket
from collections import deque
from pathlib import Path
from typing import Any

from ffplane_contract import files
from ffplane_contract.control import Request, decode_reply, encode
from ffplane_contract.errors import FFTimeoutError, TransportError
from trainer_client import _goodbye

_COLLECT_AFTER = 32  # unread replies (~100 bytes each) before send() collects the arrived ones


class DaemonClient:
    def __init__(self, socket_path: Path, timeout_s: float) -> None:
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(str(socket_path))
        except OSError as exc:
            self._sock.close()
            raise TransportError(
                f"no statestore daemon at {socket_path}: {exc.strerror or exc}. Start one on this node "
                f"(statestore serve --root {Path(socket_path).parent} --dataserver URL) or point {files.SOCKET_ENV} at its socket"
            ) from exc
        self._file = self._sock.makefile("rb")
        self.root = Path(socket_path).parent
        _goodbye.watch(socket_path, DaemonClient)  # a clean exit of this process is then no failure to the daemon
        self._unread: deque[Request] = deque()  # sent with send(), replies read before the next call's

    def send(self, msg: Request) -> None:
        """Send a request whose reply is read (and checked) later: here, once it has arrived,
        or before the next ``call``'s."""
        self._write(msg)
        self._unread.append(msg)
        # Now and then take the replies already here, never waiting for one. A reader whose
        # steps are all cached only ever sends; replies left unread filled the socket after
        # ~1,000 steps, the daemon's writer then blocked and it stopped reading this connection
        # (cursor frozen, prefetch stalled) until the reader's next blocking call. Every
        # ``_COLLECT_AFTER`` sends, not every one: this runs once per batch.
        if len(self._unread) >= _COLLECT_AFTER:
            while self._unread and self.replied():
                self._read(self._unread.popleft())

    def post(self, msg: Request) -> None:
        """Send a request whose reply the caller reads with ``reply`` before any other call."""
        self._write(msg)

    def replied(self, wait_s: float = 0.0) -> bool:
        """Whether a reply has arrived (waiting at most ``wait_s``)."""
        return bool(select.select([self._sock], [], [], wait_s)[0])

    def reply(self, msg: Request) -> Any:
        """The reply to ``msg``, sent with ``post``."""
        return self._read(msg)

    def call(self, msg: Request) -> Any:
        self._write(msg)
        while self._unread:
            self._read(self._unread.popleft())
        return self._read(msg)

    def _write(self, msg: Request) -> None:
        try:
            self._sock.sendall(encode(msg))
        except OSError as exc:
            raise TransportError(f"daemon at {self.socket_path} went away: {exc}") from exc

    def _read(self, msg: Request) -> Any:
        try:
            line = self._file.readline()
        except TimeoutError as exc:
            # A late answer would be read as the reply to the next request: this connection
            # is done; the caller reconnects.
            self.close()
            raise FFTimeoutError(f"daemon at {self.socket_path} did not answer {msg.op!r} in time") from exc
        except OSError as exc:
            raise TransportError(f"daemon at {self.socket_path} went away: {exc}") from exc
        if not line:
            raise TransportError(f"daemon at {self.socket_path} closed the connection")
        try:
            return decode_reply(msg, json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise TransportError(f"daemon at {self.socket_path} answered {msg.op!r} with {line[:200]!r}: {exc}") from exc

    def close(self) -> None:
        self._file.close()
        self._sock.close()
