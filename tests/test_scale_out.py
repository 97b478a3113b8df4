"""Several controller processes on one database, as real processes: `autotune serve --workers 2` on SQLite,
and two controllers on PostgreSQL of which the scheduling one is killed.

Whatever the number of processes, exactly one schedules (holds the scheduler lease); a killed holder is
replaced within the lease's TTL (3 s here, `conftest_service.FAST_ENV`) and the job still succeeds; a
controller started with ``AUTOTUNE_SCHEDULER=false`` never schedules.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import storage
from overlap_runtime.shape import ModelShape
from storage import SCHEDULER, LeaderLease

if TYPE_CHECKING:
    from conftest_service import Service

pytestmark = pytest.mark.slow
pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, postgres_url

TINY_SHAPE = ModelShape(hidden=64, tp=2, seq=32)
LEADER_TTL_S = 3.0
"""``AUTOTUNE_LEADER_TTL_S`` of the test controllers."""
TAKE_OVER_SLACK_S = 3.0
"""Beyond the TTL: the standby's next pass, plus a busy 2-core machine's delays."""
LEADS = "holds the scheduler role"
"""What a process logs (at info) each time it takes the lease."""


def submit_tiny_job(service: Service, *, n_trials: int = 3) -> str:
    with service.client() as client:
        job = client.submit(shape=TINY_SHAPE, layers=["qkv_fprop", "proj_fprop"], n_trials=n_trials, backend="cpu")
        return job.id


def lease_of(service: Service) -> LeaderLease | None:
    """The live scheduler lease, read from the database itself."""
    engine = storage.create_engine_for(url=service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            return storage.get_leader(session=session, name=SCHEDULER)
    finally:
        engine.dispose()


def api_processes(parent_pid: int) -> set[int]:
    """The uvicorn worker processes under ``parent_pid`` (multiprocessing spawns them with ``spawn_main``)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        if ppid == parent_pid and b"spawn_main" in cmdline:
            pids.add(int(stat.parent.name))
    return pids


def pid_of(holder: str) -> int:
    """The pid inside a lease holder's name, ``host:pid:random``."""
    return int(holder.rsplit(":", 2)[1])


def test_serve_with_two_api_processes_runs_a_job_with_exactly_one_scheduling(make_service, sqlite_url: str) -> None:
    # The lease of production (10 s), not the tests' 3 s: this checks that one process schedules, and on a loaded
    # machine a 3 s lease can run out between two renewals and pass to the other process, as it is meant to.
    service = make_service(db_url=sqlite_url, env={"AUTOTUNE_LEADER_TTL_S": "10"})
    service.start_controller(extra=["--workers", "2", "--log-level", "info"])
    assert service.controller is not None
    serve_pid = service.controller.process.pid

    def two_api_processes() -> set[int] | None:
        pids = api_processes(serve_pid)
        return pids if len(pids) == 2 else None

    processes = service.wait_until(two_api_processes, timeout_s=60, what="two API processes")
    service.start_worker()
    job_id = submit_tiny_job(service)
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    lease = lease_of(service)
    assert lease is not None, "nobody holds the scheduler lease"
    assert pid_of(lease.holder) in processes, (lease.holder, processes)
    assert lease.term == 1, "the lease changed hands: more than one process scheduled"
    assert service.controller.log.read_text().count(LEADS) == 1, service.controller.tail()
    health = service.health()
    assert health is not None and health["leader"] == lease.holder
    with service.client() as client:
        assert len(client.workers()) == 1


def test_serve_with_two_api_processes_starts_one_local_worker(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller(extra=["--workers", "2", "--local-worker", "--backend", "cpu"])
    with service.client() as client:
        service.wait_until(lambda: client.workers(), timeout_s=60, what="the local worker to register")
        time.sleep(3)  # a worker per API process would have registered by now too: they start together
        (worker,) = client.workers()
    assert worker.backend == "cpu"


def test_a_killed_scheduling_controller_is_replaced_within_the_ttl(make_service, postgres_url: str) -> None:
    first, second = make_service(db_url=postgres_url), make_service(db_url=postgres_url)
    first.start_controller()
    second.start_controller()
    leader = first.wait_until(lambda: lease_of(first), timeout_s=30, what="a scheduler lease")
    scheduling, standing_by = (first, second) if first.health()["leading"] else (second, first)
    assert not standing_by.health()["leading"]
    assert standing_by.health()["leader"] == leader.holder
    standing_by.start_worker()
    job_id = submit_tiny_job(standing_by, n_trials=4)
    with standing_by.client() as client:
        standing_by.wait_until(
            lambda: sum(t.state == "complete" for t in client.all_trials(job_id)) >= 2,
            timeout_s=90,
            what="two complete trials",
        )
    assert scheduling.controller is not None
    scheduling.controller.kill9()
    killed = time.monotonic()
    standing_by.wait_until(
        lambda: standing_by.health()["leading"],
        timeout_s=LEADER_TTL_S + TAKE_OVER_SLACK_S,
        what="the standby to take the scheduler lease over",
    )
    assert time.monotonic() - killed <= LEADER_TTL_S + TAKE_OVER_SLACK_S
    job = standing_by.wait_for_job(job_id)
    assert job.status == "succeeded", job
    lease = lease_of(standing_by)
    # A later term than the killed holder's, not exactly the next: on a loaded machine the new holder's passes
    # can run late enough that its own lease lapses and it takes it back, which counts as a new term.
    assert lease is not None and lease.term > leader.term and lease.holder != leader.holder


def test_a_controller_without_the_scheduler_never_takes_the_lease(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url, env={"AUTOTUNE_SCHEDULER": "false"})
    service.start_controller()
    time.sleep(2 * LEADER_TTL_S / 3)  # dozens of passes, had it run any
    health = service.health()
    assert health is not None
    assert (health["scheduler"], health["leading"], health["leader"]) == (False, False, None)
    assert lease_of(service) is None
