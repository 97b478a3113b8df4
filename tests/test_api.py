"""The REST contract against a real controller (uvicorn in a subprocess, SQLite, no workers).

Writes need the bearer token; every 4xx names the field and the rule; pagination, cancel, server-sent
events, the nearest-preset answer that says it was not measured; and schemathesis over the OpenAPI spec
finds no 5xx and no response that breaks the spec.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from conftest_tuner import measurement

import storage
from api.settings import Settings
from autotune.tuner.outcome import SlotOutcome
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import bridge_file_name, load_ours, parse_bridge, parse_nemo, preset_json
from search_spaces.consumers import Measured, Mode
from search_spaces.export import NO_TE_EXACT

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # idle_service

SHAPE = {"hidden": 64, "tp": 2, "mbs": 1, "seq": 32}
UNKNOWN_JOB = "00000000-0000-4000-8000-000000000000"
SCHEMATHESIS_EXAMPLES = 20


@pytest.fixture(scope="module")
def http(idle_service: Service) -> Iterator[httpx.Client]:
    """An authorised client; a cuda job submitted here is never run (no workers)."""
    with httpx.Client(base_url=idle_service.url, headers={"Authorization": f"Bearer {idle_service.token}"}) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(idle_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=idle_service.url) as client:
        yield client


def errors_of(response: httpx.Response) -> list[dict[str, Any]]:
    """The error items, after checking each names a field and a rule."""
    detail = response.json()["detail"]
    assert detail and all(item["field"] and item["rule"] for item in detail), detail
    return detail


def submit(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    response = http.post("/v1/jobs", json={"shape": SHAPE, "backend": "cuda", **extra})
    assert response.status_code == 202, response.text
    return response.json()


def test_a_submitted_job_is_accepted_with_a_status_url(http: httpx.Client) -> None:
    response = http.post("/v1/jobs", json={"shape": SHAPE, "layers": ["qkv_fprop"], "backend": "cuda"})
    assert response.status_code == 202
    assert response.json()["status"] == "queued"
    location = response.headers["location"]
    job = http.get(location).json()
    assert job["status"] == "queued" and job["layers"] == ["qkv_fprop"] and job["progress"]["done"] == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/jobs"),
        ("POST", f"/v1/jobs/{UNKNOWN_JOB}/cancel"),
        ("POST", "/v1/workers"),
        ("POST", f"/v1/workers/{UNKNOWN_JOB}/claim"),
    ],
)
def test_writes_without_a_token_are_401(anonymous: httpx.Client, method: str, path: str) -> None:
    response = anonymous.request(method, path, json={"shape": SHAPE})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert errors_of(response)[0]["field"] == "Authorization"


def test_a_wrong_token_is_401(anonymous: httpx.Client) -> None:
    response = anonymous.post("/v1/jobs", json={"shape": SHAPE}, headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    assert "does not match" in errors_of(response)[0]["rule"]


def test_reads_need_no_token(anonymous: httpx.Client) -> None:
    for path in ("/v1/jobs", "/v1/workers", "/healthz", "/", "/docs", "/openapi.json"):
        assert anonymous.get(path).status_code == 200, path


@pytest.mark.parametrize(
    ("body", "field", "rule"),
    [
        ({"shape": {**SHAPE, "hidden": 0}}, "shape.hidden", "greater than or equal to 1"),
        ({"shape": {**SHAPE, "hidden": 63}}, "hidden", "divisible by tp=2"),
        ({"shape": {"hidden": 64, "tp": 2}}, "shape.seq", "Field required"),
        ({"shape": {**SHAPE, "tp": 1}}, "tp", "tp >= 2"),
        ({"shape": SHAPE, "layers": ["qkv_fprp"]}, "layers", "did you mean qkv_fprop?"),
        ({"shape": SHAPE, "n_trial": 5}, "n_trial", "Extra inputs are not permitted"),
        ({"shape": SHAPE, "n_trials": "5"}, "n_trials", "valid integer"),
        ({"shape": SHAPE, "backend": "tpu"}, "backend", "'cpu', 'cuda' or 'te'"),
        ({"shape": SHAPE, "gpu": "bad\u0000name"}, "gpu", "match pattern"),
    ],
)
def test_each_bad_job_is_a_422_naming_the_field_and_the_rule(
    http: httpx.Client, body: dict[str, Any], field: str, rule: str
) -> None:
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    (error,) = errors_of(response)
    assert error["field"] == field and rule in error["rule"], error


PIPELINE_FIRST = {"method": "pipeline", "num_splits": 2, "pipeline_rs_overlap_first_gemm": True, "num_sm": 8}
"""The knobs a cuda proj_fprop config of the space chooses, without those it implies."""
PIPELINE_IMPLIED = {"set_sm_margin": True, "cga_size": 2, "gemm": "cublas", "num_max_streams": 2}


def test_configs_to_measure_first_are_kept_as_given_with_the_job(http: httpx.Client) -> None:
    pipeline = {**PIPELINE_FIRST, **PIPELINE_IMPLIED}
    fused = {"method": "ring_exchange", "gemm": "triton", "fused": True}
    first = {"proj_fprop": [pipeline, {"method": "none"}], "qkv_fprop": [fused]}
    job = http.get(f"/v1/jobs/{submit(http, layers=['qkv_fprop', 'proj_fprop'], measure_first=first)['id']}").json()
    assert job["measure_first"] == first
    # In OverlapConfig.to_dict's key order, as every config the service serves.
    assert list(job["measure_first"]["proj_fprop"][0]) == list(OverlapConfig.from_dict(pipeline).to_dict())
    assert http.get(f"/v1/jobs/{submit(http)['id']}").json()["measure_first"] is None


def test_a_config_to_measure_first_that_the_search_space_lacks_is_taken_as_given(http: httpx.Client) -> None:
    # No search space holds stream priorities, nor a cga_size that the other knobs imply otherwise.
    priorities = {**PIPELINE_FIRST, **PIPELINE_IMPLIED, "cga_size": 4, "comm_priority": -1, "gemm_priority": 0}
    first = {"proj_fprop": [priorities]}
    job = http.get(f"/v1/jobs/{submit(http, layers=['proj_fprop'], measure_first=first)['id']}").json()
    assert job["measure_first"] == first


@pytest.mark.parametrize(
    ("first", "backend", "field", "rule"),
    [
        ({"fc1_fprop": [{"method": "none"}]}, "cuda", "measure_first.fc1_fprop", "not a slot this job tunes"),
        ({"proj_fprp": [{"method": "none"}]}, "cuda", "measure_first.proj_fprp", "did you mean proj_fprop?"),
        ({"proj_fprop": []}, "cuda", "measure_first.proj_fprop", "at least 1 item"),
        ({"proj_fprop": [{"method": "bulk", "num_sm": 65}]}, "cuda", "measure_first.proj_fprop.0.num_sm", "64"),
        ({"proj_fprop": [{"method": "none", "use_ce": 1}]}, "cuda", "measure_first.proj_fprop.0.use_ce", "boolean"),
        ({"proj_fprop": [{"method": "none", "n_sm": 1}]}, "cuda", "measure_first.proj_fprop.0.n_sm", "Extra inputs"),
        ({"proj_fprop": [{"method": "bulk"}]}, "cuda", "measure_first.proj_fprop.0.method", "coupled"),
        (
            {"proj_fprop": [{"method": "none"}, {**PIPELINE_FIRST, "fp8_buf": True}]},
            "cuda",
            "measure_first.proj_fprop.1.fp8_buf",
            "needs FP8 GEMMs",
        ),
        (
            {"proj_fprop": [{**PIPELINE_FIRST, "atomic_gemm": True}]},
            "cuda",
            "measure_first.proj_fprop.0.atomic_gemm",
            "needs FP8 GEMMs (a shape with dtype fp8, not bf16)",
        ),
        (
            {"proj_fprop": [{**PIPELINE_FIRST, "cga_size": 16}]},
            "cuda",
            "measure_first.proj_fprop.0.cga_size",
            "less than or equal to 4",
        ),
        ({"proj_fprop": [PIPELINE_FIRST]}, "cpu", "measure_first.proj_fprop.0.num_sm", "no meaning on the cpu backend"),
    ],
)
def test_a_config_to_measure_first_that_is_not_legal_on_its_slot_is_a_422_naming_the_slot_and_knob(
    http: httpx.Client, first: dict[str, Any], backend: str, field: str, rule: str
) -> None:
    body = {"shape": SHAPE, "layers": ["qkv_fprop", "proj_fprop"], "backend": backend, "measure_first": first}
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    (error,) = errors_of(response)
    assert error["field"] == field and rule in error["rule"], error


def test_a_body_that_is_not_json_is_a_4xx(http: httpx.Client) -> None:
    response = http.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500
    errors_of(response)


def test_unknown_and_malformed_ids_are_404_and_422(http: httpx.Client) -> None:
    missing = http.get(f"/v1/jobs/{UNKNOWN_JOB}")
    assert missing.status_code == 404 and errors_of(missing)[0]["field"] == "job_id"
    malformed = http.get("/v1/jobs/not-a-uuid/trials")
    assert malformed.status_code == 422 and errors_of(malformed)[0]["field"] == "job_id"
    no_route = http.get("/v1/nothing")
    assert no_route.status_code == 404 and errors_of(no_route)[0]["field"] == "path"


def test_a_wrong_method_is_405_with_every_allowed_method(http: httpx.Client) -> None:
    response = http.delete("/v1/jobs")
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) >= {"GET", "POST"}
    assert errors_of(response)[0]["field"] == "method"


def test_jobs_are_paginated_newest_first(http: httpx.Client) -> None:
    ids = [submit(http)["id"] for _ in range(3)]
    first = http.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["items"]] == ids[::-1][:2]
    assert first["next_offset"] == 2 and first["total"] >= 3
    rest = http.get("/v1/jobs", params={"limit": 2, "offset": first["next_offset"]}).json()
    assert rest["items"][0]["id"] == ids[0]
    too_big = http.get("/v1/jobs", params={"limit": 5000})
    assert too_big.status_code == 422 and errors_of(too_big)[0]["field"] == "limit"


def test_cancel_then_cancel_again_is_a_409(http: httpx.Client) -> None:
    job = submit(http)
    cancelled = http.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = http.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409
    assert "already cancelled" in errors_of(again)[0]["rule"]


def test_events_stream_progress_then_done(http: httpx.Client) -> None:
    job = submit(http)
    http.post(f"/v1/jobs/{job['id']}/cancel")
    with http.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event:")]
    assert events == ["progress", "done"]
    assert http.get(f"/v1/jobs/{UNKNOWN_JOB}/events").status_code == 404


def test_trials_of_a_job_are_paginated(http: httpx.Client) -> None:
    job = submit(http)
    page = http.get(f"/v1/jobs/{job['id']}/trials", params={"limit": 10}).json()
    assert page == {"items": [], "total": 0, "limit": 10, "offset": 0, "next_offset": None}


def test_an_unmeasured_shape_gets_the_nearest_preset_marked_as_not_measured(http: httpx.Client) -> None:
    query = {"hidden": 8192, "tp": 4, "mbs": 1, "seq": 8192, "gpu": "NVIDIA H100 80GB HBM3"}
    best = http.get("/v1/best", params=query).json()
    assert best["measured"] is False and best["results"] == []
    assert best["nearest"]["source"].startswith("nvidia:")
    assert best["nearest_layers"] and all(layer["measurement"] is None for layer in best["nearest_layers"])
    nemo = http.get("/v1/presets", params=query)
    assert nemo.headers["x-autotune-measured"] == "false"
    assert nemo.text.startswith("# NOT MEASURED")
    assert yaml.safe_load(nemo.text)
    te = http.get("/v1/presets", params={**query, "format": "te"}).json()
    assert te["measured"] is False and te["nearest"]["source"] == best["nearest"]["source"] and te["ub_cfgs"]
    bridge = http.get("/v1/presets", params={**query, "format": "bridge"})
    assert bridge.headers["x-autotune-measured"] == "false" and bridge.text.startswith("# NOT MEASURED")
    assert bridge.headers["content-type"].startswith("text/x-python")
    module = parse_bridge(bridge.text)
    assert bridge.headers["content-disposition"].endswith(f'"{bridge_file_name(module)}"')
    assert preset_json(module)["ub_cfgs"] == te["ub_cfgs"]


def test_each_shape_filter_given_narrows_the_measured_answer(http: httpx.Client, idle_service: Service) -> None:
    """Two models of one (hidden, tp, mbs, seq): a filter left out matches both, and a filter agrees with a
    stored shape that spells the same size another way (ffn_hidden=4*hidden where it was left unset)."""
    plain = ModelShape(hidden=64, tp=2, seq=128)
    gated = ModelShape(hidden=64, tp=2, seq=128, ffn_hidden=192, gated=True)
    engine = storage.create_engine_for(url=idle_service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            for shape in (plain, gated):
                config, measurement = {"method": "bulk"}, {"overlap_ms": 1.0, "valid": True}
                storage.upsert_best(
                    session=session,
                    gpu="NVIDIA H200",
                    shape=shape,
                    slot="qkv_fprop",
                    config=config,
                    measurement=measurement,
                )
    finally:
        engine.dispose()

    def keys(**filters: Any) -> list[str]:
        answer = http.get("/v1/best", params={"hidden": 64, "tp": 2, "seq": 128, **filters}).json()
        return sorted(group["shape_key"] for group in answer["results"])

    assert keys() == keys(num_heads=8, cp=1, dtype="bf16") == sorted([plain.key, gated.key])  # both agree with these
    assert keys(gated="true") == keys(ffn_hidden=192) == keys(ffn_hidden=192, gated="true") == [gated.key]
    assert keys(gated="false") == keys(ffn_hidden=256) == [plain.key]
    assert keys(ffn_hidden=192, gated="false") == keys(dtype="fp8") == keys(gpu="A100") == []


def test_best_carries_each_slots_te_exact_winner_or_null_and_the_exports_follow_it(
    http: httpx.Client, idle_service: Service
) -> None:
    shape = ModelShape(hidden=64, tp=2, seq=256)
    ours = OverlapConfig(method="ring_exchange", use_ce=True, gemm="triton", num_max_streams=1)
    exact = OverlapConfig(method="ring_exchange", use_ce=True, gemm="cublas", num_max_streams=2)
    times, exact_times = measurement(1.0).to_dict(), measurement(1.2).to_dict()
    engine = storage.create_engine_for(url=idle_service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            for slot, te_exact in (("qkv_fprop", exact), ("fc1_fprop", None)):
                storage.upsert_best(
                    session=session,
                    gpu="NVIDIA H200",
                    shape=shape,
                    slot=slot,
                    config=ours.to_dict(),
                    measurement=times,
                    te_exact_config=None if te_exact is None else te_exact.to_dict(),
                    te_exact_measurement=None if te_exact is None else exact_times,
                )
    finally:
        engine.dispose()
    query = {"hidden": 64, "tp": 2, "seq": 256}
    (group,) = http.get("/v1/best", params=query).json()["results"]
    layers = {layer["slot"]: layer for layer in group["layers"]}
    assert OverlapConfig.from_dict(layers["qkv_fprop"]["config"]) == ours
    assert OverlapConfig.from_dict(layers["qkv_fprop"]["te_exact"]["config"]) == exact
    assert layers["qkv_fprop"]["te_exact"]["measurement"] == exact_times
    assert layers["fc1_fprop"]["te_exact"] is None
    te = http.get("/v1/presets", params={**query, "format": "te"}).json()
    assert te["measurements"]["qkv_fprop"]["overlap_ms"] == 1.2 and "fc1_fprop" not in te["measurements"]
    assert "measured with" not in te["notes"]["qkv_fprop"]
    assert te["notes"]["fc1_fprop"].startswith(NO_TE_EXACT)
    nemo = http.get("/v1/presets", params=query).text
    assert "# qkv_fprop: TE-exact: overlap 1.2 ms" in nemo and f"# fc1_fprop: {NO_TE_EXACT}" in nemo
    mine = http.get("/v1/presets", params={**query, "format": "ours"})
    assert mine.status_code == 200 and mine.headers["content-type"].startswith("application/yaml")
    assert 'filename="ours_nvidia-h200_' in mine.headers["content-disposition"]
    loaded = load_ours(mine.text)
    assert (loaded.shape, loaded.gpu) == (shape, "NVIDIA H200")
    assert {s.value: e.config for s, e in loaded.slots.items()} == {"qkv_fprop": ours, "fc1_fprop": ours}
    assert loaded.slots[Slot.QKV_FPROP].measured["overlap_ms"] == 1.0 and not loaded.te_exact(Slot.QKV_FPROP)
    unmeasured = http.get("/v1/presets", params={"hidden": 64, "tp": 2, "seq": 512, "format": "ours"})
    assert unmeasured.status_code == 404 and errors_of(unmeasured)[0]["field"] == "format"


def test_a_shape_query_te_cannot_run_is_a_422(http: httpx.Client) -> None:
    response = http.get("/v1/best", params={"hidden": 63, "tp": 2, "seq": 32})
    assert response.status_code == 422 and errors_of(response)[0]["field"] == "hidden"
    response = http.get("/v1/presets", params={"hidden": 64, "tp": 2, "seq": 32, "format": "pdf"})
    assert response.status_code == 422 and errors_of(response)[0]["field"] == "format"


def test_a_worker_registers_with_its_inventory_and_is_listed(http: httpx.Client) -> None:
    gpu = {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "nvlink_active": 18, "sm_count": 132}
    body = {"name": "w", "host": "h", "backend": "cuda", "gpus": [gpu], "gpu_model": "NVIDIA H200", "n_gpus": 1}
    worker = http.post("/v1/workers", json=body)
    assert worker.status_code == 201, worker.text
    listed = {w["id"]: w for w in http.get("/v1/workers").json()}
    assert listed[worker.json()["id"]]["gpus"][0]["sm_count"] == 132


def test_a_result_needs_exactly_one_of_measurements_and_failure(http: httpx.Client) -> None:
    body = {"name": "w", "host": "h", "backend": "cpu"}
    worker = http.post("/v1/workers", json=body).json()
    mine = {"Authorization": f"Bearer {worker['secret']}", "X-Lease-Nonce": "n"}
    response = http.post(f"/v1/workers/{worker['id']}/trials/1/result", json={}, headers=mine)
    assert response.status_code == 422
    assert errors_of(response)[0]["field"] == "measurements"
    lost = http.post(f"/v1/workers/{worker['id']}/trials/1/result", json={"failure": "boom"}, headers=mine)
    assert lost.status_code == 404  # no trial 1 in a database without running jobs


def test_without_a_token_the_controller_refuses_to_start() -> None:
    with pytest.raises(InputError) as missing:
        Settings(_env_file=None, token=None).check_auth()
    assert missing.value.field == "token"
    with pytest.raises(InputError) as exposed:
        Settings(no_auth=True, host="0.0.0.0").check_auth()
    assert exposed.value.field == "host"
    Settings(no_auth=True, host="127.0.0.1").check_auth()


def test_a_scheduler_lease_shorter_than_a_few_passes_is_refused() -> None:
    with pytest.raises(InputError) as short:
        Settings(scheduler_interval_s=1.0, leader_ttl_s=2.0).check_scheduler()
    assert short.value.field == "leader_ttl_s" and "scheduler_interval_s" in short.value.rule
    Settings(scheduler_interval_s=1.0, leader_ttl_s=4.0).check_scheduler()


def test_settings_survive_the_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """How `serve --workers N` configures its API processes: what one process set, the others read back."""
    settings = Settings(
        db_url="sqlite:////tmp/x.db", token="s3cret", worker_token="w0rker", no_auth=False, port=8123, leader_ttl_s=7.5
    )
    env = settings.to_environment()
    assert env["AUTOTUNE_TOKEN"] == "s3cret" and env["AUTOTUNE_WORKER_TOKEN"] == "w0rker"
    assert env["AUTOTUNE_SCHEDULER"] == "true"
    for name in [n for n in os.environ if n.startswith("AUTOTUNE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == settings


def test_healthz_says_this_process_schedules(idle_service: Service, anonymous: httpx.Client) -> None:
    health = idle_service.wait_until(
        lambda: (h := anonymous.get("/healthz").json())["leading"] and h, timeout_s=10, what="the scheduler lease"
    )
    assert health["scheduler"]
    assert health["leader"].count(":") == 2  # host:pid:random


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_spec_violation(idle_service: Service, tmp_path: Path) -> None:
    """Bounded fuzzing of every operation (the event stream is left out: it streams until the job ends),
    with bodies and queries that also carry non-finite numbers, lone surrogates and odd Unicode
    (tests/schemathesis_hooks.py): none of them may get a 5xx."""
    command = [
        str(Path(sys.executable).with_name("schemathesis")),
        "run",
        f"{idle_service.url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",  # schema-valid shapes may still break TE's divisibility rules: a 422
        "--max-examples",
        str(SCHEMATHESIS_EXAMPLES),
        "--header",
        f"Authorization: Bearer {idle_service.token}",
        "--request-timeout",
        "10",
        "--exclude-path-regex",
        "/events$",
        "--generation-database",
        "none",
        "--seed",
        "5",
        "--no-color",
    ]
    hooks = {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(Path(__file__).parent)}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, **hooks}
    )
    assert result.returncode == 0, result.stdout[-6000:]


def test_a_consumers_winner_comes_with_its_switches_in_best_presets_and_the_job_view(
    http: httpx.Client, idle_service: Service
) -> None:
    """Stored verdicts with both dgrad modes measured: megatron gets both slots in one mode and its flags,
    te-modules each slot's own; the files say so in their headers; a job names its consumer."""
    shape = ModelShape(hidden=64, tp=2, seq=1024)
    bulk, ring = OverlapConfig(method="bulk", num_sm=16), OverlapConfig(method="ring_exchange")
    engine = storage.create_engine_for(url=idle_service.db_url)
    try:
        with storage.session_factory(engine=engine)() as session:
            # With its wgrad (bulk 1.1 ms, its GEMM alone 0.86 ms), qkv is faster bulk, fc1 far faster
            # reduce-scatter: mixed per module (te-modules); both reduce-scatter jointly (megatron: 3.77 ms against
            # 4.5 for both bulk, and 4.06 with qkv's layer switched off, which costs qkv_fprop 0.4 ms).
            times = {
                "qkv_dgrad": {Mode.BULK: 0.7, Mode.RS_DGRAD: 1.05},
                "fc1_dgrad": {Mode.BULK: 1.6, Mode.RS_DGRAD: 1.0},
                "qkv_wgrad": {Mode.BULK: 1.1, Mode.OFF: 1.4},
                "fc1_wgrad": {Mode.BULK: 1.1, Mode.OFF: 1.4},
                "qkv_fprop": {Mode.OVERLAP: 1.0, Mode.OFF: 1.4},
                "fc1_fprop": {Mode.OVERLAP: 1.0, Mode.OFF: 1.4},
            }
            configs = {Mode.BULK: bulk, Mode.RS_DGRAD: ring, Mode.OVERLAP: ring, Mode.OFF: OverlapConfig(method="none")}
            for slot, by_mode in times.items():
                modes = {
                    mode: Measured(config=configs[mode], measurement=measurement(ms)) for mode, ms in by_mode.items()
                }
                best = min((m for k, m in modes.items() if k != Mode.OFF), key=lambda m: m.measurement.overlap_ms)
                outcome = SlotOutcome(
                    slot=Slot(slot),
                    best=best.config,
                    best_measurement=best.measurement,
                    best_overlap=best.config,
                    best_overlap_measurement=best.measurement,
                    te_default_measurement=None,
                    te_exact=best.config,
                    te_exact_measurement=best.measurement,
                    modes=modes,
                    spread=0.01,
                    n_trials=10,
                    n_failed=0,
                )
                storage.record_winner(session=session, gpu="NVIDIA H200", shape=shape, outcome=outcome)
    finally:
        engine.dispose()
    query = {"hidden": 64, "tp": 2, "seq": 1024}
    (group,) = http.get("/v1/best", params={**query, "consumer": "megatron"}).json()["results"]
    choice = group["consumer"]
    assert choice["switches"] == {"flags": ["--tp-comm-overlap", "--tp-comm-overlap-rs-dgrad"], "config": {}}
    assert {s: e["mode"] for s, e in choice["slots"].items() if "dgrad" in s} == {
        "qkv_dgrad": "rs_dgrad",
        "fc1_dgrad": "rs_dgrad",
    }
    assert choice["slots"]["qkv_wgrad"] == {"mode": "no_comm", "config": None, "measurement": None}
    assert choice["alternatives"][0]["label"] == "tp_comm_overlap_rs_dgrad=true"
    assert (
        choice["alternatives"][0]["total_ms"]
        < next(a for a in choice["alternatives"] if a["label"] == "defaults")["total_ms"]
    )
    (own,) = http.get("/v1/best", params={**query, "consumer": "te-modules"}).json()["results"]
    assert {s: e["mode"] for s, e in own["consumer"]["slots"].items() if "dgrad" in s} == {
        "qkv_dgrad": "bulk",
        "fc1_dgrad": "rs_dgrad",
    }
    assert http.get("/v1/best", params=query).json()["results"][0]["consumer"] is None
    nemo = http.get("/v1/presets", params=query).text  # nemo: made for megatron by default
    assert "# autotune-switches (megatron): tp_comm_overlap_rs_dgrad=true" in nemo
    assert parse_nemo(nemo).configs[Slot.QKV_DGRAD].method == Method.RING_EXCHANGE
    te = http.get("/v1/presets", params={**query, "format": "te"}).json()  # te: te-modules by default
    assert te["consumer"] == "te-modules" and te["ub_cfgs"]["qkv_dgrad"]["method"] == "bulk"
    assert te["switches"]["modules"]["fc1"]["ub_overlap_rs_dgrad"] is True
    layer = http.get("/v1/presets", params={**query, "format": "te", "consumer": "te-layer"}).json()
    assert layer["switches"]["transformer_layer"]["ub_overlap_rs_dgrad"] is True
    bad = http.get("/v1/presets", params={**query, "consumer": "megatorn"})
    assert bad.status_code == 422 and errors_of(bad)[0]["field"] == "consumer"
    accepted = http.post("/v1/jobs", json={"shape": {"hidden": 64, "tp": 2, "seq": 1024}, "consumer": "bridge"})
    assert accepted.status_code == 202
    job = http.get(f"/v1/jobs/{accepted.json()['id']}").json()
    assert job["consumer"] == "bridge" and job["consumer_choice"] is None  # nothing decided yet
    refused = http.post("/v1/jobs", json={"shape": {"hidden": 64, "tp": 2, "seq": 1024}, "consumer": "nemo"})
    assert refused.status_code == 422 and errors_of(refused)[0]["field"] == "consumer"


def test_a_cpu_job_past_the_cpu_backends_size_limit_is_refused_naming_it(http: httpx.Client) -> None:
    """A cuda job of that size is accepted: a GPU worker can take it."""
    large = {"hidden": 8192, "tp": 2, "seq": 8192}
    refused = http.post("/v1/jobs", json={"shape": large, "backend": "cpu"})
    assert refused.status_code == 422, refused.text
    (item,) = errors_of(refused)
    assert item["field"] == "shape" and item["rule"].startswith("is too large for the CPU backend: its largest GEMM")
    assert "at most 2 Gi (h1024 tp2 seq1024)" in item["rule"] and "GPU worker (--backend cuda)" in item["rule"]
    accepted = http.post("/v1/jobs", json={"shape": large, "backend": "cuda"})
    assert accepted.status_code == 202, accepted.text
    http.post(f"/v1/jobs/{accepted.json()['id']}/cancel")
    at_the_limit = http.post("/v1/jobs", json={"shape": {"hidden": 1024, "tp": 2, "seq": 1024}, "backend": "cpu"})
    assert at_the_limit.status_code == 202, at_the_limit.text
    http.post(f"/v1/jobs/{at_the_limit.json()['id']}/cancel")
