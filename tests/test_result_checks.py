"""Results that must add up (issue 29, item 3): the controller recomputes every summary from the repeats a
worker sends, with the code that computed them on the worker (`Measurement.measured`), and refuses with a
422 naming the field each lie of the issue; a genuine result, a noisy CPU one taken under load among them,
and a real CPU worker's results still land.

Real processes: `autotune serve` on SQLite and on PostgreSQL, `autotune worker` on the CPU backend, real HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Baselines, BaselineSource, Measurement, check_physical
from overlap_runtime.shape import Collective, ModelShape
from overlap_runtime.uncertainty import Series

if TYPE_CHECKING:
    from conftest_service import Service

    from api.schemas import ClaimPublic, WorkerCreated
    from autotune.cli.rest_client import Client

pytest_plugins = ("conftest_service",)  # module_sqlite_url, module_postgres_url

SHAPE = ModelShape(hidden=64, tp=2, seq=32)
"""The real CPU worker's shape, and the suspect result's on H200s (`/v1/best` is asked for it)."""
# The tests share a controller, and a study (GPU model, shape, slot) is shared by every job that asks for it:
# what other workers measured for it decides whether a result is suspect.  So each test tunes a shape of its
# own, and no two tests whose jobs end (and store a winner) tune the same GPU model at the same tp, as a new
# study is warm-started from the winners of other shapes at its tp (`storage.warm_start`).
LIES_SHAPE = ModelShape(hidden=128, tp=2, seq=32)
CPU_SUSPECT_SHAPE = ModelShape(hidden=64, tp=4, seq=32)
THREE_LIARS_SHAPE = ModelShape(hidden=128, tp=4, seq=32)


def measured(overlap: list[float], gemm: list[float], comm: list[float], serial: list[float]) -> dict[str, Any]:
    """What a worker sends for these repeats: `Measurement.measured`'s summaries, as `to_dict` writes them."""
    baselines = Baselines(
        source=BaselineSource.SAME_ROUNDS,
        collective=Collective.ALL_GATHER,
        gemm=Series(samples=gemm, positions=(1, 2)),
        comm=Series(samples=comm, positions=(1, 2)),
        serial=Series(samples=serial, positions=(1, 2)),
    )
    overlap_series = Series(samples=overlap, positions=(0, 3))
    return Measurement.measured(overlap=overlap_series, baselines=baselines, rel_err=0.001, valid=True).to_dict()


GENUINE = measured(
    overlap=[0.2801, 0.2794, 0.2787, 0.2799],
    gemm=[0.2676, 0.2671, 0.2680, 0.2677],
    comm=[0.0924, 0.0930, 0.0921, 0.0926],
    serial=[0.3599, 0.3610, 0.3595, 0.3602],
)
NOISY_CPU = measured(
    overlap=[14.2, 15.0, 15.2, 16.9],
    gemm=[22.57, 24.0, 26.1, 23.2],
    comm=[3.1, 4.0, 3.5, 3.3],
    serial=[26.0, 28.2, 27.5, 29.0],
)
"""The shape of the false refusal of issue 29: overlap 15.10 ms, cached baselines timed under heavier load
(the old floor, the gemm's fastest x 0.8 less the overlap's standard deviation, was 16.95 ms)."""

STARVED_PEER = measured(
    overlap=[3.61, 3.64, 3.60, 3.62],
    gemm=[0.41, 0.43, 0.40, 0.42],
    comm=[3.54, 3.56, 3.55, 3.57],
    serial=[0.80, 0.82, 0.81, 0.83],
)
"""A CPU result whose cached collective baseline was timed while the peer rank waited for a core: every repeat
3.5 ms, four times the serial run that holds the same collective (a loaded 2-core machine's, 0.82 ms)."""


def with_baseline(name: str, samples: list[float]) -> dict[str, Any]:
    baselines = {**GENUINE["baselines"], name: {**GENUINE["baselines"][name], "samples": samples}}
    return {**GENUINE, "baselines": baselines}


def consistent(overlap: list[float], gemm: list[float], comm: list[float], serial: list[float]) -> dict[str, Any]:
    """A lie whose summaries agree with its repeats: only physics can refuse it."""
    return measured(overlap=overlap, gemm=gemm, comm=comm, serial=serial)


LIES: list[tuple[str, dict[str, Any], str]] = [
    ("cv 1000", {**GENUINE, "cv": 1000.0}, "cv"),
    ("baseline samples of -100", with_baseline("gemm", [-100.0, 0.2671, 0.2680, 0.2677]), "baselines.gemm.samples.0"),
    ("baseline samples of 1e-9", with_baseline("gemm", [1e-9] * 4), "gemm_ms"),
    ("serial_ms below gemm_ms", {**GENUINE, "serial_ms": 0.1}, "serial_ms"),
    (
        "serial below gemm, its repeats agreeing",
        consistent([0.2801, 0.2794, 0.2787, 0.2799], [0.2676] * 4, [0.0924] * 4, [0.1] * 4),
        "serial_ms",
    ),
    ("rel_err 1e9 with valid true", {**GENUINE, "rel_err": 1e9}, "rel_err"),
    ("samples 1000x below overlap_ms", {**GENUINE, "samples": [x / 1000 for x in GENUINE["samples"]]}, "overlap_ms"),
    ("hidden_ci [5, 9]", {**GENUINE, "hidden_ci": [5.0, 9.0]}, "hidden_ci"),
    ("repeats 0", {**GENUINE, "repeats": 0}, "repeats"),
    (
        "overlap 0.001 ms against a 2 ms GEMM, its repeats agreeing",
        consistent([0.001] * 4, [2.0] * 4, [0.5] * 4, [2.5] * 4),
        "overlap_ms",
    ),
]


def test_only_the_gemm_bounds_a_cpu_serial_run_while_a_gpu_one_is_bounded_by_its_collective_too() -> None:
    check_physical(STARVED_PEER, backend="cpu", dtype="bf16")
    with pytest.raises(InputError, match="the longer of gemm_ms and comm_ms") as refused:
        check_physical(STARVED_PEER, backend="cuda", dtype="bf16")
    assert refused.value.field == "serial_ms"
    below_gemm = measured(overlap=[1.02] * 4, gemm=[0.41] * 4, comm=[3.55] * 4, serial=[0.2] * 4)
    with pytest.raises(InputError, match="cannot be below gemm_ms") as refused:
        check_physical(below_gemm, backend="cpu", dtype="bf16")
    assert refused.value.field == "serial_ms"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def shared_service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One controller per database for the module's tests (a controller start costs seconds of CPU)."""
    from conftest_service import module_controller

    yield from module_controller(request, tmp_path_factory)


@pytest.fixture
def service(shared_service: Service) -> Iterator[Service]:
    """The module's controller, left as the next test needs it: the workers this test started stop, and its
    jobs that still run are cancelled, so no later test's worker claims their trials."""
    started = len(shared_service.workers)
    yield shared_service
    for worker in shared_service.workers[started:]:
        worker.stop()
    del shared_service.workers[started:]
    with shared_service.client() as client:
        for job in client.jobs():
            if job.status in ("queued", "running"):
                client.cancel(job.id)


def test_each_lie_is_a_422_naming_its_field_and_a_genuine_result_lands(service: Service) -> None:
    with service.client() as client, httpx.Client(base_url=service.url, timeout=30) as http:
        worker = client.register({"name": "liar", "host": "h", "backend": "cpu"})
        job_id = client.submit(shape=LIES_SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        claim = service.wait_until(lambda: client.claim(worker), timeout_s=30, what="a claim")
        n = len(claim.proposal.configs)
        url = f"/v1/workers/{worker.id}/trials/{claim.trial_id}/result"
        headers = {"Authorization": f"Bearer {worker.secret}", "X-Lease-Nonce": claim.lease_nonce}
        for what, lie, field in LIES:
            refused = http.post(url, json={"measurements": [GENUINE] * (n - 1) + [lie]}, headers=headers)
            assert refused.status_code == 422, (what, refused.text)
            assert refused.json()["detail"][0]["field"] == f"measurements.{n - 1}.{field}", (what, refused.text)
        heavy = {**GENUINE, "samples": [0.28] * 4097, "repeats": 4097, "hidden_ci": None}
        refused = http.post(url, json={"measurements": [heavy] * n}, headers=headers)
        assert refused.status_code == 422 and refused.json()["detail"][0]["field"] == "measurements", refused.text
        (trial,) = [t for t in client.all_trials(job_id) if t.id == claim.trial_id]
        assert trial.state == "running" and trial.measurement is None
        landed = http.post(url, json={"measurements": [GENUINE] * (n - 1) + [NOISY_CPU]}, headers=headers)
        assert landed.status_code == 200 and landed.json()["state"] == "complete", landed.text


def test_a_real_cpu_workers_results_land(service: Service) -> None:
    service.start_worker()
    with service.client() as client:
        job_id = client.submit(shape=SHAPE, layers=["qkv_fprop"], n_trials=3, backend="cpu").id
    job = service.wait_for_job(job_id, timeout_s=180)
    assert job.status == "succeeded", job
    with service.client() as client:
        trials = client.all_trials(job_id)
    assert trials and all(t.state == "complete" for t in trials), [(t.state, t.error) for t in trials]


FAST = consistent([0.10, 0.10, 0.11, 0.10], [0.09] * 4, [0.03] * 4, [0.12] * 4)
"""A lie that adds up and breaks no physics, but whose GEMM alone ran 3x faster than other workers' did."""


def gpu_worker(client: Client, name: str, *, n_gpus: int = 2) -> WorkerCreated:
    """A worker registered with ``n_gpus`` H200s, whose results the test writes: a GPU model is what suspicion
    compares workers by (a CPU backend's results never are suspect)."""
    body = {"name": name, "host": "h", "backend": "cuda", "gpu_model": "NVIDIA H200", "n_gpus": n_gpus}
    return client.register(body)


def measure_up_to_finalists(service: Service, client: Client, honest: WorkerCreated) -> ClaimPublic:
    """The honest worker measures every trial before the finalists, and hands their batch back."""
    while True:
        claim = service.wait_until(lambda: client.claim(honest), timeout_s=30, what="a claim")
        if claim.proposal.purpose == "finalist":
            client.release(honest, claim)
            return claim
        client.report(honest, claim, measurements=[GENUINE] * len(claim.proposal.configs))


def test_cpu_results_are_never_suspect_however_far_apart(service: Service) -> None:
    """Each host's CPU is "cpu": a loaded one times a GEMM 2x slower than an idle one, and neither lies."""
    with service.client() as client:
        idle, loaded = (client.register({"name": n, "host": n, "backend": "cpu"}) for n in ("idle", "loaded"))
        job_id = client.submit(shape=CPU_SUSPECT_SHAPE, layers=["qkv_fprop"], n_trials=4, backend="cpu").id
        claim = measure_up_to_finalists(service, client, loaded)
        final = service.wait_until(lambda: client.claim(idle), timeout_s=30, what="the idle worker's claim")
        assert final.trial_id == claim.trial_id
        client.report(idle, final, measurements=[FAST] * len(final.proposal.configs))
        assert service.wait_for_job(job_id).status == "succeeded"
        trials = client.all_trials(job_id)
        assert all(t.suspect is None and t.state == "complete" for t in trials), trials
        assert len({t.optuna_trial_number for t in trials}) == len(trials)  # nothing measured twice


def test_a_result_far_faster_than_other_workers_saw_is_suspect_and_another_worker_remeasures_it(
    service: Service,
) -> None:
    with service.client() as client, httpx.Client(base_url=service.url, timeout=30) as http:
        honest, liar = gpu_worker(client, "honest"), gpu_worker(client, "liar")
        job_id = client.submit(shape=SHAPE, layers=["qkv_fprop"], n_trials=4, backend="cuda").id
        claim = measure_up_to_finalists(service, client, honest)
        final = service.wait_until(lambda: client.claim(liar), timeout_s=30, what="the liar's claim")
        assert final.trial_id == claim.trial_id
        assert client.report(liar, final, measurements=[FAST] * len(final.proposal.configs)).state == "complete"

        def queued_again() -> bool:
            return any(t.state == "waiting" for t in client.all_trials(job_id))

        service.wait_until(queued_again, timeout_s=30, what="the suspect finalists queued again")
        assert client.claim(liar) is None  # its own suspect result is never re-measured by the liar
        again = client.claim(honest)
        assert again is not None and again.trial_id != final.trial_id
        assert again.proposal.configs == final.proposal.configs
        client.report(honest, again, measurements=[GENUINE] * len(again.proposal.configs))
        assert service.wait_for_job(job_id).status == "succeeded"
        trials = {t.id: t for t in client.all_trials(job_id)}
        assert trials[final.trial_id].suspect is not None
        assert "under 0.5 x the fastest GEMM of" in trials[final.trial_id].suspect
        assert all(t.suspect is None for i, t in trials.items() if i != final.trial_id)
        best = http.get("/v1/best", params={"hidden": 64, "tp": 2, "seq": 32, "gpu": "h200"}).json()
        assert best["measured"] is True, best
        (layer,) = best["results"][0]["layers"]
        assert layer["measurement"]["overlap_ms"] == GENUINE["overlap_ms"], layer  # the honest worker's numbers


def test_a_proposal_suspect_on_three_workers_is_told_as_failed_and_asked_anew(service: Service) -> None:
    with service.client() as client:
        honest = gpu_worker(client, "honest", n_gpus=4)
        liars = [gpu_worker(client, f"liar{i}", n_gpus=4) for i in range(3)]
        job_id = client.submit(shape=THREE_LIARS_SHAPE, layers=["qkv_fprop"], n_trials=4, backend="cuda").id
        batch = measure_up_to_finalists(service, client, honest)
        for liar in liars:  # each takes the batch the one before made suspect
            final = service.wait_until(lambda liar=liar: client.claim(liar), timeout_s=30, what="a liar's claim")
            assert final.proposal.configs == batch.proposal.configs
            client.report(liar, final, measurements=[FAST] * len(final.proposal.configs))
        anew = service.wait_until(lambda: client.claim(honest), timeout_s=30, what="the batch asked anew")
        assert anew.proposal.purpose == "finalist" and anew.proposal.configs == batch.proposal.configs
        client.report(honest, anew, measurements=[GENUINE] * len(anew.proposal.configs))
        assert service.wait_for_job(job_id).status == "succeeded"
        suspects = [t for t in client.all_trials(job_id) if t.suspect is not None]
        assert len(suspects) == 3 and len({t.worker_id for t in suspects}) == 3, suspects
