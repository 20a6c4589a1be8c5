"""The ``ffplane`` command's settings, each declared once (type, default, range, help): one model per
command, mirrored flag for flag; ``$FFPLANE_<FLAG>`` and the ``[ffplane.<command>]`` tables of
``--config`` come from the same declaration (``ffplane_contract.settings``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import CliPositionalArg

from ffplane_contract.limits import LAYOUT_LIMIT, MAX_STEP, SEED_LIMIT, STEP_LIMIT
from ffplane_contract.settings import Command, PositiveInt, PositiveSeconds, Program, Settings

DemoModel = Literal["fsdp2", "fsdp2-dcp", "gpt"]  # job_runner.MODELS' keys (a test holds them equal)


class _Server(Settings):
    """Where the data servers are and how to prove membership: every command that talks to them."""

    dataserver: str | None = Field(None, description="data server URL(s), comma-separated")
    token_file: str | None = Field(None, description="the job token's file (else $FFPLANE_TOKEN)")
    timeout_s: PositiveSeconds = Field(10.0, description="per request")


class JobCreate(_Server):
    name: CliPositionalArg[str] = Field(description="the job's name (letters, digits, '-', '_', '.')")
    dataset: str = Field(description="a dataset the data server serves (GET /v1/datasets)")
    dp: int = Field(ge=1, le=LAYOUT_LIMIT, description="data-parallel ranks")
    batch_per_rank: int = Field(ge=1, le=LAYOUT_LIMIT, description="samples per rank per step")
    seed: int = Field(0, ge=0, le=SEED_LIMIT - 1, description="the plan's shuffle seed")
    max_steps: int | None = Field(None, ge=1, le=STEP_LIMIT, description="the job's length in optimizer steps (none: unbounded)")


class JobList(_Server):
    pass


class JobName(_Server):
    name: CliPositionalArg[str] = Field(description="the job's name")


class Status(_Server):
    job: str | None = Field(None, description="only this job (default: every job)")
    as_json: bool = Field(False, validation_alias="json", description="print the gathered JSON instead of the table")


class Export(Settings):
    job: CliPositionalArg[str] = Field(description="the job")
    step: CliPositionalArg[int] = Field(ge=0, le=MAX_STEP, description="the step to export")
    directory: CliPositionalArg[Path] = Field(description="where the DCP checkpoint goes")
    # its variable is the one every process reads: $FFPLANE_DAEMON_SOCKET
    daemon_socket: Path | None = Field(None, description="the node daemon's socket (default: /dev/shm/ffplane/daemon.sock)")
    durable_dir: Path | None = Field(None, description="read the durable tier here when no daemon answers")
    model_key: str = Field("model", description="the state key whose tensors go to model.safetensors")


class Demo(Settings):
    out: Path | None = Field(None, description="where demo.json and the PNGs go (default: a new folder in the temp dir, printed)")
    steps: PositiveInt = Field(40, description="training steps of the demo job")
    model: DemoModel = Field("gpt", description="gpt: the GPT under DDP; fsdp2: sharded with fully_shard, saved by the Checkpointer; fsdp2-dcp: the same through dcp.save/load")  # fmt: skip
    keep: bool = Field(False, description="keep the work folder (logs, events)")


PROGRAM = Program(
    "ffplane",
    "ffplane: jobs, the cluster's state, exports, and a demo on this machine",
    [
        Command("job create", JobCreate, "create a job (an identical one that exists is left as it is)"),
        Command("job list", JobList, "the jobs' names"),
        Command("job show", JobName, "a job's record as JSON"),
        Command("job delete", JobName, "forget a job (daemons keep its checkpoints)"),
        Command("status", Status, "the cluster as a table: nodes, roles and their restorable step, replicas, cache, gate"),
        Command(
            "export",
            Export,
            "a saved step as a plain DCP checkpoint directory (+ model.safetensors), readable without ffplane",
            {"daemon-socket": "socket"},
        ),  # fmt: skip
        Command("demo", Demo, "two nodes, a killed worker, a lost node: timelines and a bitwise check"),
    ],
    groups={"job": "create, list, show or delete jobs on the data servers"},
)
