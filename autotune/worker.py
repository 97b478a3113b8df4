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
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import httpx

from api.schemas import ClaimPublic, WorkerCreated
from autotune.client import ApiError, Client, RequestRejected
from autotune.inventory import worker_body
from overlap_runtime.errors import InputError, LeaseLost, TrialFailure
from overlap_runtime.runtime import Runtime, open_runtime
from overlap_runtime.shape import ModelShape, Slot

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
FORGOTTEN = (httpx.codes.NOT_FOUND, httpx.codes.UNAUTHORIZED)
"""Answers to a worker call that mean "register again": the controller does not know this worker or its secret."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    backend: str
    """cpu (gloo ranks), cuda (one GPU per rank) or te (one GPU per rank, measured through TE)."""
    name: str | None = None
    """Shown on the dashboard; host-pid when None."""
    poll_s: float = 1.0
    """Pause after a claim found nothing."""
    heartbeat_s: float = 10.0
    trial_timeout_s: float = 180.0
    """Per config and round: a group that takes longer is killed and the trial reported as hung."""
    warmup: int = 5


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

    def run(self) -> None:
        """Work until stopped; always closes the TP group on the way out."""
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        try:
            self._register()
            heartbeats.start()
            while not self.stop.is_set():
                if self._reregister.is_set():
                    self._register()
                claim = self._claim()
                if claim is None:
                    self.stop.wait(self.options.poll_s)
                    continue
                self._run_trial(claim)
        except InterruptedError:
            log.info("worker stopped")
        finally:
            self.stop.set()
            if self._runtime is not None:
                self._runtime.close()

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
        """``call()``, retried with back-off while the controller is unreachable or overloaded (5xx)."""
        delay = 0.2
        while True:
            try:
                return call()
            except httpx.TransportError as e:
                reason = f"controller unreachable: {e}"
            except ApiError as e:
                if e.status < 500:
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
