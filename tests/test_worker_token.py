"""Separate credentials for clients and workers (issue 21, item 2): with a worker token set, only it registers
a worker, the clients' token (shared by every user) no longer does, and the worker token passes no client
write; without one, registration takes the clients' token as before.

Real processes: `autotune serve` on a fresh SQLite file, `autotune worker` CPU workers, real HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from api.settings import Settings
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service, worker_token_service, make_service

WORKER = {"name": "w", "host": "h", "backend": "cpu"}
SHAPE = ModelShape(hidden=64, tp=2, seq=32)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def refusal(response: httpx.Response) -> str:
    """The rule of a 401 that names the Authorization field, as every refused credential's does."""
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    (item,) = response.json()["detail"]
    assert item["field"] == "Authorization" and item["rule"], item
    return item["rule"]


@pytest.fixture(scope="module")
def anonymous(worker_token_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=worker_token_service.url) as client:
        yield client


def test_with_a_worker_token_it_registers_a_worker_and_the_clients_token_does_not(
    worker_token_service: Service, anonymous: httpx.Client
) -> None:
    registered = anonymous.post("/v1/workers", json=WORKER, headers=bearer(worker_token_service.worker_token))
    assert registered.status_code == 201, registered.text
    assert registered.json()["secret"]
    forged = anonymous.post("/v1/workers", json=WORKER, headers=bearer(worker_token_service.token))
    assert "clients' token" in refusal(forged) and "AUTOTUNE_WORKER_TOKEN" in refusal(forged)
    assert "does not match the controller's worker token" in refusal(
        anonymous.post("/v1/workers", json=WORKER, headers=bearer("nope"))
    )
    assert "AUTOTUNE_WORKER_TOKEN" in refusal(anonymous.post("/v1/workers", json=WORKER))
    assert registered.json()["id"] in [w["id"] for w in anonymous.get("/v1/workers").json()]
    health = anonymous.get("/healthz").json()
    assert health["auth"] and health["worker_auth"]


def test_the_worker_token_passes_no_client_write(worker_token_service: Service, anonymous: httpx.Client) -> None:
    job: dict[str, Any] = {"shape": SHAPE.as_given(), "backend": "cpu"}
    assert "is the worker token, which only registers workers" in refusal(
        anonymous.post("/v1/jobs", json=job, headers=bearer(worker_token_service.worker_token))
    )
    submitted = anonymous.post("/v1/jobs", json=job, headers=bearer(worker_token_service.token))
    assert submitted.status_code == 202, submitted.text
    cancel = f"/v1/jobs/{submitted.json()['id']}/cancel"
    refusal(anonymous.post(cancel, headers=bearer(worker_token_service.worker_token)))
    # Not cancelled: queued, or running once the scheduler has started it (a submit wakes it at once).
    assert anonymous.get(f"/v1/jobs/{submitted.json()['id']}").json()["status"] in ("queued", "running")
    assert anonymous.post(cancel, headers=bearer(worker_token_service.token)).status_code == 200


def test_the_openapi_document_names_the_worker_token_for_registration(anonymous: httpx.Client) -> None:
    paths = anonymous.get("/openapi.json").json()["paths"]
    assert paths["/v1/workers"]["post"]["security"] == [{"WorkerToken": []}]
    assert paths["/v1/jobs"]["post"]["security"] == [{"HTTPBearer": []}]


def test_a_worker_with_only_the_clients_token_is_refused_at_registration(worker_token_service: Service) -> None:
    worker = worker_token_service.start_worker()
    assert worker.process.wait(60) == 2, worker.tail()  # a refused request is exit 2 (docs/cli.md)
    assert "error: Authorization: is the clients' token" in worker.tail()


@pytest.mark.slow
def test_a_worker_given_only_the_worker_token_registers_and_completes_a_job(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller(extra=["--worker-token", service.worker_token])
    service.start_worker(auth=("--worker-token", service.worker_token))
    with service.client() as client:
        job_id = client.submit(shape=SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    with service.client() as client:
        (worker,) = client.workers()
        assert {t.worker_id for t in client.all_trials(job_id)} == {worker.id}


@pytest.mark.slow
def test_serve_hands_its_local_worker_the_worker_token(make_service, sqlite_url: str) -> None:
    """It registers, which with a worker token set only the worker token does."""
    service = make_service(db_url=sqlite_url)
    service.start_controller(extra=["--worker-token", service.worker_token, "--local-worker", "--backend", "cpu"])
    with service.client() as client:
        service.wait_until(lambda: client.workers(), timeout_s=60, what="the local worker to register")


def test_without_a_worker_token_the_clients_token_registers_workers(idle_service: Service) -> None:
    """The single-token setup (one user's machine, `serve --local-worker`) works as before."""
    with httpx.Client(base_url=idle_service.url) as anonymous:
        registered = anonymous.post("/v1/workers", json=WORKER, headers=bearer(idle_service.token))
        assert registered.status_code == 201, registered.text
        assert "does not match the controller's token" in refusal(
            anonymous.post("/v1/workers", json=WORKER, headers=bearer(idle_service.worker_token))
        )
        health = anonymous.get("/healthz").json()
        assert health["auth"] and not health["worker_auth"]


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        ({"token": "t", "worker_token": ""}, "must not be empty"),
        ({"token": "t", "worker_token": "t"}, "must differ from token"),
    ],
)
def test_an_empty_worker_token_or_one_equal_to_the_token_is_refused(settings: dict[str, str], rule: str) -> None:
    with pytest.raises(InputError) as refused:
        Settings(**settings).check_auth()
    assert refused.value.field == "worker_token" and refused.value.rule.startswith(rule)
