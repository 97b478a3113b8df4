"""Bounded bodies (issue 29, item 1): a body over the limit is a 413 before it is read, parsed or its token
looked at, with or without a token, streamed or not; /healthz keeps answering while huge bodies arrive; and a
422 lists a few dozen errors, then how many more there were.

Real processes: `autotune serve` on SQLite and on PostgreSQL, real HTTP.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from api.errors import MAX_ITEMS

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, postgres_url, module_*_url

LIMIT = 1 << 20
HUGE = b'{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "pad": "' + b"x" * (12 << 20) + b'"}'
"""A 12 MB ``POST /v1/jobs`` body."""


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One controller per database for the module's tests: none of them creates a job (each body is refused),
    so the one that counts the jobs still finds none, and a controller start costs seconds of CPU."""
    from conftest_service import module_controller

    yield from module_controller(request, tmp_path_factory)


def too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text[:500]
    (item,) = response.json()["detail"]
    assert item["field"] == "body" and f"at most {LIMIT} bytes" in item["rule"], item


def chunks(size: int, *, pause_s: float = 0.0) -> Iterator[bytes]:
    """A body of ``size`` bytes sent chunked (no Content-Length), a pause between its 64 KiB pieces."""
    for _ in range(size // (1 << 16)):
        yield b" " * (1 << 16)
        if pause_s:
            time.sleep(pause_s)


def test_a_huge_body_is_a_413_at_once_with_or_without_a_token(service: Service) -> None:
    with httpx.Client(base_url=service.url, timeout=30) as client:
        for headers in ({"Authorization": f"Bearer {service.token}"}, {}, {"Authorization": "Bearer wrong"}):
            started = time.monotonic()
            response = client.post("/v1/jobs", content=HUGE, headers={**headers, "Content-Type": "application/json"})
            took = time.monotonic() - started
            too_large(response)
            assert took < 3.0, f"{took:.2f} s for a 413 ({headers})"
        chunked = client.post(
            "/v1/jobs", content=chunks(4 * LIMIT), headers={"Authorization": f"Bearer {service.token}"}
        )
        too_large(chunked)
        assert client.get("/v1/jobs").json()["total"] == 0
        # Just under the limit still reaches the route: a 422 for what the body says, not its size.
        padded = b'{"pad": "' + b"x" * (LIMIT - 100) + b'"}'
        near = client.post("/v1/jobs", content=padded, headers={"Authorization": f"Bearer {service.token}"})
        assert near.status_code == 422, near.text[:300]


def test_healthz_answers_promptly_while_huge_bodies_arrive(service: Service) -> None:
    stop = threading.Event()
    answers: list[int] = []

    def upload() -> None:
        with httpx.Client(base_url=service.url, timeout=30) as client:
            while not stop.is_set():
                answers.append(client.post("/v1/jobs", content=HUGE).status_code)
                answers.append(client.post("/v1/jobs", content=chunks(2 * LIMIT, pause_s=0.01)).status_code)

    senders = [threading.Thread(target=upload) for _ in range(3)]
    for sender in senders:
        sender.start()
    latencies = []
    try:
        with httpx.Client(base_url=service.url, timeout=10) as client:
            for _ in range(40):
                started = time.monotonic()
                assert client.get("/healthz").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.05)
    finally:
        stop.set()
        for sender in senders:
            sender.join()
    assert answers and set(answers) == {413}, answers
    assert statistics.median(latencies) < 0.5 and max(latencies) < 3.0, latencies


def test_a_body_of_many_unknown_keys_answers_a_short_422_that_counts_the_rest(service: Service) -> None:
    body = {f"k{i}": 0 for i in range(20_000)}
    with httpx.Client(base_url=service.url, timeout=30) as client:
        response = client.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {service.token}"})
    assert response.status_code == 422, response.text[:300]
    assert len(response.content) < 16_000
    items = response.json()["detail"]
    assert len(items) == MAX_ITEMS + 1
    last = items[-1]
    # 20,000 unknown keys and the missing shape: 20,001 errors, 30 listed.
    assert last["field"] == "detail" and last["value"] == 20_001 - MAX_ITEMS, last
    assert f"{20_001 - MAX_ITEMS} more errors left out" in last["rule"]


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_limit_is_settable(
    database: str, request: pytest.FixtureRequest, make_service: Callable[..., Service]
) -> None:
    service = make_service(db_url=request.getfixturevalue(f"{database}_url"))
    service.start_controller(extra=["--max-body-bytes", "2048"])
    with httpx.Client(base_url=service.url, timeout=30) as client:
        refused = client.post("/v1/jobs", content=b" " * 3000, headers={"Authorization": f"Bearer {service.token}"})
        assert refused.status_code == 413
        assert refused.json()["detail"][0]["rule"] == "must be at most 2048 bytes (AUTOTUNE_MAX_BODY_BYTES)"
        job = {"shape": {"hidden": 64, "tp": 2, "seq": 32}, "backend": "cpu"}
        assert (
            client.post("/v1/jobs", json=job, headers={"Authorization": f"Bearer {service.token}"}).status_code == 202
        )
