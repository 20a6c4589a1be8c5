"""The node daemon's HTTP API as other processes see it: its path and query parameters and its
request and answer bodies, declared once (the daemon's routes use them, and so does its OpenAPI
spec, which a schema fuzzer holds the daemon to).

The parameters are plain pydantic annotations: FastAPI reads a ``Field``'s bounds and description
for a path or query parameter as it would its own ``Path`` and ``Query``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ffplane_contract.limits import MAX_BYTES, MAX_STEP, NAME_PATTERN
from ffplane_contract.shard import check_header

__all__ = [
    "Committed",
    "ErrorDetail",
    "JobName",
    "Length",
    "Newest",
    "Offset",
    "Received",
    "ReplicaMeta",
    "RoleName",
    "Step",
    "Transfer",
    "ValidationDetail",
    "WholeReceived",
]

JobName = Annotated[str, Field(pattern=NAME_PATTERN, description="the job's name")]
RoleName = Annotated[str, Field(pattern=NAME_PATTERN, description="a role: dp<r>-pp<r>-tp<r>")]
Step = Annotated[int, Field(ge=0, le=MAX_STEP, description="the optimizer step the shard was saved at")]
Offset = Annotated[int, Field(ge=0, le=MAX_BYTES, description="byte offset in the shard")]
Length = Annotated[int | None, Field(ge=0, le=MAX_BYTES)]
Newest = Annotated[int | None, Field(ge=0, le=MAX_STEP, description="the sender's newest committed step of the role")]


class ErrorDetail(BaseModel):
    detail: str


class ValidationDetail(BaseModel):
    """422: a sentence from the daemon, or FastAPI's list of the parameters that failed validation."""

    detail: str | list[dict[str, Any]]


class ReplicaMeta(BaseModel):
    """What a replica push announces (``begin``'s body, the head of ``whole``'s). Strict: a
    ``false`` is not a size of 0 bytes."""

    model_config = ConfigDict(strict=True)

    nbytes: int = Field(ge=0, le=MAX_BYTES)
    checksum: str = Field(min_length=1, max_length=128)
    header: dict[str, Any]
    source: str = Field(max_length=256)
    header_digest: str = Field(default="", max_length=128)  # of the whole header; the receiver checks it with the checksum

    @field_validator("header")
    @classmethod
    def _typed(cls, header: dict[str, Any]) -> dict[str, Any]:
        check_header(header)  # a field of the wrong type is refused here, not at a restore
        return header


class Received(BaseModel):
    received: int


class Transfer(BaseModel):
    bulk_port: int | None


class WholeReceived(BaseModel):
    received: int
    checksum: str


class Committed(BaseModel):
    ok: bool
    checksum: str
