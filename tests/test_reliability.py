"""What broke when the service was tried as a careful user and an attacker would (issue 21), against a real
controller (uvicorn in a subprocess) on real SQLite and PostgreSQL: bodies with non-finite numbers and lone
surrogates, forged worker reports and impossible results, event-stream floods, jobs no worker can run, a
database that fails, and the files and pages a controller serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from overlap_runtime.shape import ModelShape

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service, make_service

SHAPE = {"hidden": 64, "tp": 2, "mbs": 1, "seq": 32}
SHAPE_MODEL = ModelShape(**SHAPE)
NASTY_VALUES = ("NaN", "Infinity", "-Infinity", '"\\ud800"', '"a\\udfffb"')
"""JSON text Python's parser takes but strict JSON and every database driver refuse."""


@pytest.fixture(scope="module")
def http(idle_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=idle_service.url, headers={"Authorization": f"Bearer {idle_service.token}"}) as client:
        yield client


def raw(http: httpx.Client, path: str, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json", **(headers or {})})


def errors_of(response: httpx.Response) -> list[dict[str, Any]]:
    """The error items of a strict-JSON body, after checking each names a field and a rule."""
    detail = json.loads(response.text)["detail"]  # json.loads accepts NaN, so check the text too
    assert "NaN" not in response.text.replace('"NaN"', "") and "Infinity" not in response.text.replace(
        '"Infinity"', ""
    ).replace('"-Infinity"', "")
    assert detail and all(item["field"] and item["rule"] for item in detail), detail
    return detail


# --- item 6: non-finite numbers and lone surrogates are a 422, never a 500 ----------------------------------


JOB_TEMPLATES = (
    '{"shape": {"hidden": %s, "tp": 2, "seq": 32}}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "n_trials": %s}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "layers": [%s]}',
    '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "gpu": %s}',
)
KEY_TEMPLATE = '{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "measure_first": {%s: []}}'
"""An object key is always a string: only the surrogates go there."""
JOB_BODIES = [t % v for t in JOB_TEMPLATES for v in NASTY_VALUES] + [
    KEY_TEMPLATE % v for v in NASTY_VALUES if v.startswith('"')
]


@pytest.mark.parametrize("body", JOB_BODIES)
def test_a_job_body_with_a_non_finite_number_or_lone_surrogate_is_a_422(http: httpx.Client, body: str) -> None:
    response = raw(http, "/v1/jobs", body)
    assert response.status_code == 422, response.text
    errors_of(response)


@pytest.mark.parametrize("nasty", NASTY_VALUES)
def test_a_worker_body_with_a_non_finite_number_or_lone_surrogate_is_a_422(http: httpx.Client, nasty: str) -> None:
    for template in ('{"name": %s, "host": "h", "backend": "cpu"}', '{"name": "w", "host": "h", "n_gpus": %s}'):
        response = raw(http, "/v1/workers", template % nasty)
        assert response.status_code == 422, response.text
        errors_of(response)


# --- item 2: a worker speaks with its own secret, on its own lease, with results physics allows -----------

MEASUREMENT = {
    "gemm_ms": 0.2676,
    "comm_ms": 0.0924,
    "serial_ms": 0.3599,
    "overlap_ms": 0.2794,
    "rel_err": 0.0,
    "cv": 0.002,
    "repeats": 3,
    "valid": True,
    "samples": [0.2801, 0.2794, 0.2787],
    "exposed_ms": 0.0118,
    "hidden_frac": 0.8723,
}
"""A plausible measurement: the overlapped op takes a little longer than its GEMM alone."""


def test_only_the_worker_holding_a_lease_with_its_nonce_may_report_on_it(make_service, db_url: str) -> None:
    """The attacks of issue 21: with the clients' token and a worker id read from GET /v1/workers, with a
    rogue worker's own secret, and as the holder without its claim's nonce.  None is stored; the holder's
    own report is."""
    service = make_service(db_url=db_url)
    service.start_controller()
    with service.client() as client, httpx.Client(base_url=service.url) as http:
        holder = client.register({"name": "holder", "host": "h", "backend": "cpu"})
        rogue = client.register({"name": "rogue", "host": "h", "backend": "cpu"})
        assert holder.secret != rogue.secret
        assert all("secret" not in w for w in http.get("/v1/workers").json())  # ids are public, secrets not
        job_id = client.submit(shape=SHAPE_MODEL, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        claim = service.wait_until(lambda: client.claim(holder), timeout_s=30, what="a claim")
        result = f"/v1/workers/{holder.id}/trials/{claim.trial_id}/result"
        body = {"measurements": [MEASUREMENT] * len(claim.proposal.configs)}
        nonce = {"X-Lease-Nonce": claim.lease_nonce}

        token = {"Authorization": f"Bearer {service.token}"}
        for headers in ({**token, **nonce}, {**rogue_auth(rogue), **nonce}, nonce):
            forged = http.post(result, json=body, headers=headers)
            assert forged.status_code == 401, forged.text
            assert errors_of(forged)[0]["field"] == "Authorization"
        as_rogue = http.post(
            f"/v1/workers/{rogue.id}/trials/{claim.trial_id}/result", json=body, headers={**rogue_auth(rogue), **nonce}
        )
        assert as_rogue.status_code == 409 and "leased to worker" in errors_of(as_rogue)[0]["rule"]
        stale = http.post(result, json=body, headers={**rogue_auth(holder), "X-Lease-Nonce": "not-the-nonce"})
        assert stale.status_code == 409 and "nonce" in errors_of(stale)[0]["rule"]
        without = http.post(result, json=body, headers=rogue_auth(holder))
        assert without.status_code == 422 and errors_of(without)[0]["field"] == "X-Lease-Nonce"
        assert client.all_trials(job_id)[0].state == "running"

        assert client.report(holder, claim, measurements=body["measurements"]).state == "complete"
        (trial,) = [t for t in client.all_trials(job_id) if t.id == claim.trial_id]
        assert trial.worker_id == holder.id
        assert [{k: m[k] for k in MEASUREMENT} for m in trial.measurement["measurements"]] == body["measurements"]


def rogue_auth(worker: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {worker.secret}"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"overlap_ms": 0.0001, "exposed_ms": 0.0001 - 0.2676, "hidden_frac": 1.9999}, "overlap_ms"),
        ({"hidden_frac": 1.9999}, "hidden_frac"),
        ({"exposed_ms": -0.2}, "exposed_ms"),
        ({"gemm_ms": -1.0}, "gemm_ms"),
        ({"comm_ms": 0.0}, "comm_ms"),
        ({"cv": -0.5}, "cv"),
        ({"samples": [0.28, -1.0]}, "samples.1"),
    ],
)
def test_a_result_no_gpu_could_produce_is_a_422_and_never_stored(
    idle_service: Service, change: dict[str, Any], field: str
) -> None:
    with idle_service.client() as client, httpx.Client(base_url=idle_service.url) as http:
        worker = client.register({"name": "w", "host": "h", "backend": "cpu"})
        job_id = client.submit(shape=SHAPE_MODEL, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        claim = idle_service.wait_until(
            lambda: (c := client.claim(worker)) and c.job_id == job_id and c, timeout_s=30, what="a claim"
        )
        n = len(claim.proposal.configs)
        response = http.post(
            f"/v1/workers/{worker.id}/trials/{claim.trial_id}/result",
            json={"measurements": [MEASUREMENT] * (n - 1) + [{**MEASUREMENT, **change}]},
            headers={**rogue_auth(worker), "X-Lease-Nonce": claim.lease_nonce},
        )
        assert response.status_code == 422, response.text
        assert errors_of(response)[0]["field"] == f"measurements.{n - 1}.{field}"
        (trial,) = [t for t in client.all_trials(job_id) if t.id == claim.trial_id]
        assert trial.state == "running" and trial.measurement is None
        client.cancel(job_id)


# --- item 1: open event streams hold no database connection, and their number is bounded ------------------

STREAMS = 60
"""More than the pool's 5 + 10 connections, and past the ~25 streams that froze the controller."""


async def follow(client: httpx.AsyncClient, job_id: str, opened: asyncio.Event, counter: list[int]) -> list[str]:
    """The events of one stream until it ends; ``counter[0]`` counts streams that got their first event."""
    events: list[str] = []
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                events.append(line[6:].strip())
                if len(events) == 1:
                    counter[0] += 1
                    if counter[0] == STREAMS:
                        opened.set()
    return events


def test_many_open_event_streams_leave_the_controller_answering_and_all_hear_the_change(
    idle_service: Service, http: httpx.Client
) -> None:
    job_id = http.post("/v1/jobs", json={"shape": SHAPE, "backend": "cuda"}).json()["id"]

    async def scenario() -> tuple[list[list[str]], list[float]]:
        opened, counter = asyncio.Event(), [0]
        limits = httpx.Limits(max_connections=STREAMS + 10)
        async with httpx.AsyncClient(base_url=idle_service.url, timeout=30, limits=limits) as client:
            streams = [asyncio.create_task(follow(client, job_id, opened, counter)) for _ in range(STREAMS)]
            await asyncio.wait_for(opened.wait(), 60)
            latencies = []
            for _ in range(10):  # while every stream waits: health, a read, a write (the pool is free)
                start = time.perf_counter()
                assert (await client.get("/healthz")).status_code == 200
                assert (await client.get(f"/v1/jobs/{job_id}")).status_code == 200
                latencies.append(time.perf_counter() - start)
            cancel = await client.post(f"/v1/jobs/{job_id}/cancel", headers=http.headers)
            assert cancel.status_code == 200, cancel.text
            return await asyncio.wait_for(asyncio.gather(*streams), 30), latencies

    events, latencies = asyncio.run(scenario())
    assert max(latencies) < 2.0, latencies
    assert all(e[0] == "progress" and e[-2:] == ["progress", "done"] for e in events), events[:3]


def test_an_event_stream_past_the_bound_is_a_503_with_retry_after(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url, env={"AUTOTUNE_MAX_STREAMS": "3"})
    service.start_controller()
    with service.client() as client:
        job_id = client.submit(shape=SHAPE_MODEL, backend="cuda").id

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as client:
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(3):
                    response = await stack.enter_async_context(client.stream("GET", f"/v1/jobs/{job_id}/events"))
                    assert response.status_code == 200
                refused = await client.get(f"/v1/jobs/{job_id}/events")
                assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
                assert errors_of(refused)[0]["field"] == "events"
                assert (await client.get("/healthz")).status_code == 200
            await asyncio.sleep(0.5)  # the three closed: their places are free again
            async with client.stream("GET", f"/v1/jobs/{job_id}/events") as again:
                assert again.status_code == 200

    asyncio.run(scenario())


# --- item 4: a job that no registered worker can run says so ------------------------------------------------

H200 = {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "nvlink_active": 18, "sm_count": 132}


def test_a_job_no_worker_can_run_says_why_and_so_does_one_whose_last_worker_died(
    make_service, postgres_url: str
) -> None:
    service = make_service(db_url=postgres_url)
    service.start_controller()
    with service.client() as client:
        job_id = client.submit(shape=SHAPE_MODEL, layers=["qkv_fprop"], n_trials=2, backend="cuda").id
        reason = service.wait_until(lambda: client.job(job_id).waiting_reason, timeout_s=10, what="a reason")
        assert reason.startswith("no registered worker can run it") and "cuda worker with at least 2 GPUs" in reason
        assert reason.endswith("registered: none")

        client.register({"name": "laptop", "host": "h", "backend": "cpu"})
        reason = service.wait_until(
            lambda: "laptop" in (r := client.job(job_id).waiting_reason or "") and r,
            timeout_s=10,
            what="the cpu worker named",
        )
        assert "registered: laptop (cpu)" in reason and client.job(job_id).status == "queued"

        gpu_box = {"name": "gpubox", "host": "node7", "backend": "cuda", "gpus": [H200, H200]}
        worker = client.register({**gpu_box, "gpu_model": "NVIDIA H200", "n_gpus": 2})
        job = service.wait_until(
            lambda: (j := client.job(job_id)).status == "running" and j, timeout_s=30, what="the job to start"
        )
        assert job.waiting_reason is None
        client.heartbeat(worker)  # then silence: the controller marks it lost after its heartbeat timeout
        reason = service.wait_until(
            lambda: client.job(job_id).waiting_reason, timeout_s=30, what="the lost worker to be noticed"
        )
        assert reason.startswith("the last worker that can run it (gpubox on node7) was lost"), reason
        assert client.job(job_id).status == "running"


# --- item 8: a failing database is told in one line now and then, and /healthz tells the truth ------------

QUIET_LINES = 12
"""Log lines a controller may write over a few seconds of failing writes: a handful of one-line warnings."""


def log_of(service: Service) -> str:
    assert service.controller is not None
    return service.controller.log.read_text(errors="replace")


def health(service: Service) -> httpx.Response:
    return httpx.get(f"{service.url}/healthz", timeout=5)


def test_a_read_only_database_is_degraded_in_healthz_and_its_503s_are_one_line_each_while(
    make_service, postgres_url: str, pg_admin: Any
) -> None:
    service = make_service(db_url=postgres_url)
    service.start_controller()
    database = postgres_url.rsplit("/", 1)[1]
    before = len(log_of(service).splitlines())

    def read_only(on: bool) -> None:
        with pg_admin.connect() as conn:
            conn.exec_driver_sql(
                f'ALTER DATABASE "{database}" SET default_transaction_read_only = {"on" if on else "off"}'
            )
            # Pooled connections keep the setting they started with: new ones get the database's.
            conn.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")

    read_only(True)
    degraded = service.wait_until(
        lambda: (r := health(service)).status_code == 503 and r,
        timeout_s=30,
        what="/healthz to see the read-only database",
    )
    assert degraded.json()["status"] == "degraded" and not degraded.json()["writable"]
    assert degraded.json()["problem"] == "writes fail: the database is read-only"
    with (
        service.client() as client,
        httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as http,
    ):
        for _ in range(20):
            refused = http.post("/v1/jobs", json={"shape": SHAPE, "backend": "cpu"})
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        assert errors_of(refused)[0]["rule"] == "is unavailable (the database is read-only); retry later"
        time.sleep(3)  # 30 scheduler passes, each failing to renew its lease
        lines = log_of(service).splitlines()[before:]
        assert "Traceback" not in "\n".join(lines) and len(lines) <= QUIET_LINES, "\n".join(lines)

        read_only(False)
        service.wait_until(lambda: health(service).status_code == 200, timeout_s=30, what="/healthz to recover")
        assert health(service).json()["status"] == "ok"
        assert client.submit(shape=SHAPE_MODEL, backend="cpu").status == "queued"


class Outage:
    """A TCP forwarder between the controller and PostgreSQL that the test can cut: a database that stops
    answering, without stopping the server the other tests share."""

    def __init__(self, *, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        self.up = False
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        self.conns.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_database_outage_answers_503s_that_hide_its_address_and_logs_no_traceback_storm(
    make_service, postgres_url: str
) -> None:
    outage = Outage(target_port=5432)
    try:
        service = make_service(db_url=postgres_url.replace(":5432/", f":{outage.port}/"))
        service.start_controller()
        before = len(log_of(service).splitlines())
        outage.cut()
        with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as http:
            answers = [http.post("/v1/jobs", json={"shape": SHAPE, "backend": "cpu"}) for _ in range(10)]
            answers += [http.get("/v1/jobs") for _ in range(10)]
            assert {a.status_code for a in answers} == {503}
            for answer in answers:
                assert str(outage.port) not in answer.text and "127.0.0.1" not in answer.text, answer.text
            assert errors_of(answers[0])[0]["rule"] == "is unavailable (the database does not answer); retry later"
            assert health(service).status_code == 503
            time.sleep(3)
            lines = log_of(service).splitlines()[before:]
            assert "Traceback" not in "\n".join(lines) and len(lines) <= QUIET_LINES, "\n".join(lines)
            outage.restore()
            service.wait_until(lambda: health(service).status_code == 200, timeout_s=30, what="/healthz to recover")
            assert http.post("/v1/jobs", json={"shape": SHAPE, "backend": "cpu"}).status_code == 202
    finally:
        outage.close()


def fill(path: Any) -> None:
    """Append to ``path`` until its file system is full."""
    with path.open("ab") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()


@pytest.fixture
def small_disk(tmp_path: Any) -> Iterator[Any]:
    """A 3 MB tmpfs, unmounted after the test (and after the services on it stopped: requested first)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    assert mounted.returncode == 0, f"the full-disk test mounts a tmpfs, which needs root: {mounted.stderr}"
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_503s_and_degraded_and_the_controller_recovers_once_space_is_freed(
    small_disk: Any, make_service
) -> None:
    service = make_service(db_url=f"sqlite:///{small_disk / 'autotune.db'}")
    service.start_controller()
    filler = small_disk / "filler"
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}) as http:
        big = {"shape": SHAPE, "backend": "cpu", "n_trials": 3}
        fill(filler)
        answers = [http.post("/v1/jobs", json=big) for _ in range(100)]
        assert all(a.status_code in (202, 503) for a in answers)
        refused = [a for a in answers if a.status_code == 503]
        for _ in range(20):  # a failed write gives the WAL's space back (the scheduler's too): fill that again
            fill(filler)
            degraded = health(service)
            if degraded.status_code == 503:
                break
        assert refused and errors_of(refused[0])[0]["rule"] == "is unavailable (the disk is full); retry later"
        assert degraded.status_code == 503 and degraded.json()["problem"] == "writes fail: the disk is full"

        filler.unlink()
        service.wait_until(lambda: health(service).status_code == 200, timeout_s=30, what="/healthz to recover")
        accepted = [http.post("/v1/jobs", json=big).status_code for _ in range(20)]
        assert accepted == [202] * 20
        assert "Traceback" not in log_of(service)


# --- item 9: the database file is private; /docs and /redoc work offline --------------------------------


def test_the_sqlite_database_and_its_wal_are_readable_by_their_user_only(idle_service: Service) -> None:
    path = idle_service.db_url.removeprefix("sqlite:///")
    for name in (path, f"{path}-wal", f"{path}-shm"):
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600, name


@pytest.mark.parametrize(("page", "marker"), [("/docs", "SwaggerUIBundle"), ("/redoc", "<redoc")])
def test_the_api_docs_load_every_script_and_style_from_the_controller(
    http: httpx.Client, page: str, marker: str
) -> None:
    html = http.get(page).text
    assert marker in html and "openapi.json" in html
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("/static/docs/") for a in assets), assets
    for asset in assets:
        response = http.get(asset)
        assert response.status_code == 200 and len(response.content) > 100, asset
    assert "cdn." not in html and "fonts.googleapis" not in html


def test_on_cuda_an_overlapped_op_faster_than_its_collective_alone_is_refused(
    idle_service: Service, http: httpx.Client
) -> None:
    """The collective bounds the overlapped op on GPUs (on cpu only the GEMM does: its methods do not use
    gloo, which the collective baseline times)."""
    box = {"name": "gpubox", "host": "h", "backend": "cuda", "gpus": [H200, H200], "gpu_model": "NVIDIA H200"}
    worker = http.post("/v1/workers", json={**box, "n_gpus": 2}).json()
    job = http.post("/v1/jobs", json={"shape": {**SHAPE, "seq": 96}, "layers": ["qkv_fprop"], "backend": "cuda"})
    mine = {"Authorization": f"Bearer {worker['secret']}"}

    def claimed() -> dict[str, Any] | None:
        response = http.post(f"/v1/workers/{worker['id']}/claim", headers=mine)
        return (
            response.json() if response.status_code == 200 and response.json()["job_id"] == job.json()["id"] else None
        )

    claim = idle_service.wait_until(claimed, timeout_s=30, what="a claim of the cuda job")
    slow_comm = {**MEASUREMENT, "comm_ms": 0.5, "hidden_frac": 1 - 0.0118 / 0.5}  # 0.2794 ms < 0.8 x 0.5 ms
    response = http.post(
        f"/v1/workers/{worker['id']}/trials/{claim['trial_id']}/result",
        json={"measurements": [slow_comm] * len(claim["proposal"]["configs"])},
        headers={**mine, "X-Lease-Nonce": claim["lease_nonce"]},
    )
    assert response.status_code == 422 and errors_of(response)[0]["field"] == "measurements.0.overlap_ms"
    assert "max(gemm_ms, comm_ms)" in errors_of(response)[0]["rule"]
    http.post(f"/v1/jobs/{job.json()['id']}/cancel")
