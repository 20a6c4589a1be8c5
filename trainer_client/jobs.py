"""Jobs on the data servers, from Python: what ``ffplane job create|list|show|delete`` and
``ffplane status`` call.

    from trainer_client.jobs import Jobs
    jobs = Jobs("http://10.0.0.1:8470")        # else $FFPLANE_DATASERVER; token: $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN
    jobs.create("run1", dataset="web", dp=8, batch_per_rank=16, max_steps=100_000)
    jobs.get("run1")["generations"]
"""

from __future__ import annotations

import os
from typing import Any

from ffplane_contract.auth import load_token
from ffplane_contract.errors import ConflictError, FFPlaneError
from ffplane_contract.servers import DATASERVER_ENV
from trainer_client._http import ServerClient

__all__ = ["Jobs"]


class Jobs:
    def __init__(self, dataserver: str | None = None, token: str | None = None, timeout_s: float = 30.0) -> None:
        url = dataserver or os.environ.get(DATASERVER_ENV)
        if not url:
            raise ValueError(f"no data server: pass dataserver='http://HOST:PORT' or set {DATASERVER_ENV}")
        self.client = ServerClient(url, token if token is not None else load_token(), timeout_s)

    def create(self, name: str, dataset: str, dp: int, batch_per_rank: int, seed: int = 0, max_steps: int | None = None) -> dict[str, Any]:
        """Create a job (or return the identical one that exists; a different one raises ConflictError)."""
        body = {"name": name, "dataset": dataset, "dp": dp, "batch_per_rank": batch_per_rank, "seed": seed, "max_steps": max_steps}
        try:
            job: dict[str, Any] = self.client.json("/v1/jobs", method="POST", body=body)
        except FFPlaneError as exc:
            if exc.status == 409:  # on this route, only a job of that name with another definition
                raise ConflictError(str(exc), 409) from exc
            raise
        return job

    def list(self) -> list[str]:
        names: list[str] = self.client.json("/v1/jobs")
        return names

    def get(self, name: str) -> dict[str, Any]:
        """The job's record: dataset, generations (dp, batch_per_rank from a step), served step."""
        job: dict[str, Any] = self.client.json(f"/v1/jobs/{name}")
        return job

    def delete(self, name: str) -> None:
        """Forget the job (NotFoundError if there is none); daemons keep its checkpoints."""
        self.client.request(f"/v1/jobs/{name}", method="DELETE")

    def add_generation(self, name: str, start_step: int, dp: int, batch_per_rank: int) -> dict[str, Any]:
        """A new layout from ``start_step`` (an elastic change): earlier steps keep their batches."""
        body = {"start_step": start_step, "dp": dp, "batch_per_rank": batch_per_rank}
        job: dict[str, Any] = self.client.json(f"/v1/jobs/{name}/generations", method="POST", body=body)
        return job

    def status(self, name: str) -> dict[str, Any]:
        """Where the job's roles can restore from, as the coordinating data server sees it."""
        status: dict[str, Any] = self.client.json(f"/v1/jobs/{name}/status")
        return status

    def cluster(self) -> dict[str, Any]:
        """Everything the status page shows: nodes, ring, each daemon's roles, replicas, cache and
        gate, each job's restorable step and shard locations, recent failures and their recovery."""
        cluster: dict[str, Any] = self.client.json("/v1/cluster")
        return cluster
