"""The whole service against real processes: a controller, CPU-backend workers, SQLite and PostgreSQL.

A tiny job (hidden 64, seq 32, tp 2, two slots, few trials) must succeed, and what the API calls best and
the YAML it exports must be exactly what the stored trials measured.  Then the failures a fleet meets: a
worker killed with SIGKILL in the middle of a trial, a controller killed and restarted mid-job, four
workers claiming from one PostgreSQL database at once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest

import storage
from api.schemas import TrialPublic
from api.views import trial_view
from overlap_runtime.config import Method
from overlap_runtime.measurement import Baselines, BaselineSource, Measurement
from overlap_runtime.shape import Collective, ModelShape, Slot
from overlap_runtime.uncertainty import Series
from search_spaces import parse_nemo
from search_spaces.te_dict import te_config
from search_spaces.te_exact import is_te_exact
from storage import LEASE_EXPIRED

if TYPE_CHECKING:
    from conftest_service import Service

pytestmark = pytest.mark.slow
pytest_plugins = ("conftest_service",)  # make_service, sqlite_url, postgres_url

TINY_SHAPE = ModelShape(hidden=64, tp=2, seq=32)
TWO_SLOTS = ["qkv_fprop", "proj_fprop"]


def submit_tiny_job(service: Service, *, n_trials: int = 4) -> str:
    with service.client() as client:
        return client.submit(shape=TINY_SHAPE, layers=TWO_SLOTS, n_trials=n_trials, backend="cpu").id


def trials_of(service: Service, job_id: str) -> list[TrialPublic]:
    with service.client() as client:
        return client.all_trials(job_id)


def measured_pairs(trial: TrialPublic) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(config, measurement) of each config a complete trial measured."""
    return list(zip([c.model_dump() for c in trial.config.configs], trial.measurement["measurements"], strict=True))


def assert_best_and_yaml_agree_with_trials(service: Service, job_id: str) -> None:
    """Every winner is a measurement a stored trial made, the fastest valid one of its trial; so is each slot's
    TE-exact winner, and the YAML carries that one (with the note that says so where no overlap was faster)."""
    trials = trials_of(service, job_id)
    with service.client() as client:
        job = client.job(job_id)
        best = client.best(TINY_SHAPE.as_given())
        preset = client.preset(TINY_SHAPE.as_given())
    assert best.measured and preset.measured
    (group,) = best.results
    assert group.gpu == "cpu"
    assert [layer.slot for layer in group.layers] == TWO_SLOTS
    yaml_configs = parse_nemo(preset.text).configs
    for layer in group.layers:
        holders = [
            t
            for t in trials
            if t.slot == layer.slot
            and t.state == "complete"
            and (layer.config.model_dump(), layer.measurement) in measured_pairs(t)
        ]
        assert holders, f"{layer.slot}: the best config was not measured by any stored trial"
        valid = [m["overlap_ms"] for _, m in measured_pairs(holders[0]) if m["valid"]]
        assert layer.measurement["overlap_ms"] == min(valid)
        slot_view = next(s for s in job.slots if s.slot == layer.slot)
        assert slot_view.best.final and slot_view.best.config == layer.config
        assert slot_view.best.trial_id == holders[0].id
        exact = layer.te_exact
        assert exact is not None, f"{layer.slot}: no TE-exact winner"
        assert is_te_exact(exact.config.to_config(), TINY_SHAPE.tp)
        mine = [t for t in trials if t.slot == layer.slot and t.state == "complete"]
        assert any((exact.config.model_dump(), exact.measurement) in measured_pairs(t) for t in mine), layer.slot
        assert slot_view.te_exact is not None and slot_view.te_exact.final
        assert slot_view.te_exact.config == exact.config
        if layer.config.method == Method.NONE and layer.measurement["overlap_ms"] < exact.measurement["overlap_ms"]:
            assert "no overlap was" in preset.text
        slot = Slot(layer.slot)
        assert yaml_configs[slot] == te_config(slot, exact.config.to_config())
    assert "measured with" not in preset.text


def assert_each_trial_claimed_once(trials: list[TrialPublic]) -> None:
    """One claim per row (a second claim would count a second attempt), one result per proposal."""
    assert all(t.attempts == 1 for t in trials if t.state != "waiting"), trials
    done = Counter((t.slot, t.optuna_trial_number) for t in trials if t.state == "complete")
    assert all(n == 1 for n in done.values()), done


def test_tiny_job_on_sqlite_succeeds_and_its_best_and_yaml_match_the_trials(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    service.start_worker()
    job_id = submit_tiny_job(service)
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    assert job.progress.fraction == 1.0
    assert_best_and_yaml_agree_with_trials(service, job_id)
    assert_each_trial_claimed_once(trials_of(service, job_id))


def test_configs_asked_to_be_measured_first_are_measured_before_the_search(make_service, sqlite_url: str) -> None:
    first = {"method": "pipeline", "num_splits": 8, "pipeline_rs_overlap_first_gemm": True}
    unsplit = {"method": "pipeline", "num_splits": 1}  # runs, but no search space holds it (it is serial)
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    service.start_worker()
    with service.client() as client:
        measure_first = {"proj_fprop": [first, unsplit]}
        job_id = client.submit(
            shape=TINY_SHAPE, layers=["proj_fprop"], n_trials=6, backend="cpu", measure_first=measure_first
        ).id
    assert service.wait_for_job(job_id).status == "succeeded"
    trials = [t for t in trials_of(service, job_id) if t.purpose != "finalist"]
    searched = [t.optuna_trial_number for t in trials if t.purpose == "search"]
    assert searched
    for config in (first, unsplit):
        attempts = sorted(
            (t for t in trials if [c.model_dump() for c in t.config.configs] == [config]), key=lambda t: t.id
        )
        assert attempts[0].purpose == "baseline" and attempts[0].optuna_trial_number < min(searched)
        # measured once; asked again only after a lost lease (a worker stalled by a loaded machine)
        (mine,) = [t for t in attempts if t.state == "complete"]
        assert mine.measurement["measurements"][0]["valid"]
        assert all(t.error == LEASE_EXPIRED for t in attempts if t is not mine)


def test_an_fp8_job_tunes_e4m3_gemms_and_serves_an_fp8_preset(make_service, sqlite_url: str) -> None:
    """dtype fp8 through the REST API: the job runs FP8 GEMMs on the CPU backend, measures the pipeline's FP8
    buffer it was asked to measure first, and its preset is served under NVIDIA's fp8 name and header."""
    fp8_buffer = {"method": "pipeline", "num_splits": 2, "fp8_buf": True}
    fp8 = dataclasses.replace(TINY_SHAPE, dtype="fp8")
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    service.start_worker()
    with service.client() as client:
        job_id = client.submit(
            shape=fp8, layers=["proj_fprop"], n_trials=4, backend="cpu", measure_first={"proj_fprop": [fp8_buffer]}
        ).id
    assert service.wait_for_job(job_id).status == "succeeded"
    (mine,) = [t for t in trials_of(service, job_id) if [c.model_dump() for c in t.config.configs] == [fp8_buffer]]
    assert mine.state == "complete" and mine.measurement["measurements"][0]["valid"]
    query = {"hidden": 64, "tp": 2, "mbs": 1, "seq": 32, "dtype": "fp8"}
    with service.client() as client:
        (group,) = client.best(query, gpu="cpu").results
        preset = client.preset(query, gpu="cpu")
        assert client.best({**query, "dtype": "bf16"}, gpu="cpu").results == []
    assert ModelShape(**group.shape) == fp8 and [layer.slot for layer in group.layers] == ["proj_fprop"]
    assert preset.measured and preset.file_name == "ub_cfg_cpu_fp8_h64_tp2_mbs1_seqlen32.yaml"
    assert "# Model configs: CPU/h64/TP2/MBS1/SeqLen32/FP8\n" in preset.text


def test_four_workers_on_postgres_never_share_a_trial(make_service, postgres_url: str) -> None:
    service = make_service(db_url=postgres_url)
    service.start_controller()
    for _ in range(4):
        service.start_worker()
    job_id = submit_tiny_job(service)
    job = service.wait_for_job(job_id, timeout_s=180)
    assert job.status == "succeeded", job
    trials = trials_of(service, job_id)
    assert_each_trial_claimed_once(trials)
    assert len({t.worker_id for t in trials}) >= 2, "the four workers did not share the work"
    assert_best_and_yaml_agree_with_trials(service, job_id)
    with service.client() as client:
        assert len(client.workers()) == 4


def test_a_trial_whose_worker_is_killed_is_retried_after_its_lease(make_service, sqlite_url: str) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    doomed = service.start_worker()
    job_id = submit_tiny_job(service)
    # Its first trial includes starting the TP group (seconds on the CPU backend): kill it in there.
    running = service.wait_until(
        lambda: [t for t in trials_of(service, job_id) if t.state == "running"], timeout_s=60, what="a running trial"
    )
    before = {t.id: t for t in trials_of(service, job_id) if t.state == "complete"}
    doomed.kill9()
    service.start_worker()
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    trials = {t.id: t for t in trials_of(service, job_id)}
    for lost in running:
        assert trials[lost.id].state == "failed"
        assert trials[lost.id].error == LEASE_EXPIRED
        retried = [
            t
            for t in trials.values()
            if t.id > lost.id and t.state == "complete" and t.config.configs == lost.config.configs
        ]
        assert retried, f"trial {lost.id} was never measured again"
    for trial_id, trial in before.items():
        assert trials[trial_id].measurement == trial.measurement, "a completed trial was lost"
    assert_best_and_yaml_agree_with_trials(service, job_id)


def test_a_controller_restarted_mid_job_finishes_it(make_service, postgres_url: str) -> None:
    service = make_service(db_url=postgres_url)
    service.start_controller()
    service.start_worker()
    job_id = submit_tiny_job(service, n_trials=6)
    service.wait_until(
        lambda: sum(t.state == "complete" for t in trials_of(service, job_id)) >= 3,
        timeout_s=90,
        what="three complete trials",
    )
    assert service.controller is not None
    service.controller.kill9()
    before = {t.id: t for t in trials_of_db(service, job_id) if t.state == "complete"}
    service.start_controller()
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    trials = {t.id: t for t in trials_of(service, job_id)}
    for trial_id, trial in before.items():
        assert trials[trial_id].measurement == trial.measurement, "a completed trial was lost"
    assert_each_trial_claimed_once(list(trials.values()))
    assert_best_and_yaml_agree_with_trials(service, job_id)


def trials_of_db(service: Service, job_id: str) -> list[TrialPublic]:
    """The job's trials read from the database itself, while no controller is up to answer."""
    engine = storage.create_engine_for(url=service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            slots = {s.id: s.slot for s in storage.list_layer_studies(session=session, job_id=job_id)}
            page = storage.list_trials(session=session, job_id=job_id, limit=1000)
            return [trial_view(t, slots=slots) for t in page.items]
    finally:
        engine.dispose()


def test_a_job_may_name_its_gpu_by_the_short_name_and_runs_on_that_model_only(make_service, sqlite_url: str) -> None:
    """ "h200" selects the workers that report "NVIDIA H200"; the job then carries the full name, which the
    claims match; a model no worker has keeps its job queued."""
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    gpu = {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "nvlink_active": 18, "sm_count": 132}
    with service.client() as client:
        worker = client.register(
            {
                "name": "h200",
                "host": "h",
                "backend": "cuda",
                "gpus": [gpu, gpu],
                "gpu_model": "NVIDIA H200",
                "n_gpus": 2,
            }
        )
        h200 = client.submit(shape=TINY_SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cuda", gpu="h200").id
        a100 = client.submit(shape=TINY_SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cuda", gpu="A100").id
        job = service.wait_until(
            lambda: (j := client.job(h200)).status == "running" and j, timeout_s=30, what="the h200 job to start"
        )
        assert job.gpu == "NVIDIA H200"
        claim = service.wait_until(lambda: client.claim(worker), timeout_s=30, what="a claim")
        assert claim.job_id == h200
        assert client.job(a100).status == "queued" and client.job(a100).gpu == "A100"


def test_a_worker_reporting_measurements_of_the_old_shape_is_heard_beside_one_reporting_baselines(
    make_service, sqlite_url: str
) -> None:
    """Workers from before baselines were kept send no ``positions``, ``baselines`` or ``hidden_ci``; a job fed
    by one such worker and one new one alternately still decides, and both forms come back as they were sent."""
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    gpu = {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "nvlink_active": 18, "sm_count": 132}
    old = {
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
        "hidden_frac": 0.8727,
    }
    rounds = Series(samples=(0.30, 0.31, 0.30, 0.32), positions=(4, 9))
    baselines = Baselines(
        source=BaselineSource.SAME_ROUNDS, collective=Collective.ALL_GATHER, gemm=rounds, comm=rounds, serial=rounds
    )
    new = Measurement.measured(overlap=rounds, baselines=baselines, rel_err=0.0, valid=True).to_dict()
    with service.client() as client:
        worker = client.register(
            {"name": "w", "host": "h", "backend": "cuda", "gpus": [gpu, gpu], "gpu_model": "NVIDIA H200", "n_gpus": 2}
        )
        job_id = client.submit(shape=TINY_SHAPE, layers=["qkv_fprop"], n_trials=2, backend="cuda").id
        sent: dict[int, dict[str, Any]] = {}
        for turn in range(12):
            claim = service.wait_until(lambda: client.claim(worker), timeout_s=30, what="a claim")
            finalist = claim.proposal.purpose == "finalist"
            body = new if turn % 2 or finalist else old
            n = len(claim.proposal.configs)
            assert client.report(worker, claim, measurements=[body] * n).state == "complete"
            sent[claim.trial_id] = body
            if finalist:
                break
        assert finalist  # the study took every result and moved on to its finalists
        assert old in sent.values() and new in sent.values()
    job = service.wait_for_job(job_id)
    assert job.status == "succeeded", job
    for trial in trials_of(service, job_id):
        assert trial.state == "complete" and trial.id in sent
        for stored in trial.measurement["measurements"]:
            assert Measurement.from_dict(stored) == Measurement.from_dict(sent[trial.id])
