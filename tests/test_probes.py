"""Liveness and readiness as Kubernetes expects (issue 29): ``/livez`` answers without the database and
without waiting behind other requests, ``/readyz`` is a 503 while the database does not answer, and
``/healthz`` is as it was.

Real processes: `autotune serve` on SQLite and on PostgreSQL, real HTTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, postgres_url, pg_admin


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_livez_and_readyz_answer_and_healthz_is_unchanged(
    database: str, request: pytest.FixtureRequest, make_service: Callable[..., Service]
) -> None:
    service = make_service(db_url=request.getfixturevalue(f"{database}_url"))
    service.start_controller()
    with httpx.Client(base_url=service.url, timeout=10) as client:
        assert client.get("/livez").json() == {"status": "ok"}
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ok", "database": "postgresql" if database == "postgres" else "sqlite"}
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["writable"] and health["database"] == ready.json()["database"]


def test_livez_answers_while_the_database_is_gone_and_the_pool_is_busy_and_readyz_says_it_is_not_ready(
    make_service: Callable[..., Service], postgres_url: str, pg_admin: Any
) -> None:
    service = make_service(db_url=postgres_url)
    service.start_controller()
    database = postgres_url.rsplit("/", 1)[1]

    def connections(allowed: bool) -> None:
        with pg_admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {str(allowed).lower()}')
            conn.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")

    connections(False)
    stop = threading.Event()

    def readers() -> None:
        # Sync routes that each wait on the unreachable database, filling the thread pool /readyz needs too.
        with httpx.Client(base_url=service.url, timeout=30) as client:
            while not stop.is_set():
                client.get("/v1/jobs")

    threads = [threading.Thread(target=readers) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        with httpx.Client(base_url=service.url, timeout=10) as client:
            not_ready = client.get("/readyz")
            assert not_ready.status_code == 503 and int(not_ready.headers["retry-after"]) > 0
            (item,) = not_ready.json()["detail"]
            assert item["field"] == "database" and "is unavailable" in item["rule"], item
            for _ in range(20):
                started = time.monotonic()
                assert client.get("/livez").status_code == 200
                assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        connections(True)
    service.wait_until(
        lambda: httpx.get(f"{service.url}/readyz", timeout=5).status_code == 200, timeout_s=30, what="/readyz"
    )
