"""Real processes for the service tests: a controller (`autotune serve`) and CPU-backend workers
(`autotune worker`), each a process of its own (forked by `zygote`) on a free loopback port, stopped (or
killed) by the test.

Test modules load this file with ``pytest_plugins = ("conftest_service",)`` (which loads the storage suite's
``conftest_storage`` the same way, for ``sqlite_url`` / ``postgres_url``) and never import it, so pytest can
rewrite its asserts.

Short leases (trials' and the scheduler's), heartbeats and scheduler passes keep the tests fast; each process
gets its own data folder (``XDG_DATA_HOME``) so no test touches the user's default database or token file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from ports import free_port
from zygote import Zygote

from api.schemas import JobPublic
from autotune.cli.rest_client import Client

if TYPE_CHECKING:
    from click.testing import Result

pytest_plugins = ("conftest_storage",)  # the database URL fixtures, for the tests that load this one

TOKEN = "test-token"
WORKER_TOKEN = "test-worker-token"
"""What `worker_token_service` registers workers with (``--worker-token``)."""
FAST_ENV = {
    "AUTOTUNE_LEASE_S": "3",
    "AUTOTUNE_HEARTBEAT_TIMEOUT_S": "5",
    # Requests wake the scheduler at once; the interval bounds only how late a lapsed lease or a lost worker is
    # seen. At 0.1 s the passes of the idle controllers cost more CPU than some test files, and at 0.5 s a
    # loaded machine's late passes let the 3 s leader lease lapse now and then.
    "AUTOTUNE_SCHEDULER_INTERVAL_S": "0.25",
    "AUTOTUNE_LEADER_TTL_S": "3",
}
CLI_HEARTBEAT_TIMEOUT_S = 600
"""`cpu_service`'s heartbeat timeout: longer than any stall of a worker on a loaded machine."""
START_TIMEOUT_S = 60.0


def wait_until(check: Callable[[], Any], *, timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """Poll ``check()`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


class Proc:
    """An ``autotune`` process (forked by the pytest process's `Zygote`) in its own session, so kill -9 takes
    its TP group's rank processes along."""

    def __init__(self, zygote: Zygote, args: list[str], *, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.process = zygote.start(args, env=env, log=log)

    def kill9(self) -> None:
        """SIGKILL the process and everything it started: a machine that died."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL whatever is left of its session."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


class Service:
    """A controller on one database plus its workers; `url` stays the same across controller restarts."""

    def __init__(self, zygote: Zygote, *, db_url: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.zygote = zygote
        self.db_url = db_url
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = TOKEN
        self.worker_token = WORKER_TOKEN
        """Only a controller started with ``--worker-token`` takes it (`worker_token_service`)."""
        self.env = {**os.environ, **FAST_ENV, "XDG_DATA_HOME": str(tmp / "data"), **(env or {})}
        for name in ("AUTOTUNE_TOKEN", "AUTOTUNE_WORKER_TOKEN"):
            self.env.pop(name, None)
        self.controller: Proc | None = None
        self.workers: list[Proc] = []

    def start_controller(self, *, extra: list[str] = ()) -> None:
        args = ["serve", "--db", self.db_url, "--port", str(self.port), "--token", TOKEN, "--log-level", "warning"]
        args += extra
        self.controller = Proc(self.zygote, args, env=self.env, log=self.tmp / "controller.log")
        wait_until(self._healthy, timeout_s=START_TIMEOUT_S, what=f"the controller at {self.url}")

    def start_worker(self, *, extra: list[str] = (), auth: tuple[str, ...] = ("--token", TOKEN)) -> Proc:
        """A CPU worker; ``auth``: the flags it registers with (the clients' token unless told otherwise)."""
        index = len(self.workers)
        args = ["worker", "--controller", self.url, "--backend", "cpu", *auth, "--name", f"w{index}"]
        args += ["--poll-s", "0.2", "--heartbeat-s", "1", "--log-level", "warning", *extra]
        worker = Proc(self.zygote, args, env=self.env, log=self.tmp / f"worker{index}.log")
        self.workers.append(worker)
        return worker

    def client(self, *, token: str | None = TOKEN) -> Client:
        return Client(self.url, token=token, timeout_s=10)

    def cli(self, *args: str) -> Result:
        """``autotune ARGS`` run in-process (typer's runner, the console script's own app) as a user of this
        controller runs it: its URL, the clients' token and this service's data folder, none of the caller's
        other AUTOTUNE_* settings.  The exit code, stdout and stderr come apart."""
        from typer.testing import CliRunner

        from autotune.cli.app import app

        unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("AUTOTUNE_")}
        own = {
            "AUTOTUNE_CONTROLLER": self.url,
            "AUTOTUNE_TOKEN": self.token,
            "XDG_DATA_HOME": self.env["XDG_DATA_HOME"],
        }
        return CliRunner().invoke(app, list(args), env=unset | own)

    def health(self) -> dict[str, Any] | None:
        """``GET /healthz`` of whichever controller process answers; None while none does."""
        if self.controller is not None and self.controller.process.poll() is not None:
            pytest.fail(f"controller exited:\n{self.controller.tail()}")
        try:
            response = httpx.get(f"{self.url}/healthz", timeout=1)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def _healthy(self) -> bool:
        return self.health() is not None

    def wait_until(self, check: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
        return wait_until(check, timeout_s=timeout_s, what=what)

    def wait_for_job(self, job_id: str, *, timeout_s: float = 120.0) -> JobPublic:
        """Poll the job until it ends; fail with the process logs if it does not."""
        with self.client() as client:

            def ended() -> JobPublic | None:
                job = client.job(job_id)
                return job if job.status in ("succeeded", "failed", "cancelled") else None

            try:
                return wait_until(ended, timeout_s=timeout_s, what=f"job {job_id} to end", every_s=0.5)
            except pytest.fail.Exception:
                logs = "\n".join(f"--- {p.log.name}\n{p.tail()}" for p in [self.controller, *self.workers] if p)
                pytest.fail(f"job {job_id} did not end: {client.job(job_id)}\n{logs}")

    def stop(self) -> None:
        """Stop everything at once (each process closes its TP group, which takes a moment)."""
        procs = [p for p in [*self.workers, self.controller] if p is not None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.stop()


def module_controller(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    env: dict[str, str] | None = None,
    extra: list[str] = (),
) -> Iterator[Service]:
    """A controller that the tests of one module share (a controller start costs seconds of CPU), on the
    module's database of the kind ``request.param`` names ("sqlite" or "postgres"): for a module-scoped fixture
    parametrized over both to ``yield from``."""
    tmp = tmp_path_factory.mktemp(f"{request.module.__name__}_{request.param}")
    db_url = request.getfixturevalue(f"module_{request.param}_url")
    service = Service(request.getfixturevalue("zygote"), db_url=db_url, tmp=tmp, env=env)
    service.start_controller(extra=extra)
    yield service
    service.stop()


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """The process that forks this pytest process's controllers and workers (`zygote`)."""
    started = Zygote()
    yield started
    started.close()


@pytest.fixture
def make_service(zygote: Zygote, tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """Services started by the test, all stopped at its end (even when it fails)."""
    started: list[Service] = []

    def make(*, db_url: str, env: dict[str, str] | None = None) -> Service:
        service = Service(zygote, db_url=db_url, tmp=tmp_path / f"service{len(started)}", env=env)
        service.tmp.mkdir()
        started.append(service)
        return service

    yield make
    for service in started:
        service.stop()


@pytest.fixture(scope="module")
def idle_service(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A controller on a fresh SQLite file with no workers: its jobs are never measured (API tests)."""
    tmp = tmp_path_factory.mktemp("idle")
    service = Service(zygote, db_url=f"sqlite:///{tmp / 'autotune.db'}", tmp=tmp)
    service.start_controller()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def worker_token_service(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A controller with a worker token of its own (clients and workers hold different credentials), no workers."""
    tmp = tmp_path_factory.mktemp("worker_token")
    service = Service(zygote, db_url=f"sqlite:///{tmp / 'autotune.db'}", tmp=tmp)
    service.start_controller(extra=["--worker-token", WORKER_TOKEN])
    yield service
    service.stop()


@pytest.fixture(scope="module")
def cpu_service(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A controller on a fresh SQLite file with one CPU-backend worker (CLI tests).

    The CLI tests assert what the fleet is ("registered: w0 (cpu)"), never that a worker is lost, so the
    controller waits `CLI_HEARTBEAT_TIMEOUT_S` for a heartbeat: with `FAST_ENV`'s 5 s a worker stalled for
    longer (busy importing torch for a trial on a loaded machine) missed its 1 s heartbeats, was marked
    lost, and the fleet read "none"."""
    tmp = tmp_path_factory.mktemp("cpu")
    env = {"AUTOTUNE_HEARTBEAT_TIMEOUT_S": str(CLI_HEARTBEAT_TIMEOUT_S)}
    service = Service(zygote, db_url=f"sqlite:///{tmp / 'autotune.db'}", tmp=tmp, env=env)
    service.start_controller()
    service.start_worker()
    with service.client() as client:  # registered before the first test: some assert what the workers are
        service.wait_until(client.workers, timeout_s=START_TIMEOUT_S, what="the CPU worker's registration")
    yield service
    service.stop()
