"""``GET /metrics`` scraped from real controllers and parsed with prometheus_client's own parser.

The numbers must be what the test did: the requests it sent (by route template and status), the trials a
CPU worker ran (how many, and how long each ran by the trial rows' own timestamps), the trials queued and
leased while nobody works on them, and the jobs and workers in the database.  Two apps in one process keep
apart counters (each has its own registry, never the global one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from api.main import create_app
from api.settings import Settings

if TYPE_CHECKING:
    from conftest_service import Service

pytestmark = pytest.mark.slow
pytest_plugins = ("conftest_service",)  # make_service, sqlite_url

SHAPE = {"hidden": 64, "tp": 2, "seq": 32}
UNKNOWN_JOB = "00000000-0000-4000-8000-000000000000"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``/metrics``, keyed by (sample name, labels)."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests_of(samples: Samples, route: str, status: int) -> float:
    return value(samples, "autotune_http_requests_total", method="GET", route=route, status=str(status))


def test_metrics_count_the_requests_trials_jobs_and_workers_of_a_finished_job(make_service, sqlite_url: str) -> None:
    service: Service = make_service(db_url=sqlite_url)
    service.start_controller()
    service.start_worker()
    auth = {"Authorization": f"Bearer {service.token}"}
    job = httpx.post(
        f"{service.url}/v1/jobs",
        json={"shape": SHAPE, "layers": ["qkv_fprop"], "n_trials": 3, "backend": "cpu"},
        headers=auth,
    ).json()
    service.wait_for_job(job["id"])
    service.wait_until(
        lambda: value(scrape(service.url), "autotune_workers", status="idle") == 1,
        timeout_s=30,
        what="the worker to be idle after its last trial",
    )

    before = scrape(service.url)
    for _ in range(5):
        assert httpx.get(f"{service.url}/v1/jobs/{job['id']}").status_code == 200
    assert httpx.get(f"{service.url}/v1/jobs/{UNKNOWN_JOB}").status_code == 404
    assert httpx.get(f"{service.url}/no/such/path").status_code == 404
    assert httpx.get(f"{service.url}/static/dashboard.js").status_code == 200
    after = scrape(service.url)

    route = "/v1/jobs/{job_id}"
    assert requests_of(after, route, 200) - requests_of(before, route, 200) == 5
    assert requests_of(after, route, 404) - requests_of(before, route, 404) == 1
    assert requests_of(after, "unmatched", 404) - requests_of(before, "unmatched", 404) == 1
    assert requests_of(after, "/static/{path}", 200) - requests_of(before, "/static/{path}", 200) == 1
    timed = value(after, "autotune_http_request_duration_seconds_count", method="GET", route=route, status="200")
    assert timed == requests_of(after, route, 200)
    # The first scrape was counted (by the time the second one answered) under its own route.
    assert requests_of(after, "/metrics", 200) >= 1

    trials = httpx.get(f"{service.url}/v1/jobs/{job['id']}/trials", params={"limit": 1000}).json()["items"]
    complete = [t for t in trials if t["state"] == "complete"]
    assert complete and len(complete) == sum(t["state"] in ("complete", "failed") for t in trials)
    assert value(after, "autotune_trials", state="complete") == len(complete)
    assert value(after, "autotune_trials", state="waiting") == value(after, "autotune_trials", state="running") == 0
    assert value(after, "autotune_trial_duration_seconds_count", state="complete") == len(complete)
    ran_s = sum(_seconds(t["finished_at"]) - _seconds(t["started_at"]) for t in complete)
    assert value(after, "autotune_trial_duration_seconds_sum", state="complete") == pytest.approx(ran_s, abs=1e-3)

    assert value(after, "autotune_jobs", status="succeeded") == 1
    assert sum(value(after, "autotune_jobs", status=s) for s in ("queued", "running", "failed", "cancelled")) == 0
    assert value(after, "autotune_workers_alive") == 1


def test_metrics_show_trials_queued_and_leased(make_service, sqlite_url: str) -> None:
    """No worker runs anything: the scheduler queues trials, and one claimed over the API is leased."""
    service: Service = make_service(db_url=sqlite_url)
    service.start_controller()
    auth = {"Authorization": f"Bearer {service.token}"}
    with httpx.Client(base_url=service.url, headers=auth) as http:
        job = http.post("/v1/jobs", json={"shape": SHAPE, "layers": ["qkv_fprop", "proj_fprop"], "backend": "cpu"})
        job_id = job.json()["id"]

        def waiting_in_api() -> int:
            return http.get(f"/v1/jobs/{job_id}/trials", params={"state": "waiting"}).json()["total"]

        service.wait_until(lambda: waiting_in_api() == 4, timeout_s=30, what="two trials queued per slot")
        assert value(scrape(service.url), "autotune_trials", state="waiting") == 4
        assert value(scrape(service.url), "autotune_jobs", status="running") == 1

        worker = http.post("/v1/workers", json={"name": "w", "host": "h", "backend": "cpu"}).json()
        as_worker = {"Authorization": f"Bearer {worker['secret']}"}
        assert http.post(f"/v1/workers/{worker['id']}/claim", headers=as_worker).status_code == 200
        samples = scrape(service.url)
        assert value(samples, "autotune_trials", state="running") == 1
        assert value(samples, "autotune_workers", status="busy") == value(samples, "autotune_workers_alive") == 1


@pytest.fixture
def two_apps(tmp_path: Path) -> Iterator[list[str]]:
    """Two controllers served by uvicorn from this process, each on its own SQLite file."""
    servers, threads, urls = [], [], []
    for name in ("a", "b"):
        settings = Settings(db_url=f"sqlite:///{tmp_path / name}.db", no_auth=True, scheduler=False)
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        servers.append(server)
        threads.append(thread)
        urls.append(f"http://127.0.0.1:{port}")
    yield urls
    for server in servers:
        server.should_exit = True
    for thread in threads:
        thread.join(10)


def test_two_apps_in_one_process_count_apart(two_apps: list[str]) -> None:
    a, b = two_apps
    for _ in range(3):
        assert httpx.get(f"{a}/v1/jobs").status_code == 200
    assert httpx.get(f"{b}/v1/jobs").status_code == 200
    assert requests_of(scrape(a), "/v1/jobs", 200) == 3
    assert requests_of(scrape(b), "/v1/jobs", 200) == 1


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def test_best_answers_are_counted_by_where_they_came_from(two_apps: list[str]) -> None:
    """Three asks of one query within the cache's second: one computed, two kept; another query: computed."""
    a, _ = two_apps
    for params in (SHAPE, SHAPE, SHAPE, {**SHAPE, "seq": 64}):
        assert httpx.get(f"{a}/v1/best", params=params).status_code == 200
    samples = scrape(a)
    assert value(samples, "autotune_best_answers_total", source="computed") == 2
    assert value(samples, "autotune_best_answers_total", source="cache") == 2
    assert value(samples, "autotune_best_answers_total", source="shared") == 0
