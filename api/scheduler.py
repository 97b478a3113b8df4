"""The controller's side of the tuner: turns jobs into slot studies, and studies into trials for workers.

One pass (`Scheduler.tick`) does, in order:

1. marks silent workers lost and fails every trial whose lease ran out (`storage.expire_leases`);
2. for each running job and each active slot: tells the slot's `SlotStudy` every trial that finished since
   the last pass (a measurement, a worker's failure, or a lost lease -> `SlotStudy.requeue`), records the
   fastest trial so far, then keeps ``queue_depth`` trials waiting with `SlotStudy.ask` proposals (stored as
   `Proposal.to_dict()` in the trial's config).  A decided slot writes its winner (`storage.upsert_best`)
   and a job whose slots are all decided ends succeeded (or failed, naming the slots no config ran on);
3. starts queued jobs: one layer study per slot, unless a running job is tuning the same study (same GPU
   model, shape and slot share one Optuna study; the later job waits, then resumes the decided study).

Surviving a restart: the tuner keeps all its state in Optuna's storage in the same database, and
`SlotStudy.tell` / `requeue` do nothing for a proposal already told.  So a fresh controller rebuilds each
`SlotStudy` and simply replays every finished trial row once (what was told before is skipped by the tuner);
proposals the tuner handed out but which never became a trial row (the controller died in between) come back
through `SlotStudy.outstanding` and are queued again.

One scheduler drives a database at a time, chosen by the database: every controller process (several controllers
behind a load balancer, and every process of ``autotune serve --workers N``) runs this loop, and each pass
begins by claiming the scheduler lease (`api.leadership`, `storage.leader`).  The holder renews it once half of
it has gone by and does the work above; the others only check, once a pass, whether the lease ran out, and take
over when it did: within ``AUTOTUNE_LEADER_TTL_S`` (10 s) of a holder that was killed, at once after one that
stopped cleanly.  A process that takes the lease (or takes it back after losing it) forgets every study it held
and rebuilds them as after a restart, since another process may have told them since.  A standby builds no
Optuna storage and holds one database connection.  ``AUTOTUNE_SCHEDULER=false`` keeps a controller out of the
running altogether (an API-only replica).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import optuna
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

import storage
from api.fit import can_run
from api.leadership import Leadership
from api.logs import RateLimitedLog
from api.trial_rows import fastest, measurements_of, proposal_of
from autotune.tuner.gpu import CPU, model_of, results_gpu
from autotune.tuner.proposal import Proposal
from autotune.tuner.studies import SlotStudy, study_name
from overlap_runtime.config import DeviceLimits, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from storage import Backend, Job, JobStatus, LayerStudy, Trial, TrialState

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_ERRORS = 5
"""Unexpected errors in a row on one job before it is failed (transient database errors never count)."""
TRANSIENT = (storage.StorageError, SQLAlchemyError, optuna.exceptions.StorageInternalError)
ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
MAX_SUSPECT = 3
"""Suspect results of one proposal, each by a different worker, before it is told as failed."""


@dataclass(kw_only=True)
class _Slot:
    """A running layer study and what this process knows of it beyond the database."""

    study: SlotStudy
    job_id: str
    told: set[int] = field(default_factory=set)
    """Trial rows already told (or requeued) by this process."""
    best_ms: float = float("inf")
    """The fastest valid time among the rows told, to spot a new best so far."""
    adopted: bool = False
    """Whether proposals handed out without a row (a controller died in between) were queued again."""


class Scheduler:
    """Drives every job of one database; all state that matters is in that database."""

    def __init__(self, *, engine: Engine, heartbeat_timeout_s: float, queue_depth: int, leader_ttl_s: float) -> None:
        self.engine = engine
        self.sessions = storage.session_factory(engine=engine)
        self.heartbeat_timeout = timedelta(seconds=heartbeat_timeout_s)
        self.queue_depth = queue_depth
        self.leadership = Leadership(ttl=timedelta(seconds=leader_ttl_s))
        self._optuna_storage: optuna.storages.RDBStorage | None = None
        self._term: int | None = None
        """The leadership term `_slots` belong to."""
        self._slots: dict[int, _Slot] = {}
        self._errors: Counter[str] = Counter()
        self.outages = RateLimitedLog(log)
        """Failures that repeat every pass while the database is down are logged once per while (api.logs)."""

    @property
    def leading(self) -> bool:
        """Whether this scheduler held the lease at its last claim."""
        return self.leadership.leading

    def tick(self) -> bool:
        """One pass over workers, leases, running jobs and queued jobs (module docstring), if this scheduler
        holds the lease; whether it did."""
        with self.sessions() as session:
            if not self._lead(session):
                return False
            storage.mark_lost_workers(session=session, timeout=self.heartbeat_timeout)
            storage.expire_leases(session=session)
            running = storage.jobs_in(session=session, status=JobStatus.RUNNING)
            for job in running:
                if not self._still_leading(session):
                    return False
                self._guarded(session, job, self._drive)
            busy = storage.study_names_in(session=session, status=JobStatus.RUNNING)
            for job in reversed(storage.jobs_in(session=session, status=JobStatus.QUEUED)):  # oldest first
                if not self._still_leading(session):
                    return False
                self._guarded(session, job, lambda s, j: self._start(s, j, busy))
            self._prune(session=session, running=running)
            return True

    def resign(self) -> None:
        """Hand the lease over (a clean stop): another controller takes over on its next pass."""
        with self.sessions() as session:
            self.leadership.resign(session=session)

    # --- leadership -----------------------------------------------------------------------------------------

    def _lead(self, session: Session) -> bool:
        """Claim the lease; on a new term, drop what this process remembers of the studies (module docstring)."""
        # The holder writes the lease only once half of it has gone by: nobody can take it before it runs out,
        # and a write on every pass was most of what an idle pass cost.
        leadership = self.leadership
        term = leadership.keep(session=session) if leadership.leading else leadership.claim(session=session)
        if term != self._term:
            self._slots.clear()
            self._errors.clear()
            self._term = term
        return term is not None

    def _still_leading(self, session: Session) -> bool:
        """Between jobs of a long pass: renew the lease when due; False (stop the pass) once it is lost."""
        term = self.leadership.keep(session=session)
        return term is not None and term == self._term

    def _optuna(self) -> optuna.storages.RDBStorage:
        """Optuna's storage, built on first use: only the leader needs it, and building it creates Optuna's
        tables, which several processes starting on a fresh database must not race to do."""
        if self._optuna_storage is None:
            self._optuna_storage = storage.optuna_storage(self.engine)
        return self._optuna_storage

    def _prune(self, *, session: Session, running: list[Job]) -> None:
        """Drop the studies of jobs that ended or were cancelled since the last pass."""
        live = {study.id for job in running for study in storage.list_layer_studies(session=session, job_id=job.id)}
        for study_id in set(self._slots) - live:
            del self._slots[study_id]

    # --- jobs -----------------------------------------------------------------------------------------------

    def _guarded(self, session: Session, job: Job, step: Callable[[Session, Job], None]) -> None:
        """Run ``step(session, job)``; a bad job fails alone, a flaky database is retried next pass.

        After any error the job's studies are rebuilt on the next pass: a tell or ask that died half-way is
        then replayed or adopted, as after a restart.
        """
        try:
            step(session, job)
            self._errors.pop(job.id, None)
        except InputError as e:
            log.warning("job %s failed: %s", job.id, e)
            self._fail(session, job, str(e))
        except TRANSIENT as e:
            self.outages.warning("job", "job %s: database error, retrying next pass: %s", job.id, e)
            session.rollback()
            self._forget(job)
        except Exception as e:
            log.exception("job %s: scheduler error", job.id)
            session.rollback()
            self._forget(job)
            self._errors[job.id] += 1
            if self._errors[job.id] >= MAX_CONSECUTIVE_ERRORS:
                self._fail(session, job, f"scheduler error: {type(e).__name__}: {e}")

    def _fail(self, session: Session, job: Job, reason: str) -> None:
        self._forget(job)
        self._errors.pop(job.id, None)
        with contextlib.suppress(storage.Conflict):  # cancelled meanwhile: the user's word stands
            storage.set_job_status(session=session, job_id=job.id, status=JobStatus.FAILED, error=reason)

    def _forget(self, job: Job) -> None:
        self._slots = {k: v for k, v in self._slots.items() if v.job_id != job.id}

    def _start(self, session: Session, job: Job, busy: set[str]) -> None:
        """Queue -> running: one layer study per slot, once the job can run and nothing else tunes its studies."""
        gpu = self._gpu_for(session=session, job=job)
        if gpu is None:
            return  # no worker can run it yet: stays queued
        shape = _shape(job)
        names = {slot: study_name(gpu=gpu, shape=shape, slot=Slot(slot)) for slot in job.layers}
        if busy & set(names.values()):
            return  # a running job tunes the same studies: this one resumes them once it is done
        for slot, name in names.items():
            study = storage.add_layer_study(session=session, job_id=job.id, slot=slot, optuna_study_name=name)
            storage.update_layer_study(session=session, study_id=study.id, status=JobStatus.RUNNING)
        busy |= set(names.values())
        # A job that named its GPU now carries the model's full name, which worker claims match exactly.
        resolved = None if job.gpu is None else model_of(gpu)
        storage.set_job_status(session=session, job_id=job.id, status=JobStatus.RUNNING, gpu=resolved)
        log.info("job %s started on %s (%d slots)", job.id, gpu, len(names))

    def _gpu_for(self, *, session: Session, job: Job) -> str | None:
        """The GPU name the job's results are keyed by: "cpu", or the model of a worker that can run it and
        that the job's ``gpu`` selects (`gpu_matches`: "h200" selects "NVIDIA H200"), marked on te
        (`results_gpu`); None while there is none, so a GPU job waits for its first worker.  A te job needs a
        te worker whose inventory reports TransformerEngine (``te_version``)."""
        if job.backend == Backend.CPU:
            return CPU
        capable = [w.gpu_model for w in storage.list_workers(session=session) if can_run(w, job) and w.gpu_model]
        return results_gpu(Counter(capable).most_common(1)[0][0], job.backend.value) if capable else None

    def _drive(self, session: Session, job: Job) -> None:
        """Tell, record, ask for every active slot of a running job; end the job once every slot is decided."""
        studies = storage.list_layer_studies(session=session, job_id=job.id)
        for study in studies:
            if study.status == JobStatus.RUNNING:
                self._drive_slot(session=session, job=job, study=study)
        studies = storage.list_layer_studies(session=session, job_id=job.id)
        if any(s.status in ACTIVE for s in studies):
            return
        failed = [s.slot for s in studies if s.status == JobStatus.FAILED]
        status = JobStatus.FAILED if failed else JobStatus.SUCCEEDED
        error = f"no config ran correctly on: {', '.join(failed)}" if failed else None
        with contextlib.suppress(storage.Conflict):
            storage.set_job_status(session=session, job_id=job.id, status=status, error=error)
            log.info("job %s %s", job.id, status.value)
        self._forget(job)

    # --- slots ----------------------------------------------------------------------------------------------

    def _drive_slot(self, *, session: Session, job: Job, study: LayerStudy) -> None:
        slot = self._slot(session=session, job=job, study=study)
        rows = _rows(session=session, job=job, study=study)
        for row in rows:
            if row.state in (TrialState.COMPLETE, TrialState.FAILED) and row.id not in slot.told:
                if row.suspect is None:
                    self._tell(session=session, slot=slot, study=study, row=row)
                else:
                    self._remeasure(session=session, slot=slot, study=study, row=row, rows=rows)
        if not slot.adopted:
            self._adopt(session=session, slot=slot, study=study, rows=rows)
        waiting = sum(row.state == TrialState.WAITING for row in rows)
        while waiting < self.queue_depth and not slot.study.finished:
            proposal = slot.study.ask()
            if proposal is None:
                break
            _add(session=session, study=study, proposal=proposal)
            waiting += 1
        if slot.study.finished:
            self._decide(session=session, job=job, study=study, slot=slot, rows=rows)

    def _slot(self, *, session: Session, job: Job, study: LayerStudy) -> _Slot:
        """The slot's `SlotStudy`, built (or, after a restart, rebuilt from Optuna's storage) on first use."""
        known = self._slots.get(study.id)
        if known is not None:
            return known
        gpu = _gpu_of(study.optuna_study_name)
        slot = _Slot(
            job_id=job.id,
            study=storage.open_study(
                session=session,
                storage=self._optuna(),
                gpu=gpu,
                shape=_shape(job),
                slot=Slot(study.slot),
                backend=job.backend.value,
                limits=_limits(session=session, gpu=gpu),
                n_trials=job.n_trials,
                measure_first=storage.first_configs(job, study.slot),
            ),
        )
        if slot.study.name != study.optuna_study_name:
            raise InputError(
                "study", f"is tracked as {study.optuna_study_name!r} but the tuner names it", slot.study.name
            )
        self._slots[study.id] = slot
        return slot

    def _tell(self, *, session: Session, slot: _Slot, study: LayerStudy, row: Trial) -> None:
        """Tell the tuner how the trial ended (repeating a tell is harmless: the tuner skips it)."""
        proposal = proposal_of(row)
        if row.state == TrialState.COMPLETE:
            slot.study.tell(proposal, measurements=measurements_of(row))
            best = fastest(row)
            if best is not None and best[1]["overlap_ms"] is not None and best[1]["overlap_ms"] < slot.best_ms:
                slot.best_ms = best[1]["overlap_ms"]
                storage.update_layer_study(session=session, study_id=study.id, best_trial_id=row.id)
        elif row.error == storage.LEASE_EXPIRED:
            slot.study.requeue(proposal, row.error)
        else:
            slot.study.tell(proposal, failure=row.error or "failed without a reason")
        slot.told.add(row.id)

    def _remeasure(self, *, session: Session, slot: _Slot, study: LayerStudy, row: Trial, rows: list[Trial]) -> None:
        """A suspect result is never told: its proposal is queued again, as a second row of the same Optuna
        trial number, which the worker that reported it cannot claim (`storage.claim_trial`).  Another
        worker's result is then told in its place; after `MAX_SUSPECT` suspect results the proposal is told
        as failed, so the slot is never stuck on workers that all disagree with what was seen."""
        same = [r for r in rows if r.optuna_trial_number == row.optuna_trial_number]
        suspects = [r for r in same if r.suspect is not None]
        queued = any(r.id > row.id for r in same)  # by this process before a restart, or by the previous leader
        if not queued and len(suspects) >= MAX_SUSPECT:
            slot.study.tell(proposal_of(row), failure=f"suspect on {len(suspects)} workers; last: {row.suspect}")
        elif not queued:
            log.warning(
                "re-measuring trial %d of %s on another worker: %s", row.id, study.optuna_study_name, row.suspect
            )
            _add(session=session, study=study, proposal=proposal_of(row))
        slot.told.add(row.id)

    def _adopt(self, *, session: Session, slot: _Slot, study: LayerStudy, rows: list[Trial]) -> None:
        """Queue proposals the tuner handed out that have no row here (lost in a crash, or left by a cancelled
        job on the same study), so the study is never stuck waiting for them."""
        numbers = {row.optuna_trial_number for row in rows}
        for proposal in slot.study.outstanding():
            if proposal.number not in numbers:
                log.info("re-queueing proposal %d of %s", proposal.number, study.optuna_study_name)
                _add(session=session, study=study, proposal=proposal)
        slot.adopted = True

    def _decide(self, *, session: Session, job: Job, study: LayerStudy, slot: _Slot, rows: list[Trial]) -> None:
        """Write the slot's winner (or mark it failed when no config ran correctly)."""
        outcome = slot.study.outcome()
        if outcome is None:
            storage.update_layer_study(session=session, study_id=study.id, status=JobStatus.FAILED)
            return
        trial_id = _trial_of(rows, outcome.best, outcome.best_measurement)
        storage.record_winner(
            session=session,
            gpu=_gpu_of(study.optuna_study_name),
            shape=_shape(job),
            outcome=outcome,
            trial_id=trial_id,
            job_id=job.id,
        )
        storage.update_layer_study(
            session=session, study_id=study.id, status=JobStatus.SUCCEEDED, best_trial_id=trial_id
        )


WAKE_GAP_S = 0.05
"""The least time between a pass and one a `SchedulerThread.wake` asked for: a burst of wakes (many workers
reporting at once) is served by one pass, not one each."""


class SchedulerThread:
    """Runs `Scheduler.tick` every ``interval_s`` on a daemon thread until `stop`, and at once when `wake`d."""

    def __init__(
        self, *, engine: Engine, interval_s: float, heartbeat_timeout_s: float, queue_depth: int, leader_ttl_s: float
    ) -> None:
        self.scheduler = Scheduler(
            engine=engine, heartbeat_timeout_s=heartbeat_timeout_s, queue_depth=queue_depth, leader_ttl_s=leader_ttl_s
        )
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run a pass now rather than at the interval's end: a route changed what the scheduler acts on (a job
        submitted or cancelled, a trial claimed, reported or released), so the next step need not wait.  A pass
        under way is followed by another, which sees the change."""
        self._wake.set()

    def stop(self) -> None:
        """Finish the pass under way, then hand the lease over so another controller need not wait it out."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        try:
            self.scheduler.resign()
        except TRANSIENT:  # the database is gone: the lease runs out by itself
            log.warning("could not hand over the scheduler lease; it expires in %s", self.scheduler.leadership.ttl)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.scheduler.tick()
            except TRANSIENT as e:  # the loop must outlive a database outage; the next pass retries
                self.scheduler.outages.warning("pass", "scheduler pass failed, retrying: %s", _cause(e))
                storage.reclaim(engine=self.scheduler.engine)  # a full disk gets the WAL's space back
            except Exception:
                self.scheduler.outages.warning("bug", "scheduler pass failed", traceback=True)
            if self._wake.wait(self.interval_s):
                self._stop.wait(WAKE_GAP_S)


def _cause(error: BaseException) -> str:
    """The driver's message of a SQLAlchemy error without SQLAlchemy's statement and background link."""
    return f"{type(error).__name__}: {getattr(error, 'orig', None) or error}"


def _rows(*, session: Session, job: Job, study: LayerStudy) -> list[Trial]:
    rows: list[Trial] = []
    while True:
        page = storage.list_trials(
            session=session, job_id=job.id, study_id=study.id, limit=storage.page.MAX_PAGE_SIZE, offset=len(rows)
        )
        rows += page.items
        if len(rows) >= page.total or not page.items:
            return rows


def _add(*, session: Session, study: LayerStudy, proposal: Proposal) -> None:
    storage.add_trial(
        session=session,
        study_id=study.id,
        optuna_trial_number=proposal.number,
        config=proposal.to_dict(),
        purpose=proposal.purpose,
    )


def _trial_of(rows: list[Trial], config: OverlapConfig, measurement: Measurement) -> int | None:
    """The row that measured ``config`` as ``measurement`` (the finalist batch, usually)."""
    for row in reversed(rows):
        if row.state == TrialState.COMPLETE:
            pairs = zip(proposal_of(row).configs, measurements_of(row), strict=False)
            if any(c == config and m == measurement for c, m in pairs):
                return row.id
    return None


def _shape(job: Job) -> ModelShape:
    return ModelShape(**job.shape)


def _gpu_of(name: str) -> str:
    """The GPU model inside a study name (``autotune-v1:{gpu}:{shape key}:{slot}``)."""
    return ":".join(name.split(":")[1:-2])


def _limits(*, session: Session, gpu: str) -> DeviceLimits | None:
    """The SM count of ``gpu`` as its workers reported it (lost ones too: a model's SM count does not change)."""
    if gpu == CPU:
        return None
    model = model_of(gpu)
    counts = [
        g["sm_count"]
        for w in storage.list_workers(session=session)
        if w.gpu_model == model
        for g in w.gpus
        if g.get("name") == model and g.get("sm_count")
    ]
    return DeviceLimits(sm_count=min(counts)) if counts else None
