"""The data server's settings, each declared once (type, default, range, help): ``dataserver serve``
mirrors ``ServeConfig`` and ``dataserver ingest`` mirrors ``IngestOptions``, flag for flag; their
variables (``$FFPLANE_DATASERVER_*``), file keys and ``--help`` come from the same declaration
(``ffplane_contract.settings``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic_settings import CliPositionalArg

from ffplane_contract.limits import DEFAULT_STEPS_PER_REQUEST, MAX_COUNT
from ffplane_contract.settings import HttpUrl, LogFormat, LogLevel, Port, PortOrOff, PositiveSeconds, Settings
from ffplane_runtime.etcd import parse_endpoints

if TYPE_CHECKING:
    from dataserver.ingest import IngestConfig

_BYTES = 1 << 40  # the most bytes (or samples) a limit may be set to


def _endpoints(spec: str | None) -> str | None:
    if spec is not None:
        parse_endpoints(spec)  # ValueError naming a member that is no host:port
    return spec


class ServeConfig(Settings):
    """``dataserver serve``: one field per flag, in ``--help``'s order."""

    data_dir: Path = Field(description="the folder of datasets (one sub-folder each, as ingest writes them: Arrow datasets or LMDB environments)")  # fmt: skip
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface; then with --etcd also --advertise-url)")
    port: Port = Field(8470, description="0 picks a free port (see --ready-file)")
    state_dir: Path | None = Field(None, description="job records (default <data-dir>/.ffplane-jobs)")
    token_file: str | None = Field(None, description="job bearer token (else $FFPLANE_TOKEN_FILE or $FFPLANE_TOKEN)")
    ready_file: str | None = Field(None, description="write {host,port,pid} JSON here once listening")
    max_steps_per_request: int = Field(DEFAULT_STEPS_PER_REQUEST, ge=1, le=MAX_COUNT, description="most steps one batch request may ask for")  # fmt: skip
    max_bytes_per_request: int = Field(256 << 20, ge=1, le=_BYTES, description="batch bytes (estimated from the dataset's size) one request may ask for (so one step too); 413 above")  # fmt: skip
    max_samples_per_step: int = Field(1 << 24, ge=1, le=_BYTES, description="largest dp x batch_per_rank a job or generation may have")  # fmt: skip
    max_body_bytes: int = Field(16 << 20, ge=1, le=1 << 30, description="largest request body (job, heartbeat with its inventory); 413 above, before it is read")  # fmt: skip
    dead_after_s: PositiveSeconds = Field(1.5, description="declare a node dead after this much silence")
    forget_dead_after_s: PositiveSeconds = Field(600.0, description="forget a dead node (and its shard inventory) after this long")
    sweep_s: PositiveSeconds = Field(0.2, description="how often nodes' silence is checked (a death is declared up to this late)")
    heartbeat_udp_port: PortOrOff = Field(0, description="UDP port for node heartbeats on --host (0: any free port, told to daemons over HTTP; -1: HTTP heartbeats only)")  # fmt: skip
    etcd: Annotated[str | None, AfterValidator(_endpoints)] = Field(None, description="etcd members host:port[,host:port...]: job records live there, so several data servers serve the same jobs and one at a time coordinates (a lease); the nodes declared dead are published for torchrun's --rdzv-backend ffplane")  # fmt: skip
    etcd_wait_s: PositiveSeconds = Field(10.0, description="with --etcd: how long the members may not answer at start; then the server refuses to start (exit 2), naming them")  # fmt: skip
    advertise_url: HttpUrl | None = Field(None, description="the URL daemons and the other data servers reach this one at: the leader key (--etcd), /v1/leader, the status page (default http://HOST:PORT)")  # fmt: skip
    log_level: LogLevel = Field("info", description="least severe log lines written")
    log_format: LogFormat = Field("auto", description="auto: text on a terminal, JSON lines otherwise")

    @model_validator(mode="after")
    def _reachable(self) -> ServeConfig:
        if self.etcd is not None and self.host in ("0.0.0.0", "::", "") and not self.advertise_url:
            raise ValueError(
                f"--host {self.host} is no address others can reach; with --etcd pass --advertise-url "
                "http://THIS_HOST:PORT (the coordinator's address daemons are sent to)"
            )
        return self

    def url(self, port: int) -> str:
        """This server's URL as the leader key names it (``port``: the one bound, for --port 0)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"

    def resolved_state_dir(self) -> Path:
        return self.state_dir or self.data_dir / ".ffplane-jobs"


class IngestOptions(Settings):
    """``dataserver ingest``: the command's settings; ``to_config`` is the library's ``IngestConfig``."""

    sources: CliPositionalArg[list[Path]] = Field(min_length=1, description="source files (JSONL, JSONL.GZ, Parquet, Arrow IPC)")
    out: Path = Field(description="new dataset directory (under serve's --data-dir)")
    shard_mb: int = Field(256, ge=1, le=1 << 20, description="target shard size in MiB")
    binary_field: list[str] = Field([], description="JSONL field holding base64 bytes (repeatable)")
    list_int_type: Literal["int32", "int64"] = Field("int32", description="type of JSON integer lists (token ids)")
    no_progress: bool = Field(False, description="no progress bar")

    def to_config(self) -> IngestConfig:
        from dataserver.ingest import IngestConfig

        return IngestConfig(
            sources=self.sources,
            out=self.out,
            shard_bytes=self.shard_mb << 20,
            binary_fields=self.binary_field,
            list_int_type=self.list_int_type,
            progress=not self.no_progress,
        )
