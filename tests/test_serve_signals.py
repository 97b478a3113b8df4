"""`autotune serve --local-worker` never leaves its worker behind: SIGTERM stops both (exit 0, as Ctrl-C does),
and a controller killed outright (SIGKILL, no clean-up of its own) takes its worker down too.

Real processes: the controller is `autotune serve` on a fresh SQLite file, its worker the process it starts.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import storage

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service

STOP_TIMEOUT_S = 30.0


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited: no such process, or a zombie nobody has reaped yet."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def serve_with_local_worker(make_service: Callable[..., Service], tmp_path: Path) -> tuple[Service, int]:
    """A controller with its local CPU worker registered; the worker's pid."""
    service = make_service(db_url=f"sqlite:///{tmp_path / 'autotune.db'}")
    service.start_controller(extra=["--local-worker", "--backend", "cpu"])
    assert service.controller is not None
    with service.client() as client:
        service.wait_until(lambda: client.workers(), timeout_s=60, what="the local worker to register")
    (worker,) = children(service.controller.process.pid)
    return service, worker


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker through Linux's /proc")
def test_sigterm_to_serve_stops_its_local_worker_too(make_service: Callable[..., Service], tmp_path: Path) -> None:
    service, worker = serve_with_local_worker(make_service, tmp_path)
    assert service.controller is not None
    os.kill(service.controller.process.pid, signal.SIGTERM)  # the controller alone, not its process group
    assert service.controller.process.wait(STOP_TIMEOUT_S) == 0  # a clean shutdown, as after Ctrl-C
    service.wait_until(lambda: gone(worker), timeout_s=STOP_TIMEOUT_S, what=f"the local worker {worker} to exit")
    # The worker went first, while the API still answered: the next serve shows it stopped, not lost.
    engine = storage.create_engine_for(url=service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            assert [w.status for w in storage.list_workers(session=session)] == [storage.WorkerStatus.STOPPED]
    finally:
        engine.dispose()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker through Linux's /proc")
def test_a_killed_serve_takes_its_local_worker_down(make_service: Callable[..., Service], tmp_path: Path) -> None:
    service, worker = serve_with_local_worker(make_service, tmp_path)
    assert service.controller is not None
    os.kill(service.controller.process.pid, signal.SIGKILL)  # no finally runs: the worker must notice by itself
    service.controller.process.wait(STOP_TIMEOUT_S)
    service.wait_until(lambda: gone(worker), timeout_s=STOP_TIMEOUT_S, what=f"the orphaned worker {worker} to exit")
