"""How a worker ends, as real processes against a real controller: killed (its ranks go with it), stopped
(its trial goes back to the queue at once), or done (``--exit-when-idle``, ``--max-jobs``: exit 0, the end of
a Slurm array task or a Kubernetes Job).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from overlap_runtime.errors import LeaseLost
from overlap_runtime.shape import ModelShape

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest_service import Proc, Service

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the rank processes through Linux's /proc"),
]
pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, db_url

TINY_SHAPE = ModelShape(hidden=64, tp=2, seq=32)
BUSY_SHAPE = ModelShape(hidden=512, tp=2, seq=1024)
"""Trials of seconds on the CPU backend: long enough to be stopped in the middle of one."""
LONG_LEASE = {"AUTOTUNE_LEASE_S": "60"}
"""A lease that a loaded machine's late renewals never lose: the trial stays the worker's until it is stopped."""
RANKS_GONE_S = 2.0


def session_members(sid: int) -> list[int]:
    """Live processes (not zombies) of session ``sid``: a worker started in its own session and all it started."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def running_trial(service: Service, job_id: str) -> bool:
    with service.client() as client:
        return any(t.state == "running" for t in client.all_trials(job_id))


def started_worker_with_a_running_trial(service: Service, *, extra: list[str] = ()) -> tuple[int, str]:
    """A CPU worker measuring a trial of a busy job now, once its ranks are up; (worker pid, job id)."""
    service.start_controller()
    worker = service.start_worker(extra=list(extra))
    with service.client() as client:
        job_id = client.submit(shape=BUSY_SHAPE, layers=["qkv_fprop"], n_trials=4, backend="cpu").id
    pid = worker.process.pid
    service.wait_until(lambda: len(session_members(pid)) >= 3, timeout_s=120, what="the worker's rank processes")
    service.wait_until(lambda: running_trial(service, job_id), timeout_s=120, what="a trial to run")
    return pid, job_id


def tiny_job_done(service: Service, *, worker_flags: list[str]) -> tuple[Service, Proc, str]:
    """A controller and one worker started with ``worker_flags`` that ran a tiny job to success."""
    service.start_controller()
    worker = service.start_worker(extra=worker_flags)
    with service.client() as client:
        job_id = client.submit(shape=TINY_SHAPE, layers=["qkv_fprop"], n_trials=3, backend="cpu").id
    assert service.wait_for_job(job_id).status == "succeeded"
    return service, worker, job_id


def test_kill_9_of_a_worker_takes_its_ranks_within_2_s_and_prints_no_traceback(
    make_service: Callable[..., Service], sqlite_url: str
) -> None:
    service = make_service(db_url=sqlite_url, env=LONG_LEASE)
    pid, _ = started_worker_with_a_running_trial(service)
    worker = service.workers[0]
    assert len(session_members(pid)) >= 3  # the worker, its two ranks (and multiprocessing's resource tracker)
    os.kill(pid, signal.SIGKILL)  # the worker alone, not its process group: the ranks must notice by themselves
    worker.process.wait(5)
    killed = time.monotonic()
    service.wait_until(
        lambda: not session_members(pid), timeout_s=RANKS_GONE_S, what=f"every process of worker {pid} to end"
    )
    time.sleep(1.0)  # anything a dying rank would print has been written by now
    log = worker.log.read_text(errors="replace")
    assert "Traceback" not in log and "Error" not in log, log[-3000:]
    assert time.monotonic() - killed < RANKS_GONE_S + 1.5


def test_sigterm_hands_the_running_trial_back_at_once_and_ends_the_ranks(
    make_service: Callable[..., Service], sqlite_url: str
) -> None:
    """The lease (60 s) would keep the trial from every other worker for a minute; SIGTERM gives it back."""
    service = make_service(db_url=sqlite_url, env=LONG_LEASE)
    pid, job_id = started_worker_with_a_running_trial(service, extra=["--log-level", "info"])
    worker = service.workers[0]
    with service.client() as client:
        (trial,) = [t for t in client.all_trials(job_id) if t.state == "running"]
        os.kill(pid, signal.SIGTERM)
        assert worker.process.wait(30) == 130  # interrupted, as docs/cli.md says
        service.wait_until(lambda: not session_members(pid), timeout_s=RANKS_GONE_S, what="the ranks to end")
        again = next(t for t in client.all_trials(job_id) if t.id == trial.id)
        assert again.state == "waiting" and again.worker_id is None, again
    assert f"handed trial {trial.id} back to the queue" in worker.log.read_text()


def test_exit_when_idle_exits_0_after_the_job_and_a_dead_controller_exits_1(
    make_service: Callable[..., Service], sqlite_url: str
) -> None:
    service, worker, _ = tiny_job_done(make_service(db_url=sqlite_url), worker_flags=["--exit-when-idle", "3"])
    assert worker.process.wait(60) == 0, worker.tail()

    assert service.controller is not None
    service.controller.stop()
    orphan = service.start_worker(extra=["--exit-when-idle", "2"])
    assert orphan.process.wait(60) == 1, orphan.tail()
    assert "error: controller: cannot reach" in orphan.tail()


def test_max_jobs_exits_0_once_that_many_of_its_jobs_have_ended(
    make_service: Callable[..., Service], sqlite_url: str
) -> None:
    service, worker, job_id = tiny_job_done(make_service(db_url=sqlite_url), worker_flags=["--max-jobs", "1"])
    assert worker.process.wait(30) == 0, worker.tail()
    with service.client() as client:
        assert all(t.worker_id is not None for t in client.all_trials(job_id))


def test_a_released_trial_waits_again_for_any_worker_and_only_its_holder_may_release_it(
    make_service: Callable[..., Service], db_url: str
) -> None:
    """``POST .../release`` on SQLite and PostgreSQL: the holder's release puts the trial back at once, the
    next claim (by another worker) gets that very trial, and a release by anyone else, or a second one, is
    the 409 of a lease not held."""
    service = make_service(db_url=db_url)
    service.start_controller()
    with service.client() as client:
        holder = client.register({"name": "holder", "host": "h", "backend": "cpu"})
        other = client.register({"name": "other", "host": "h", "backend": "cpu"})
        client.submit(shape=TINY_SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cpu")
        claim = service.wait_until(lambda: client.claim(holder), timeout_s=30, what="a claim")
        with pytest.raises(LeaseLost, match="leased to worker"):
            client.release(other, claim)  # with the right nonce, but not the holder
        released = client.release(holder, claim)
        assert (released.id, released.state) == (claim.trial_id, "waiting")
        with pytest.raises(LeaseLost, match="it is waiting"):
            client.release(holder, claim)
        again = client.claim(other)
        assert again is not None and again.trial_id == claim.trial_id and again.lease_nonce != claim.lease_nonce
