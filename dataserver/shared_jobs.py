"""Job records in etcd, so that every data server of a deployment plans the same batches.

With ``dataserver serve --etcd``, a job's record (its ``JobSpec``) is the key
``/ffplane/jobs/spec/<name>`` and its served and committed steps ``/ffplane/jobs/served/<name>``:
the same two things the file registry keeps as ``<name>.json`` and ``<name>.served``. Each server
caches the records it has read, with the ``mod_revision`` its planner was built from, and proves
the cache current in the same transaction that records a request's steps as served: compare the
record's revision (and the served key's, when the served step moves), then write. A server whose
copy is stale loses that compare, reloads, and checks the request again; a generation is added
by comparing both keys too, so no server hands out a batch from a plan another server replaced
while the served step it relied on was moving. One etcd round trip per batch request, which asks
for several steps at once.

Records that exist only as files in the state directory (a server that ran before without
``--etcd``) are copied into etcd at start unless a record of that name is there already.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dataserver.jobs import BrokenJob, Job, JobRegistry, JobSpec, broken_reason, parse_record, parse_served
from dataserver.planner import Generation, Planner
from ffplane_contract.errors import ConflictError
from ffplane_runtime.etcd import Etcd, KeyValue

log = logging.getLogger(__name__)

SPEC_PREFIX = b"/ffplane/jobs/spec/"
SERVED_PREFIX = b"/ffplane/jobs/served/"
_ATTEMPTS = 8  # compare-and-set rounds lost to other servers before a request is refused
_RETRY_S = 3.0  # how long one registry call waits for etcd (the request fails with 503 after)


def _spec_key(name: str) -> bytes:
    return SPEC_PREFIX + name.encode()


def _served_key(name: str) -> bytes:
    return SERVED_PREFIX + name.encode()


class EtcdJobRegistry(JobRegistry):
    def __init__(self, etcd: Etcd, state_dir: Path) -> None:
        super().__init__(state_dir)
        self._etcd = etcd
        self._num_samples_of: Callable[[str], int] | None = None

    # --- reading ----------------------------------------------------------------------------
    def load(self, num_samples_of: Callable[[str], int]) -> list[str]:
        self._num_samples_of = num_samples_of
        self._import_files()
        served = {kv.key[len(SERVED_PREFIX) :].decode(): kv for kv in self._etcd.get_prefix(SERVED_PREFIX, retry_s=_RETRY_S)}
        for kv in self._etcd.get_prefix(SPEC_PREFIX, retry_s=_RETRY_S):
            name = kv.key[len(SPEC_PREFIX) :].decode()
            self._take(name, kv, served.get(name))
        return sorted(self._jobs)

    def _import_files(self) -> None:
        for path in sorted(self.state_dir.glob("*.json")):
            name = path.name[: -len(".json")]
            try:
                spec = parse_record(path.read_text(), name)
                side = self.state_dir / f"{name}.served"
                served = side.read_bytes() if side.exists() else None
                if served is not None:
                    parse_served(served)  # an unreadable one is not carried over
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("job record file not imported into etcd", extra={"job": name, "path": str(path), "error": str(exc)})
                continue
            puts = {_spec_key(name): json.dumps(spec.to_json()).encode()}
            if served is not None:
                puts[_served_key(name)] = served
            rev, _ = self._etcd.txn({_spec_key(name): 0}, puts)
            if rev is not None:
                log.info("job record imported into etcd", extra={"job": name, "path": str(path)})

    def _take(self, name: str, spec_kv: KeyValue | None, served_kv: KeyValue | None) -> None:
        """Make the cache hold ``name`` as etcd has it (records read together)."""
        with self._lock:
            if spec_kv is None:
                self._jobs.pop(name, None)
                self._broken.pop(name, None)
                return
            job = self._jobs.get(name)
            if job is None or job.record_rev != spec_kv.mod_revision:
                spec: JobSpec | None = None
                try:
                    spec = parse_record(spec_kv.value, name)
                    assert self._num_samples_of is not None, "load() first"
                    num_samples = self._num_samples_of(spec.dataset)
                    planner = Planner(num_samples, spec.seed, list(spec.generations))
                except Exception as exc:  # noqa: BLE001 - one unusable record breaks only its job
                    reason = broken_reason(f"etcd key {spec_kv.key.decode()}", exc)
                    if name not in self._broken:
                        log.warning("job record unusable; the job is marked broken", extra={"job": name, "reason": reason})
                    self._jobs.pop(name, None)
                    self._broken[name] = BrokenJob(name, reason, spec)
                    return
                self._broken.pop(name, None)
                if job is None:
                    job = self._jobs[name] = Job(spec, num_samples)
                else:  # in place: requests holding the job see the new plan (and re-check, see admit)
                    job.spec, job.num_samples, job.planner = spec, num_samples, planner
                job.record_rev = spec_kv.mod_revision
            self._absorb_served(job, served_kv)

    def _absorb_served(self, job: Job, kv: KeyValue | None) -> None:
        if kv is None or kv.mod_revision <= job.served_rev:
            return
        try:
            served, committed = parse_served(kv.value)
        except (ValueError, TypeError, AttributeError) as exc:
            job.served_unknown = True
            log.warning(
                "served-step key unreadable: generations of this job need replan_served", extra={"job": job.spec.name, "error": str(exc)}
            )
            return
        job.served_rev, job.served_unknown = kv.mod_revision, False
        job.served_step = served
        if committed is not None and (job.committed_step is None or committed > job.committed_step):
            job.committed_step = committed

    def refresh(self, name: str) -> None:
        """Blocking: read ``name``'s record from etcd into the cache (gone there: gone here)."""
        spec_kv = self._etcd.get(_spec_key(name), retry_s=_RETRY_S)
        served_kv = self._etcd.get(_served_key(name), retry_s=_RETRY_S) if spec_kv is not None else None
        self._take(name, spec_kv, served_kv)

    def find(self, name: str) -> Job | None:
        if name not in self._jobs and name not in self._broken:
            self.refresh(name)
        return self._jobs.get(name)

    def get(self, name: str) -> Job:
        if name not in self._jobs and name not in self._broken:
            self.refresh(name)
        return super().get(name)

    def broken(self, name: str) -> BrokenJob | None:
        self.find(name)
        return self._broken.get(name)

    def names(self) -> list[str]:
        return sorted(kv.key[len(SPEC_PREFIX) :].decode() for kv in self._etcd.get_prefix(SPEC_PREFIX, retry_s=_RETRY_S))

    # --- writing ----------------------------------------------------------------------------
    def create(self, spec: JobSpec, num_samples: int) -> tuple[Job, bool]:
        key = _spec_key(spec.name)
        rev, now = self._etcd.txn({key: 0}, {key: json.dumps(spec.to_json()).encode()})
        if rev is None:
            self._take(spec.name, now[key], self._etcd.get(_served_key(spec.name), retry_s=_RETRY_S))
            existing = self.get(spec.name)  # raises ConflictError for a broken record
            if existing.spec.same_definition(spec):
                return existing, False
            raise ConflictError(f"job {spec.name!r} exists with a different definition; pick another name")
        with self._lock:
            job = self._jobs[spec.name] = Job(spec, num_samples)
            job.record_rev = rev
            self._broken.pop(spec.name, None)
        return job, True

    def delete(self, name: str) -> bool:
        """Forget ``name`` in etcd (every server then sees it gone) and in any file record, which
        would otherwise be imported again at the next start."""
        removed = self._etcd.delete(_spec_key(name))
        self._etcd.delete(_served_key(name))
        return super().delete(name) or removed

    def add_generation(self, name: str, gen: Generation, committed_step: int | None = None, replan_served: bool = False) -> Job:
        for _ in range(_ATTEMPTS):
            self.refresh(name)
            job = self.get(name)
            planner = self._check_generation(job, gen, committed_step, replan_served)
            new_spec = replace(job.spec, generations=[*job.spec.generations, gen])
            expect = {_spec_key(name): job.record_rev, _served_key(name): job.served_rev}
            rev, _ = self._etcd.txn(expect, {_spec_key(name): json.dumps(new_spec.to_json()).encode()})
            if rev is not None:
                with self._lock:
                    job.spec, job.planner, job.record_rev = new_spec, planner, rev
                return job
        raise ConflictError(f"job {name!r} kept changing under this request (other data servers serving it); send it again")

    async def admit(self, job: Job, last_step: int, planned_with: Planner) -> bool:
        return await asyncio.to_thread(self._admit, job, last_step, planned_with)

    def _admit(self, job: Job, last_step: int, planned_with: Planner) -> bool:
        name = job.spec.name
        for _ in range(_ATTEMPTS):
            with self._lock:
                if planned_with is not job.planner:
                    return False
                record_rev, served_rev = job.record_rev, job.served_rev
                advance = job.served_step is None or last_step > job.served_step
                value = {"served_step": last_step, "committed_step": job.committed_step}
            expect = {_spec_key(name): record_rev}
            puts: dict[bytes, bytes] = {}
            if advance:
                expect[_served_key(name)] = served_rev
                puts[_served_key(name)] = json.dumps(value).encode()
            rev, now = self._etcd.txn(expect, puts)
            if rev is not None:
                if advance:
                    with self._lock:
                        if rev > job.served_rev:
                            job.served_rev, job.served_step = rev, last_step
                return planned_with is job.planner
            spec_now = now.get(_spec_key(name))
            if spec_now is None or spec_now.mod_revision != record_rev:
                self.refresh(name)  # another server changed (or removed) the record
                return False
            with self._lock:
                self._absorb_served(job, now.get(_served_key(name)))
        raise ConflictError(f"the served step of job {name!r} kept moving under this request; ask again")

    def note_served(self, job: Job, last_step: int) -> None:
        self._admit(job, last_step, job.planner)

    def note_committed(self, job: Job, step: int | None) -> None:
        for _ in range(_ATTEMPTS):
            with self._lock:
                if step is None or (job.committed_step is not None and step <= job.committed_step):
                    return
                served_rev = job.served_rev
                value: dict[str, Any] = {"served_step": job.served_step, "committed_step": step}
            rev, now = self._etcd.txn({_served_key(job.spec.name): served_rev}, {_served_key(job.spec.name): json.dumps(value).encode()})
            with self._lock:
                if rev is not None:
                    if rev > job.served_rev:
                        job.served_rev, job.committed_step = rev, step
                    return
                self._absorb_served(job, now.get(_served_key(job.spec.name)))
