"""Jobs: a dataset, a seed and a layout history, persisted so a restarted server plans the same.

A job's record is a small JSON file, replaced atomically on every change; the plan itself is
never stored because it is a pure function of the record.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dataserver.planner import Generation, Planner

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class JobError(ValueError):
    """A job request is invalid; the message says what to change."""


class JobConflict(JobError):
    """A job of that name exists with a different definition."""


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
        if not _NAME.match(self.name):
            raise JobError(f"job name {self.name!r} must match {_NAME.pattern}")
        if self.max_steps is not None and self.max_steps < 1:
            raise JobError(f"max_steps must be >= 1 or null, got {self.max_steps}")
        if not self.generations:
            self.generations = [Generation(0, self.dp, self.batch_per_rank)]

    def same_definition(self, other: JobSpec) -> bool:
        keys = ("dataset", "dp", "batch_per_rank", "seed", "max_steps")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JobSpec:
        gens = [Generation(**g) for g in raw.pop("generations", [])]
        return cls(**raw, generations=gens)


class Job:
    def __init__(self, spec: JobSpec, num_samples: int) -> None:
        self.spec = spec
        self.planner = Planner(num_samples, spec.seed, list(spec.generations))

    def check_step(self, step: int) -> None:
        if step < 0 or (self.spec.max_steps is not None and step >= self.spec.max_steps):
            raise JobError(
                f"step {step} is outside job {self.spec.name!r}: steps run 0..{self.spec.max_steps}"
                if self.spec.max_steps is not None
                else f"step {step} is negative"
            )


class JobRegistry:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def load(self, num_samples_of: Any) -> list[str]:
        """Reload persisted jobs; ``num_samples_of(dataset)`` gives each dataset's length."""
        for path in sorted(self.state_dir.glob("*.json")):
            spec = JobSpec.from_json(json.loads(path.read_text()))
            self._jobs[spec.name] = Job(spec, num_samples_of(spec.dataset))
        return sorted(self._jobs)

    def get(self, name: str) -> Job:
        job = self._jobs.get(name)
        if job is None:
            raise KeyError(f"unknown job {name!r}; create it with POST /v1/jobs")
        return job

    def names(self) -> list[str]:
        return sorted(self._jobs)

    def create(self, spec: JobSpec, num_samples: int) -> tuple[Job, bool]:
        """Create ``spec``; re-creating an identical job is a no-op returning ``created=False``."""
        with self._lock:
            existing = self._jobs.get(spec.name)
            if existing is not None:
                if existing.spec.same_definition(spec):
                    return existing, False
                raise JobConflict(
                    f"job {spec.name!r} exists with a different definition; pick another name"
                )
            job = Job(spec, num_samples)
            self._persist(spec)
            self._jobs[spec.name] = job
            return job, True

    def add_generation(self, name: str, gen: Generation) -> Job:
        with self._lock:
            job = self.get(name)
            job.planner.add_generation(gen)  # validates before anything is written
            job.spec.generations.append(gen)
            self._persist(job.spec)
            return job

    def _persist(self, spec: JobSpec) -> None:
        path = self.state_dir / f"{spec.name}.json"
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(spec.to_json()))
        os.replace(tmp, path)
