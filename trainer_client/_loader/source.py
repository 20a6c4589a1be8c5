"""The loader's source: step → batch, from the node daemon's cache or straight from the data server."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ffplane_contract.errors import TransportError
from ffplane_contract.servers import DATASERVER_ENV
from trainer_client._loader.part import Fetched, Part, State
from trainer_client._sources import DaemonSource, HttpSource

log = logging.getLogger(__name__)


class StepSource(Part[Fetched]):
    """Steps ``next_step``, ``next_step + 1``, ... (up to ``end_step``, if set) of ``(job,
    dp_rank)``: from the node daemon's cache, or from the data server (``dataserver``) when no
    daemon answers at ``socket_path`` or one stops answering and does not come back within
    ``reconnect_s``. Connects on the first read; its state is ``{"next_step": s}``."""

    def __init__(
        self,
        job: str,
        dp_rank: int,
        *,
        socket_path: Path,
        dataserver: str | None,
        token: str | None,
        timeout_s: float,
        reconnect_s: float,
        http_window: int,
        next_step: int = 0,
        end_step: int | None = None,
    ) -> None:
        self.job, self.dp_rank = job, dp_rank
        self.socket_path, self.dataserver, self.token = socket_path, dataserver, token
        self.timeout_s, self.reconnect_s, self.http_window = timeout_s, reconnect_s, http_window
        self.next_step, self.end_step = next_step, end_step
        self._source: DaemonSource | HttpSource | None = None
        self._http: HttpSource | None = None

    @property
    def name(self) -> str:
        """``"daemon"``, ``"dataserver"``, or ``"none"`` before the first read."""
        return "none" if self._source is None else self._source.name

    def job_info(self) -> dict[str, Any]:
        """The data server's view of the job (its generations, ``max_steps``)."""
        return self._http_source().job_info()

    # --- Part -------------------------------------------------------------------------------
    def next(self) -> Fetched:
        step = self.next_step
        if self.end_step is not None and step >= self.end_step:
            raise StopIteration
        found = self.get(step)
        self.next_step = step + 1
        return found

    def state_dict(self) -> State:
        return {"next_step": self.next_step}

    def reset(self, state: State) -> None:
        self.next_step = int(state["next_step"])

    def cheap_next(self) -> bool:
        src = self._source
        return isinstance(src, DaemonSource) and src.has(self.next_step)

    def in_hand(self) -> object | None:
        src = self._source
        return src.mapped if isinstance(src, DaemonSource) else None

    def close(self) -> None:
        for src in (self._source, self._http):
            if src is not None:
                src.close()
        self._source = None

    # --- reading ----------------------------------------------------------------------------
    def get(self, step: int) -> Fetched:
        """Step ``step`` (the position stays where it is)."""
        if self._source is None:
            self._source = self._connect()
        try:
            found = self._source.get(step)
        except TransportError:
            if not isinstance(self._source, DaemonSource):
                raise
            self._source.close()  # the daemon died or restarted: reconnect, else go direct
            self._source = self._connect()
            found = self._source.get(step)
        return Fetched(step, *found)

    def forget(self) -> None:
        """Drop the steps read ahead from the data server in one request (planned before a
        generation the job has since gained): they are asked for again."""
        if self._http is not None:
            self._http.forget()

    def _connect(self) -> DaemonSource | HttpSource:
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                return DaemonSource(self.socket_path, self.job, self.dp_rank, self.token, self.timeout_s)
            except TransportError as exc:
                if time.monotonic() >= deadline or not self.socket_path.exists():
                    log.warning("reading from the data server: %s", exc, extra={"job": self.job, "dp_rank": self.dp_rank})
                    return self._http_source()
                time.sleep(0.1)

    def _http_source(self) -> HttpSource:
        if self._http is None:
            if not self.dataserver:
                raise TransportError(
                    f"no statestore daemon at {self.socket_path} and no data server configured; "
                    f"start the daemon or pass dataserver= (or set {DATASERVER_ENV})"
                )
            self._http = HttpSource(self.dataserver, self.job, self.dp_rank, self.token, self.timeout_s, self.http_window)
        self._http.end_step = self.end_step
        return self._http
