"""Jobs on the data servers, from Python: what ``ffplane job create|list|show|delete`` and
``ffplane status`` call.

    from trainer_client.jobs import Jobs
    jobs = Jobs("http://10.0.0.1:8470")        # else $FFPLANE_DATASERVER; token: $FFPLANE_TOKEN_FILE / $FFPLANE_TOKEN
    jobs.create("run1", dataset="web", dp=8, batch_per_rank=16, max_steps=100_000)
    jobs.get("run1").generations

Jobs and generations are sent and read as the data server's own bodies
(``ffplane_contract.dataserver_http``): ``JobCreate`` and ``GenerationCreate``, checked here as the
server would, and ``JobView``.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ValidationError

from ffplane_contract.auth import load_token
from ffplane_contract.dataserver_http import GenerationCreate, JobCreate, JobView
from ffplane_contract.errors import ConflictError, FFPlaneError, InvalidError, TransportError
from ffplane_contract.servers import DATASERVER_ENV
from trainer_client._http import ServerClient

__all__ = ["Jobs"]


class Jobs:
    def __init__(self, dataserver: str | None = None, token: str | None = None, timeout_s: float = 30.0) -> None:
        url = dataserver or os.environ.get(DATASERVER_ENV)
        if not url:
            raise ValueError(f"no data server: pass dataserver='http://HOST:PORT' or set {DATASERVER_ENV}")
        self.client = ServerClient(url, token if token is not None else load_token(), timeout_s)

    def create(self, name: str, dataset: str, dp: int, batch_per_rank: int, seed: int = 0, max_steps: int | None = None) -> JobView:
        """Create a job (or return the identical one that exists; a different one raises ConflictError)."""
        body = _body(JobCreate, name=name, dataset=dataset, dp=dp, batch_per_rank=batch_per_rank, seed=seed, max_steps=max_steps)
        try:
            return _view(self.client.json("/v1/jobs", method="POST", body=body))
        except FFPlaneError as exc:
            if exc.status == 409:  # on this route, only a job of that name with another definition
                raise ConflictError(str(exc), 409) from exc
            raise

    def list(self) -> list[str]:
        names: list[str] = self.client.json("/v1/jobs")
        return names

    def get(self, name: str) -> JobView:
        """The job's record: dataset, generations (dp, batch_per_rank from a step), served step."""
        return _view(self.client.json(f"/v1/jobs/{name}"))

    def delete(self, name: str) -> None:
        """Forget the job (NotFoundError if there is none); daemons keep its checkpoints."""
        self.client.request(f"/v1/jobs/{name}", method="DELETE")

    def add_generation(self, name: str, start_step: int, dp: int, batch_per_rank: int) -> JobView:
        """A new layout from ``start_step`` (an elastic change): earlier steps keep their batches."""
        body = _body(GenerationCreate, start_step=start_step, dp=dp, batch_per_rank=batch_per_rank)
        return _view(self.client.json(f"/v1/jobs/{name}/generations", method="POST", body=body))

    def status(self, name: str) -> dict[str, Any]:
        """Where the job's roles can restore from, as the coordinating data server sees it."""
        status: dict[str, Any] = self.client.json(f"/v1/jobs/{name}/status")
        return status

    def cluster(self) -> dict[str, Any]:
        """Everything the status page shows: nodes, ring, each daemon's roles, replicas, cache and
        gate, each job's restorable step and shard locations, recent failures and their recovery."""
        cluster: dict[str, Any] = self.client.json("/v1/cluster")
        return cluster


def _body(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """``fields`` as the body ``model`` says, checked here first: InvalidError naming what is wrong."""
    try:
        return model(**fields).model_dump()
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False))
        raise InvalidError(f"{model.__name__}: {wrong}") from exc


def _view(answer: Any) -> JobView:
    """A data server's answer read as a ``JobView``; TransportError if it is not one."""
    try:
        return JobView.model_validate(answer)
    except ValidationError as exc:
        raise TransportError(f"the data server's answer is no job view: {exc.errors(include_url=False)[0]['msg']}") from exc
