"""Jobs: a dataset, a seed and a layout history, persisted so a restarted server plans the same.

A job's record is a small JSON file, ``<state_dir>/<name>.json``, replaced atomically on every
change; the plan itself is never stored because it is a pure function of the record. Beside it,
``<name>.served`` holds the newest step whose batches the server has handed out: it is written
(atomically, before the bytes leave) each time that step moves forward, so a restarted server
still refuses a generation that would re-plan batches readers already have. It is a side file
rather than a field of the record because it changes once per step while the record changes
once per job or layout change, and the record stays the plan's pure definition. The same file
keeps the newest step any daemon ever reported committed (``committed_step``): a restore that
finds no copy of a job that had state then fails loudly instead of starting it from nothing.

A record that cannot be used (torn, hand-edited, naming a dataset that is gone) makes only its
own job *broken*: it is listed with the reason and refuses plans and batches, and every other job
is served.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dataserver.planner import Generation, Planner
from ffplane_contract.errors import ConflictError, FFPlaneError, InvalidError, NotFoundError
from ffplane_contract.limits import LAYOUT_LIMIT, NAME_PATTERN, SEED_LIMIT, STEP_LIMIT, is_name

log = logging.getLogger(__name__)

# Errors are the shared ones: InvalidError for a request or record that breaks a rule (the
# message says what to change), ConflictError for one that conflicts with the job as it is (its
# definition, steps already used, a broken record), NotFoundError for an unknown job.
_SPEC_KEYS = {"name", "dataset", "dp", "batch_per_rank", "seed", "max_steps", "generations"}


def _int(value: object, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise InvalidError(f"{what} must be an integer in [{lo}, {hi}), got {value!r}")
    return value


@dataclass
class JobSpec:
    name: str
    dataset: str
    dp: int
    batch_per_rank: int
    seed: int = 0
    max_steps: int | None = None
    generations: list[Generation] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not is_name(self.name):
            raise InvalidError(f"job name {self.name!r} must match {NAME_PATTERN}")
        if not is_name(self.dataset):
            raise InvalidError(f"dataset name {self.dataset!r} must match {NAME_PATTERN}")
        _int(self.dp, "dp", 1, LAYOUT_LIMIT + 1)
        _int(self.batch_per_rank, "batch_per_rank", 1, LAYOUT_LIMIT + 1)
        _int(self.seed, "seed", 0, SEED_LIMIT)
        if self.max_steps is not None:
            _int(self.max_steps, "max_steps", 1, STEP_LIMIT + 1)
        if not self.generations:
            self.generations = [Generation(0, self.dp, self.batch_per_rank)]
        first = self.generations[0]
        if (first.start_step, first.dp, first.batch_per_rank) != (0, self.dp, self.batch_per_rank):
            raise InvalidError("the first generation must start at step 0 with the job's dp and batch_per_rank")
        for g in self.generations:
            _int(g.start_step, "generation start_step", 0, STEP_LIMIT)
            _int(g.dp, "generation dp", 1, LAYOUT_LIMIT + 1)
            _int(g.batch_per_rank, "generation batch_per_rank", 1, LAYOUT_LIMIT + 1)

    def same_definition(self, other: JobSpec) -> bool:
        keys = ("dataset", "dp", "batch_per_rank", "seed", "max_steps")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> JobSpec:
        """A record as written by ``to_json``; anything else raises InvalidError saying what is wrong."""
        if not isinstance(raw, dict):
            raise InvalidError(f"the record is a JSON {type(raw).__name__}, not an object")
        if set(raw) - _SPEC_KEYS or not {"name", "dataset", "dp", "batch_per_rank"} <= set(raw):
            raise InvalidError(f"the record has keys {sorted(raw)}, expected {sorted(_SPEC_KEYS)}")
        gens_raw = raw.get("generations", [])
        if not isinstance(gens_raw, list) or not all(
            isinstance(g, dict) and set(g) == {"start_step", "dp", "batch_per_rank"} for g in gens_raw
        ):
            raise InvalidError("the record's generations are not a list of {start_step, dp, batch_per_rank}")
        try:
            gens = [Generation(**g) for g in gens_raw]
        except (TypeError, ValueError) as exc:
            raise InvalidError(f"a generation of the record is invalid: {exc}") from exc
        return cls(**{k: v for k, v in raw.items() if k != "generations"}, generations=gens)


def parse_record(raw: str | bytes, name: str) -> JobSpec:
    """Job ``name``'s record as stored (a file's or an etcd key's bytes); raises what is wrong."""
    spec = JobSpec.from_json(json.loads(raw))
    if spec.name != name:
        raise InvalidError(f"the record names job {spec.name!r}, not {name!r}")
    return spec


def parse_served(raw: str | bytes) -> tuple[int | None, int | None]:
    """(served step, committed step) from a served side record; raises what is wrong."""
    record = json.loads(raw)
    steps = [record.get("served_step"), record.get("committed_step")]
    for step in steps:
        if step is not None and (type(step) is not int or step < 0):
            raise ValueError(f"step {step!r}")
    if steps[0] is None and "served_step" not in record:
        raise ValueError("the record has no served_step")
    return steps[0], steps[1]


def broken_reason(where: str, exc: Exception) -> str:
    """Why the record at ``where`` marks its job broken, for the job's view and the log."""
    if isinstance(exc, FFPlaneError):  # e.g. its dataset is gone: the message says so
        return f"{where}: {exc}"
    if isinstance(exc, UnicodeDecodeError | json.JSONDecodeError):
        return f"{where}: not a JSON job record (torn or hand-edited?): {exc}"
    return f"{where}: {type(exc).__name__}: {exc}"


class Job:
    def __init__(self, spec: JobSpec, num_samples: int, served_step: int | None = None, served_unknown: bool = False) -> None:
        self.spec = spec
        self.num_samples = num_samples
        self.planner = Planner(num_samples, spec.seed, list(spec.generations))
        self.served_step = served_step  # the newest step whose batches were handed out
        self.served_unknown = served_unknown  # its side file was unreadable at load
        self.committed_step: int | None = None  # the newest step a daemon reported committed, as far as we know
        self.record_rev = 0  # the record's etcd mod_revision this planner was built from (0: a file)
        self.served_rev = 0  # the served side key's etcd mod_revision (0: none, or a file)

    def check_step(self, step: int) -> None:
        if step < 0 or (self.spec.max_steps is not None and step >= self.spec.max_steps):
            raise InvalidError(
                f"step {step} is outside job {self.spec.name!r}: steps run 0..{self.spec.max_steps - 1}"
                if self.spec.max_steps is not None
                else f"step {step} is negative"
            )


@dataclass(frozen=True)
class BrokenJob:
    """A job whose record could not be loaded: its name (from the file name) and why."""

    name: str
    reason: str
    spec: JobSpec | None  # when the record itself was readable (e.g. its dataset is gone)


class JobRegistry:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._broken: dict[str, BrokenJob] = {}
        self._lock = threading.Lock()

    def load(self, num_samples_of: Callable[[str], int]) -> list[str]:
        """Reload persisted jobs; ``num_samples_of(dataset)`` gives each dataset's length (and
        may raise). A record that cannot be used marks only its job broken (logged once)."""
        for path in sorted(self.state_dir.glob("*.json")):
            name = path.name[: -len(".json")]
            spec: JobSpec | None = None
            try:
                spec = parse_record(path.read_text(), name)
                served, unknown, committed = self._load_served(name)
                self._jobs[name] = job = Job(spec, num_samples_of(spec.dataset), served, unknown)
                job.committed_step = committed
            except Exception as exc:  # noqa: BLE001 - any failure of one record breaks only that job
                reason = broken_reason(str(path), exc)
                self._broken[name] = BrokenJob(name, reason, spec)
                log.warning(
                    "job record unusable; the job is marked broken and the others are served", extra={"job": name, "reason": reason}
                )
        return sorted(self._jobs)

    def _served_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.served"

    def _load_served(self, name: str) -> tuple[int | None, bool, int | None]:
        """(served step, whether the file was unreadable, committed step)."""
        path = self._served_path(name)
        try:
            served, committed = parse_served(path.read_text())
            return served, False, committed
        except FileNotFoundError:
            return None, False, None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning(
                "served-step file unreadable: generations of this job need replan_served",
                extra={"job": name, "path": str(path), "error": str(exc)},
            )
            return None, True, None

    def refresh(self, name: str) -> None:
        """Read ``name``'s record again where other servers may change it (files: nothing to do)."""

    def known(self, name: str) -> bool:
        """Whether ``name`` is in this registry's memory (a job or a broken one), without reading."""
        return name in self._jobs or name in self._broken

    def find(self, name: str) -> Job | None:
        """The job, or None if it is unknown or broken."""
        return self._jobs.get(name)

    def get(self, name: str) -> Job:
        """The job; NotFoundError if unknown, ConflictError if its record could not be loaded."""
        job = self._jobs.get(name)
        if job is None:
            broken = self._broken.get(name)
            if broken is not None:
                raise ConflictError(f"job {name!r} is broken: {broken.reason}; fix or remove its record and restart the data server")
            raise NotFoundError(f"unknown job {name!r}; create it with POST /v1/jobs")
        return job

    def broken(self, name: str) -> BrokenJob | None:
        return self._broken.get(name)

    def names(self) -> list[str]:
        return sorted({*self._jobs, *self._broken})

    def create(self, spec: JobSpec, num_samples: int) -> tuple[Job, bool]:
        """Create ``spec``; re-creating an identical job is a no-op returning ``created=False``."""
        with self._lock:
            if spec.name in self._broken:
                self.get(spec.name)  # raises ConflictError: it is broken
            existing = self._jobs.get(spec.name)
            if existing is not None:
                if existing.spec.same_definition(spec):
                    return existing, False
                raise ConflictError(f"job {spec.name!r} exists with a different definition; pick another name")
            job = Job(spec, num_samples)
            self._persist(spec)
            self._jobs[spec.name] = job
            return job, True

    def delete(self, name: str) -> bool:
        """Forget ``name``'s record and served step (a broken one too); False if there was none."""
        with self._lock:
            known = self._jobs.pop(name, None) is not None or self._broken.pop(name, None) is not None
            for path in (self.state_dir / f"{name}.json", self._served_path(name)):
                if path.exists():
                    known = True
                    path.unlink()
            return known

    def add_generation(self, name: str, gen: Generation, committed_step: int | None = None, replan_served: bool = False) -> Job:
        """Append ``gen`` to job ``name``; refused (nothing written) unless it starts after every
        step already committed (``committed_step``, from the daemons' inventories) and, unless
        ``replan_served``, after every step whose batches were handed out."""
        with self._lock:
            job = self.get(name)
            planner = self._check_generation(job, gen, committed_step, replan_served)
            new_spec = replace(job.spec, generations=[*job.spec.generations, gen])
            self._persist(new_spec)
            job.spec, job.planner = new_spec, planner
            return job

    def _check_generation(self, job: Job, gen: Generation, committed_step: int | None, replan_served: bool) -> Planner:
        """The planner ``job`` would have with ``gen`` appended; ConflictError/InvalidError if refused."""
        spec, name = job.spec, job.spec.name
        start = gen.start_step
        if spec.max_steps is not None and start >= spec.max_steps:
            raise InvalidError(
                f"start_step {start} is at or past job {name!r}'s max_steps {spec.max_steps}; a generation must start at a step below it"
            )
        last = spec.generations[-1]
        if start <= last.start_step:
            raise ConflictError(
                f"a new generation must start after step {last.start_step} (the current generation's start), got start_step={start}"
            )
        committed = max((s for s in (committed_step, job.committed_step) if s is not None), default=None)
        if committed is not None and start <= committed:
            raise ConflictError(
                f"step {committed} of job {name!r} is committed (a node holds state saved after it): "
                f"a generation must start at step {committed + 1} or later"
            )
        if not replan_served:
            if job.served_unknown:
                raise ConflictError(
                    f"the newest step served for job {name!r} is unknown (its .served file was unreadable at start): "
                    f"send replan_served=true if no reader trained on batches from step {start} on"
                )
            if job.served_step is not None and start <= job.served_step:
                raise ConflictError(
                    f"batches of job {name!r} up to step {job.served_step} have been served: a generation must "
                    f"start at step {job.served_step + 1} or later, or send replan_served=true if the batches from "
                    f"step {start} on were only prefetched by node caches and no worker trained on them"
                )
        try:
            return Planner(job.num_samples, spec.seed, [*spec.generations, gen])
        except ValueError as exc:
            raise InvalidError(str(exc)) from exc

    async def admit(self, job: Job, last_step: int, planned_with: Planner) -> bool:
        """Before batches up to ``last_step`` of ``job`` leave: record them served. False when the
        request was checked with another ``planned_with`` than the job's record has now (another
        data server added a generation): the job is reloaded and the request must be checked again."""
        self.note_served(job, last_step)
        return planned_with is job.planner

    def note_served(self, job: Job, last_step: int) -> None:
        """Record, before they are sent, that batches up to ``last_step`` of ``job`` are served."""
        if job.served_step is not None and last_step <= job.served_step:
            return
        self._write(self._served_path(job.spec.name), {"served_step": last_step, "committed_step": job.committed_step})
        job.served_step = last_step

    def note_committed(self, job: Job, step: int | None) -> None:
        """Record that a daemon reported ``step`` of ``job`` committed (kept if it moved forward)."""
        if step is None or (job.committed_step is not None and step <= job.committed_step):
            return
        job.committed_step = step
        self._write(self._served_path(job.spec.name), {"served_step": job.served_step, "committed_step": step})

    def _persist(self, spec: JobSpec) -> None:
        self._write(self.state_dir / f"{spec.name}.json", spec.to_json())

    def _write(self, path: Path, value: dict[str, Any]) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
