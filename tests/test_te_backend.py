"""The te backend where TransformerEngine is missing (every CPU machine and CI): each te command fails at once
with exit 2 and says what to install; a worker's inventory says whether TE is there; and a real controller
places te jobs only on te workers whose inventory reports TE (workers registered over the REST API)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import storage
from autotune.cli.app import app
from autotune.cli.inventory import worker_body
from overlap_runtime.config import check_config, problem
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from overlap_runtime.te_backend import te_version

pytest_plugins = ("conftest_service",)  # make_service, sqlite_url

REPO = Path(__file__).resolve().parents[1]
SHAPE = ModelShape(hidden=512, tp=2, seq=512)
SHAPE_ARGS = ["--hidden", "512", "--tp", "2", "--seq", "512"]
without_te = pytest.mark.skipif(
    te_version() is not None, reason="TE is installed here: the refusal needs a host without"
)


def _says_what_to_install(output: str) -> None:
    assert "error: backend: the te backend needs TransformerEngine" in output
    assert "pip install --no-build-isolation 'transformer-engine[pytorch]'" in output
    assert "NGC PyTorch container" in output and "bench/te_install.sh" in output


@without_te
@pytest.mark.parametrize(
    "args",
    [
        ["measure", "--layer", "qkv_fprop", *SHAPE_ARGS, "--method", "ring_exchange", "--backend", "te"],
        ["tune", *SHAPE_ARGS, "--layers", "qkv_fprop", "--backend", "te", "--db", "sqlite:///unused.db"],
        ["worker", "--controller", "http://127.0.0.1:9", "--backend", "te", "--token", "t"],
    ],
    ids=["measure", "tune", "worker"],
)
def test_without_te_a_te_command_fails_at_once_with_exit_2_and_what_to_install(
    args: list[str], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    start = time.monotonic()
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    _says_what_to_install(result.output)
    assert time.monotonic() - start < 10  # no process group started, no controller called
    assert not (tmp_path / "unused.db").exists()


@without_te
def test_the_inventory_says_te_is_missing_and_a_te_worker_cannot_register_without_it() -> None:
    assert worker_body(backend="cpu")["te_version"] is None
    with pytest.raises(InputError, match="transformer-engine") as info:
        worker_body(backend="te")
    assert info.value.field == "backend"


def _gpu_worker(name: str, *, backend: str, te: str | None) -> dict[str, Any]:
    """A worker's registration as `worker_body` writes it on a 2 x H200 host."""
    gpus = [{"index": i, "name": "NVIDIA H200", "sm_count": 132, "nvlink_active": 18} for i in range(2)]
    return {
        "name": name,
        "host": "gpu-host",
        "backend": backend,
        "gpus": gpus,
        "gpu_model": "NVIDIA H200",
        "n_gpus": 2,
        "te_version": te,
    }


def test_te_jobs_run_only_on_te_workers_whose_inventory_reports_te(
    make_service: Callable[..., Any], sqlite_url: str
) -> None:
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    with service.client() as client:
        job = client.submit(shape=SHAPE, layers=["qkv_fprop"], n_trials=6, backend="te", gpu="h200")
        lacking = client.register(_gpu_worker("te-without-te", backend="te", te=None))
        cuda = client.register(_gpu_worker("cuda-with-te", backend="cuda", te="2.20.2"))
        time.sleep(2.0)  # twenty scheduler passes
        assert client.job(job.id).status == "queued"  # no worker can run it yet
        assert client.claim(lacking) is None and client.claim(cuda) is None

        ready = client.register(_gpu_worker("te-with-te", backend="te", te="2.20.2"))
        claim = service.wait_until(lambda: client.claim(ready), timeout_s=30, what="a trial for the TE worker")
        assert (claim.job_id, claim.backend, claim.slot) == (job.id, "te", "qkv_fprop")
        for config in claim.proposal.to_proposal().configs:  # the te space: TE's keys only
            check_config(config, problem(SHAPE, Slot.QKV_FPROP, config.method), backend="te")
        running = client.job(job.id)
        assert (running.status, running.gpu) == ("running", "NVIDIA H200")  # claims match the model's full name
        service.wait_until(
            lambda: any(t.state == "waiting" for t in client.all_trials(job.id)), timeout_s=30, what="a waiting trial"
        )
        assert client.claim(lacking) is None and client.claim(cuda) is None  # still never theirs
        assert {w.name: w.te_version for w in client.workers()} == {
            "te-without-te": None,
            "cuda-with-te": "2.20.2",
            "te-with-te": "2.20.2",
        }
    engine = storage.create_engine_for(url=sqlite_url)
    with storage.session_factory(engine=engine)() as session:
        (study,) = storage.list_layer_studies(session=session, job_id=job.id)
    engine.dispose()
    assert ":NVIDIA H200 [te]:" in study.optuna_study_name  # TE's measurements never share our runtime's study


@without_te
def test_te_check_writes_why_te_does_not_import_and_exits_1(tmp_path: Any) -> None:
    out = tmp_path / "te_check.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "te_check.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(out.read_text())
    assert report["te"] == {
        "imports": False,
        "version": None,
        "error": "ModuleNotFoundError: No module named 'transformer_engine'",
    }
    assert report["te_env"] == {"UB_SKIPMC": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "0"}
    assert report["env"]["torch"] and report["shape"]["hidden"] == 8192
    assert "error: import transformer_engine.pytorch failed" in done.stderr
