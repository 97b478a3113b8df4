"""The worker loop: register, heartbeat, claim a trial, measure it on the local TP group, report, repeat.

A worker holds no database credentials and no tuner state: it asks the controller for work over REST.  It
registers with the controller's worker token (the clients' token where the controller has none) and from
then on speaks with the secret its registration returned; each renewal and result also repeats its claim's
lease nonce (docs/rest.md, Workers).
While it measures, a background thread renews the trial's lease every third of the lease, so a long trial
on a healthy worker is never taken away, while a worker that dies (kill -9, a lost node) stops renewing and
its trial goes back to the queue once the lease runs out.  A failing config is reported as a failed trial
and the loop goes on; a controller that is restarting is waited for (connection errors are retried with
back-off), and a controller that forgot this worker (404) or no longer takes its secret (401: a database
from before worker secrets) gets a fresh registration.  A result the controller refuses as impossible
(422, its physics check) is reported as the trial's failure, so the trial does not wait out its lease.

One `Runtime` (one TP group of processes) is kept for the tp of the last trial, since starting a group
costs seconds; a trial with another tp replaces it.

A worker a batch system started must end by itself for its array task or Job to complete: with
``exit_when_idle_s`` it returns (exit 0) once it has had nothing to claim for that long, and gives up (exit 1)
on a controller that stayed unreachable that long; with ``max_jobs`` it returns at the first moment with
nothing to claim once that many of the jobs it ran trials for have ended.  Stopped while it measures (SIGTERM
from ``scancel`` or a pod's eviction arrives as `KeyboardInterrupt`), it hands its trial back to the queue at
once (`Client.release`), so another worker takes it without waiting out the lease.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from api.schemas import ClaimPublic, WorkerCreated
from autotune.cli.inventory import worker_body
from autotune.cli.rest_client import ENDED, ApiError, Client, RequestRejected
from overlap_runtime.errors import InputError, LeaseLost, TrialFailure
from overlap_runtime.runtime import Runtime, open_runtime
from overlap_runtime.shape import ModelShape, Slot

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
RELEASE_TIMEOUT_S = 5.0
"""How long a stopping worker waits on the controller to take its trial back: a batch system kills it soon."""
STOP_NOTICE_TIMEOUT_S = 2.0
"""How long a stopping worker waits to tell the controller so: a controller that is gone must not hold it up."""
IDLE_BACKOFF = 8.0
"""An idle worker's pause grows from ``poll_s`` to this many times it: 64 idle workers polling every second
cost one controller more than the trials did (bench/fleet_scale.py), and one with work claims again at once."""
FORGOTTEN = (httpx.codes.NOT_FOUND, httpx.codes.UNAUTHORIZED)
"""Answers to a worker call that mean "register again": the controller does not know this worker or its secret."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    backend: str
    """cpu (gloo ranks), cuda (one GPU per rank) or te (one GPU per rank, measured through TE)."""
    name: str | None = None
    """Shown on the dashboard; host-pid when None."""
    poll_s: float = 1.0
    """Pause after a claim found nothing, growing while nothing comes (`IdlePause`)."""
    heartbeat_s: float = 10.0
    trial_timeout_s: float = 180.0
    """Per config and round: a group that takes longer is killed and the trial reported as hung."""
    warmup: int = 5
    exit_when_idle_s: float | None = None
    """Return once nothing could be claimed for this long (the controller unreachable counts, and then fails)."""
    max_jobs: int | None = None
    """Return, when idle, once this many of the jobs it ran trials for have ended."""


class IdlePause:
    """The pause after each empty claim: ``poll_s``, doubling up to `IDLE_BACKOFF` times it until a claim gets
    work; each drawn within +-25%, so workers that a batch system started together do not poll together."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._next = poll_s

    def next(self) -> float:
        pause = self._next * random.uniform(0.75, 1.25)
        self._next = min(2 * self._next, IDLE_BACKOFF * self.poll_s)
        return pause

    def reset(self) -> None:
        self._next = self.poll_s


class WorkerLoop:
    """Runs trials for one controller until `stop` is set (or the process is interrupted)."""

    def __init__(self, *, client: Client, options: WorkerOptions) -> None:
        self.client = client
        self.options = options
        self.stop = threading.Event()
        self.worker: WorkerCreated | None = None
        """This process's registration: its id and secret."""
        self._runtime: Runtime | None = None
        self._reregister = threading.Event()
        self._pause = IdlePause(options.poll_s)
        self._idle_since: float | None = time.monotonic()
        """Since when it has had nothing to run; None while it runs a trial (a long one is not idleness)."""
        self._jobs: dict[str, bool] = {}
        """The jobs this worker ran trials for: whether each has ended."""

    def run(self) -> None:
        """Work until stopped or done (module docstring); always closes the TP group on the way out."""
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        try:
            self._register()
            heartbeats.start()
            while not self.stop.is_set():
                if self._reregister.is_set():
                    self._register()
                claim = self._claim()
                if claim is None:
                    if self._done():
                        return
                    self.stop.wait(self._pause.next())
                    continue
                self._pause.reset()
                self._jobs.setdefault(claim.job_id, False)
                self._idle_since = None
                self._run_trial(claim)
                self._idle_since = time.monotonic()
        except InterruptedError:
            log.info("worker stopped")
        finally:
            self.stop.set()
            if self._runtime is not None:
                self._runtime.close()
            self._say_stopped()

    def _say_stopped(self) -> None:
        """Tell the controller it stops (the dashboard then shows it stopped, not lost), if it can at once."""
        if self.worker is None:
            return
        try:
            self.client.stopped(self.worker, timeout_s=STOP_NOTICE_TIMEOUT_S)
        except (ApiError, httpx.TransportError) as e:  # unreachable or forgot it: it shows as lost, as before
            log.warning("could not tell the controller this worker stops: %s", e)

    def _done(self) -> bool:
        """Whether an idle worker has done what it was started for (``exit_when_idle_s``, ``max_jobs``)."""
        if self._idle_expired():
            log.info("nothing to claim for %g s: exiting", self.options.exit_when_idle_s)
            return True
        max_jobs = self.options.max_jobs
        if max_jobs is None or len(self._jobs) < max_jobs:
            return False
        for job_id, ended in self._jobs.items():
            self._jobs[job_id] = ended or self._ended(job_id)
        if sum(self._jobs.values()) < max_jobs:
            return False
        log.info("%d jobs it ran trials for have ended: exiting", max_jobs)
        return True

    def _ended(self, job_id: str) -> bool:
        try:
            return self._retrying(lambda: self.client.job(job_id)).status in ENDED
        except ApiError as e:
            if e.status != httpx.codes.NOT_FOUND:
                raise
            return True  # deleted with its database: it gets no more trials either

    def _idle_expired(self) -> bool:
        limit, since = self.options.exit_when_idle_s, self._idle_since
        return limit is not None and since is not None and time.monotonic() - since >= limit

    def _me(self) -> WorkerCreated:
        if self.worker is None:
            raise RuntimeError("worker is not registered")
        return self.worker

    def _register(self) -> None:
        body = worker_body(backend=self.options.backend, name=self.options.name)
        self.worker = self._retrying(lambda: self.client.register(body))
        self._reregister.clear()
        log.info("registered as worker %s (%s)", self.worker.id, self.worker.name)

    def _claim(self) -> ClaimPublic | None:
        try:
            return self._retrying(lambda: self.client.claim(self._me()))
        except ApiError as e:
            if e.status not in FORGOTTEN:
                raise
            self._reregister.set()  # the controller no longer knows this worker (a fresh database)
            return None

    def _heartbeat_loop(self) -> None:
        while not self.stop.wait(self.options.heartbeat_s):
            try:
                self.client.heartbeat(self._me())
            except ApiError as e:
                if e.status in FORGOTTEN:
                    self._reregister.set()
                log.warning("heartbeat refused: %s", e)
            except httpx.TransportError as e:
                log.warning("heartbeat failed (controller unreachable): %s", e)

    def _run_trial(self, claim: ClaimPublic) -> None:
        try:
            self._measure_and_report(claim)
        except KeyboardInterrupt:  # SIGTERM or Ctrl-C while the trial is ours
            self._hand_back(claim)
            raise

    def _hand_back(self, claim: ClaimPublic) -> None:
        """Release the trial to the queue: once, briefly, since the process is ending; a trial already
        reported or lost needs nothing, and one the controller cannot take back returns when its lease ends."""
        try:
            self.client.release(self._me(), claim, timeout_s=RELEASE_TIMEOUT_S)
            log.info("handed trial %s back to the queue", claim.trial_id)
        except LeaseLost:
            pass
        except (ApiError, httpx.TransportError) as e:
            log.warning("trial %s not handed back (%s): it returns to the queue when its lease ends", claim.trial_id, e)

    def _measure_and_report(self, claim: ClaimPublic) -> None:
        worker, trial_id = self._me(), claim.trial_id
        renewer = _LeaseRenewer(client=self.client, worker=worker, claim=claim)
        renewer.start()
        try:
            report = self._measure(claim)
        finally:
            renewer.stop()
        try:
            try:
                self._retrying(lambda: self.client.report(worker, claim, **report))
            except RequestRejected as e:
                if "measurements" not in report or e.status != httpx.codes.UNPROCESSABLE_ENTITY:
                    raise
                log.error("result of trial %s refused as impossible, reported as its failure: %s", trial_id, e)
                failure = f"result refused by the controller: {e}"
                self._retrying(lambda: self.client.report(worker, claim, failure=failure))
        except LeaseLost as e:
            log.warning("result of trial %s dropped: %s", trial_id, e)
        except ApiError as e:
            log.error("result of trial %s refused: %s", trial_id, e)

    def _measure(self, claim: ClaimPublic) -> dict[str, Any]:
        """``{"measurements": [...]}`` or ``{"failure": reason}``: every outcome of a trial is reported."""
        try:
            shape = ModelShape(**claim.shape)
            slot = Slot(claim.slot)
            proposal = claim.proposal.to_proposal()
            measurements = self._runtime_for(shape.tp).measure_many(
                shape,
                slot,
                list(proposal.configs),
                repeats=proposal.repeats,
                warmup=self.options.warmup,
                rounds=proposal.rounds,
                baselines=proposal.baselines,
            )
        except TrialFailure as e:
            return {"failure": e.reason}
        except (InputError, ValueError) as e:
            return {"failure": f"rejected by the runtime: {e}"}
        except Exception as e:  # a worker bug must cost one trial, never the worker
            log.exception("trial %s failed unexpectedly", claim.trial_id)
            return {"failure": f"worker error: {type(e).__name__}: {e}"}
        return {"measurements": [m.to_dict() for m in measurements]}

    def _runtime_for(self, tp: int) -> Runtime:
        if self._runtime is not None and self._runtime.tp != tp:
            self._runtime.close()
            self._runtime = None
        if self._runtime is None:
            self._runtime = open_runtime(
                tp=tp, backend=self.options.backend, trial_timeout_s=self.options.trial_timeout_s
            )
        return self._runtime

    def _retrying(self, call: Any) -> Any:
        """``call()``, retried with back-off while the controller is unreachable or overloaded (5xx), until the
        worker has been idle longer than ``exit_when_idle_s``: then the last error is raised."""
        delay = 0.2
        while True:
            try:
                return call()
            except httpx.TransportError as e:
                if self._idle_expired():
                    raise
                reason = f"controller unreachable: {e}"
            except ApiError as e:
                if e.status < 500 or self._idle_expired():
                    raise
                reason = str(e)
            if self.stop.is_set():
                raise InterruptedError("worker stopping")
            log.warning("%s; retrying in %.1f s", reason, delay)
            self.stop.wait(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)


class _LeaseRenewer:
    """Renews one trial's lease every third of the lease until stopped or the lease is lost."""

    def __init__(self, *, client: Client, worker: WorkerCreated, claim: ClaimPublic) -> None:
        self._client = client
        self._worker = worker
        self._claim = claim
        self._trial_id = claim.trial_id
        self._every_s = max(0.1, claim.lease_s / 3)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{claim.trial_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(self._every_s):
            try:
                self._client.renew(self._worker, self._claim)
            except LeaseLost as e:
                log.warning("lost the lease of trial %s: %s", self._trial_id, e)
                return
            except (ApiError, httpx.TransportError) as e:
                log.warning("lease renewal of trial %s failed, retrying: %s", self._trial_id, e)


def run_worker(*, controller: str, token: str | None, options: WorkerOptions) -> None:
    """The `autotune worker` command's body: one client, one loop, until interrupted; ``token`` is what it
    registers with (the worker token, or the clients' token for a controller without one)."""
    with Client(controller, token=token) as client:
        WorkerLoop(client=client, options=options).run()
