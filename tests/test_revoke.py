"""Revoking a worker (issue 29, item 4): ``DELETE /v1/workers/{id}`` and ``autotune workers revoke ID``, with
the admin token only, end the worker's secret, put its leased trials back in the queue, withdraw its results
from the studies and the winners, and ``/v1/best`` answers from what is left.

Real processes: `autotune serve --admin-token` on SQLite and on PostgreSQL, real HTTP; the CLI runs in-process
(`Service.cli`) against them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from overlap_runtime.measurement import Baselines, BaselineSource, Measurement
from overlap_runtime.shape import Collective, ModelShape
from overlap_runtime.uncertainty import Series

if TYPE_CHECKING:
    from click.testing import Result
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # module_sqlite_url, module_postgres_url

ADMIN = "test-admin-token"
SHAPE = ModelShape(hidden=64, tp=2, seq=32)
BEST = {"hidden": 64, "tp": 2, "seq": 32, "gpu": "cpu"}
RESULT = Measurement.measured(
    overlap=Series(samples=(0.30, 0.31, 0.30)),
    baselines=Baselines(
        source=BaselineSource.CACHED,
        collective=Collective.ALL_GATHER,
        gemm=Series(samples=(0.27, 0.28, 0.27)),
        comm=Series(samples=(0.09, 0.10, 0.09)),
        serial=Series(samples=(0.36, 0.37, 0.36)),
    ),
    rel_err=0.0,
    valid=True,
).to_dict()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One controller per database for the module's tests (a controller start costs seconds of CPU): the
    enrolment test's workers never claim, and revoking touches only the revoked worker's trials and results."""
    from conftest_service import module_controller

    # Leases long enough to outlast the CLI's start-up: the revocation, not the lease's end, frees the trial.
    yield from module_controller(
        request, tmp_path_factory, env={"AUTOTUNE_LEASE_S": "60"}, extra=["--admin-token", ADMIN]
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def revoke_cli(service: Service, worker_id: str, token: str) -> Result:
    return service.cli("workers", "revoke", worker_id, "--admin-token", token, "--json")


def test_a_revoked_worker_loses_its_secret_its_lease_and_its_results(service: Service) -> None:
    with service.client() as client, httpx.Client(base_url=service.url, timeout=30) as http:
        liar = client.register({"name": "liar", "host": "h", "backend": "cpu"})
        honest = client.register({"name": "honest", "host": "h", "backend": "cpu"})
        job_id = client.submit(shape=SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        for _ in range(20):  # the liar measures the whole job, finalists included, so it wins
            claim = service.wait_until(lambda: client.claim(liar), timeout_s=30, what="a claim")
            client.report(liar, claim, measurements=[RESULT] * len(claim.proposal.configs))
            if client.job(job_id).status == "succeeded" or claim.proposal.purpose == "finalist":
                break
        assert service.wait_for_job(job_id).status == "succeeded"
        assert http.get("/v1/best", params=BEST).json()["measured"] is True
        complete = [t.id for t in client.all_trials(job_id) if t.state == "complete"]
        other = ModelShape(hidden=64, tp=2, seq=64)  # the first shape's slot is decided: a new job runs none
        second = client.submit(shape=other, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        held = service.wait_until(lambda: client.claim(liar), timeout_s=30, what="a claim of the second job")
        assert held.job_id == second

        url = f"/v1/workers/{liar.id}"
        forged = http.delete(url, headers=bearer(service.token))
        assert forged.status_code == 401 and "clients' token" in forged.json()["detail"][0]["rule"]
        assert http.delete(url).status_code == 401
        assert http.delete(url, headers=bearer("wrong")).status_code == 401
        assert http.post(f"/v1/workers/{liar.id}/heartbeat", headers=bearer(liar.secret)).status_code == 200

        revoked = http.delete(url, headers=bearer(ADMIN))
        assert revoked.status_code == 200, revoked.text
        assert revoked.json() == {
            "worker_id": liar.id,
            "requeued": 1,
            "withdrawn": len(complete),
            "winners_removed": 1,
        }
        assert http.post(f"/v1/workers/{liar.id}/heartbeat", headers=bearer(liar.secret)).status_code == 401
        assert http.post(f"/v1/workers/{liar.id}/claim", headers=bearer(liar.secret)).status_code == 401
        trials: dict[int, Any] = {t.id: t for t in client.all_trials(job_id) + client.all_trials(second)}
        assert trials[held.trial_id].state == "waiting" and trials[held.trial_id].worker_id is None
        assert all(trials[i].state == "failed" and "revoked" in (trials[i].error or "") for i in complete)
        service.wait_until(
            lambda: http.get("/v1/best", params=BEST).json()["measured"] is False, timeout_s=10, what="/v1/best"
        )
        # The requeued trial goes to another worker.
        claim = service.wait_until(lambda: client.claim(honest), timeout_s=30, what="the honest worker's claim")
        assert claim.trial_id == held.trial_id

    assert revoke_cli(service, honest.id, "wrong").exit_code == 2
    done = revoke_cli(service, honest.id, ADMIN)
    assert done.exit_code == 0, done.stderr
    assert '"requeued": 1' in done.stdout
    missing = revoke_cli(service, "00000000-0000-0000-0000-000000000000", ADMIN)
    assert missing.exit_code == 1 and "not found" in missing.stderr


@pytest.mark.parametrize("other", ["token", "worker_token"])
def test_the_admin_token_is_a_credential_of_its_own(other: str) -> None:
    from api.settings import Settings
    from overlap_runtime.errors import InputError

    settings = Settings(**{"token": "clients", "worker_token": "workers", other: "same", "admin_token": "same"})
    with pytest.raises(InputError, match=f"must differ from {other}"):
        settings.check_auth()
    with pytest.raises(InputError, match="must not be empty"):
        Settings(token="clients", admin_token="").check_auth()


def test_an_enrolment_token_registers_one_worker_once_before_it_expires(service: Service) -> None:
    worker = {"name": "node", "host": "h", "backend": "cpu"}
    with httpx.Client(base_url=service.url, timeout=30) as http:
        refused = http.post("/v1/workers/enrolments", json={}, headers=bearer(service.token))
        assert refused.status_code == 401 and "clients' token" in refused.json()["detail"][0]["rule"]
        enrolled = http.post("/v1/workers/enrolments", json={"ttl_s": 60}, headers=bearer(ADMIN))
        assert enrolled.status_code == 201, enrolled.text
        token = enrolled.json()["token"]
        assert http.post("/v1/workers", json=worker, headers=bearer(token)).status_code == 201
        again = http.post("/v1/workers", json=worker, headers=bearer(token))
        assert again.status_code == 401 and again.json()["detail"][0]["field"] == "Authorization"
        short = http.post("/v1/workers/enrolments", json={"ttl_s": 0.5}, headers=bearer(ADMIN)).json()["token"]
        service.wait_until(
            lambda: http.post("/v1/workers", json=worker, headers=bearer(short)).status_code == 401,
            timeout_s=10,
            what="the short-lived token to expire",
        )
        assert http.post("/v1/workers/enrolments", json={"ttl_s": 0}, headers=bearer(ADMIN)).status_code == 422
    printed = service.cli("workers", "enrol", "--admin-token", ADMIN, "--ttl-s", "60")
    assert printed.exit_code == 0, printed.stderr
    with service.client(token=printed.stdout.strip()) as client:
        assert client.register(worker).secret
