"""Where a DataLoader gets a step's bytes: the node daemon's cache, or the data server directly."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from ffplane_contract.control import Get, Open
from ffplane_contract.errors import CorruptError, TransportError
from ffplane_contract.files import step_file
from trainer_client._daemon_client import DaemonClient
from trainer_client._http import ServerClient
from trainer_client.batches import StepBytes

log = logging.getLogger(__name__)
Step = tuple[StepBytes, pa.RecordBatch, dict[str, str]]


class _MappedFile:
    """A cached file mapped by the reader: one step, or a run of consecutive steps (see
    ``statestore.data_cache``), each read from the one mapping."""

    def __init__(self, step_bytes: StepBytes, step: int, origin: str) -> None:
        try:
            batches = step_bytes.read()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptError(f"step {step} from {origin} is not a valid Arrow IPC stream: {exc}") from exc
        try:
            steps = [int(meta["step"]) for _, meta in batches]
        except (KeyError, ValueError):
            steps = []
        first = steps[0] if steps else -1
        if steps != list(range(first, first + len(steps))) or step not in steps:
            raise CorruptError(f"{origin} holds steps {steps[:3]}...{steps[-1:]}, not consecutive steps including {step}")
        self.step_bytes = step_bytes
        self.batches = {s: item for s, item in zip(steps, batches)}

    def get(self, step: int) -> Step:
        return self.step_bytes, *self.batches[step]


class DaemonSource:
    """Reads steps from the node daemon's cache. The daemon keeps that cache to the job's current
    plan (a step planned before an elastic change is gone before ``Open`` is answered), so no step
    read here is checked against the job's generations."""

    name = "daemon"

    def __init__(self, socket_path: Path, job: str, dp_rank: int, token: str | None, timeout_s: float) -> None:
        self.client = DaemonClient(socket_path, timeout_s)
        opened = self.client.call(Open(job, dp_rank, token))
        self.steps_dir = self.client.root / opened.steps
        self._mapped: _MappedFile | None = None

    def has(self, step: int) -> bool:
        """Whether ``step`` is in the file mapped now (``get`` then makes no system call)."""
        return self._mapped is not None and step in self._mapped.batches

    @property
    def mapped(self) -> StepBytes | None:
        """The memory of the file mapped now."""
        return None if self._mapped is None else self._mapped.step_bytes

    def get(self, step: int) -> Step:
        mapped = self._mapped
        if mapped is not None and step in mapped.batches:
            # the daemon heard where we are on entering the file: it prefetches a run ahead of that
            return mapped.get(step)
        # A file named for the step (it starts there): map it now; the get that moves our
        # position is answered later.
        path = self.steps_dir / step_file(step)
        try:
            step_bytes = StepBytes.map(path)
        except FileNotFoundError:
            path = self.client.root / self.client.call(Get(step)).path
            try:
                step_bytes = StepBytes.map(path)
            except FileNotFoundError as exc:  # evicted between reply and open: only on a far replay
                raise TransportError(f"cached step {step} vanished at {path}") from exc
        else:
            self.client.send(Get(step))
        self._mapped = mapped = _MappedFile(step_bytes, step, f"daemon cache {path}")
        return mapped.get(step)

    def close(self) -> None:
        self._mapped = None
        self.client.close()


class HttpSource:
    """Reads ``window`` steps per request straight from the data server (no daemon on this node);
    ``url`` may name several, comma-separated: a request goes to the next when one fails."""

    name = "dataserver"

    def __init__(self, url: str, job: str, dp_rank: int, token: str | None, timeout_s: float, window: int) -> None:
        self.client = ServerClient(url, token, timeout_s)
        self.job, self.dp_rank, self.window = job, dp_rank, window
        self.end_step: int | None = None  # the job's max_steps, set by the DataLoader
        self._buffered: dict[int, Step] = {}

    def _request(self, path: str, params: dict[str, Any] | None = None) -> bytes:
        return self.client.request(path, params)

    def job_info(self) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(self._request(f"/v1/jobs/{self.job}"))
        return info

    def get(self, step: int) -> Step:
        if step not in self._buffered:
            self._buffered.clear()
            count = self.window
            if self.end_step is not None:
                count = max(1, min(count, self.end_step - step))
            body = self._request(f"/v1/jobs/{self.job}/batches", {"dp_rank": self.dp_rank, "start": step, "count": count})
            step_bytes = StepBytes(bytearray(body))
            for batch, meta in step_bytes.read():
                self._buffered[int(meta["step"])] = (step_bytes, batch, meta)
        found = self._buffered.pop(step, None)
        if found is None:
            raise CorruptError(f"data server did not return step {step}")
        return found

    def forget(self) -> None:
        """Drop the steps buffered from the last request: the next ``get`` asks again."""
        self._buffered.clear()

    def close(self) -> None:
        self._buffered.clear()
