"""The worker: what it registers, and that a config which breaks the TP group costs one trial, not the worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from autotune.cli.inventory import gpu_inventory, worker_body
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape
from overlap_runtime.te_backend import te_version

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service, sqlite_url


def test_a_cpu_worker_registers_no_gpus() -> None:
    body = worker_body(backend="cpu", name="w")
    assert body | {"host": "h"} == {
        "name": "w",
        "host": "h",
        "backend": "cpu",
        "gpus": [],
        "gpu_model": None,
        "n_gpus": 0,
        "te_version": te_version(),  # whether TransformerEngine is installed: None on a host without it
    }


def test_a_cuda_worker_without_a_driver_is_told_why() -> None:
    try:
        gpus = gpu_inventory()
    except InputError as e:
        assert e.field == "backend" and "NVML" in e.rule
        return
    assert all(g["name"] and g["memory_total_mib"] > 0 for g in gpus)  # a GPU machine: the inventory is real


@pytest.mark.slow
def test_hung_trials_are_reported_and_the_worker_goes_on(make_service: Callable[..., Service], sqlite_url: str) -> None:
    """A trial timeout far below any real trial makes every config "hang": each is killed and reported failed,
    the worker keeps claiming, and the slot (then the job) fails saying no config ran correctly.  A cuda job
    submitted beside it is never handed to this CPU worker."""
    service = make_service(db_url=sqlite_url)
    service.start_controller()
    worker = service.start_worker(extra=["--trial-timeout-s", "0.01"])
    with service.client() as client:
        shape = ModelShape(hidden=64, tp=2, seq=32)
        cuda_job = client.submit(shape=shape, layers=["qkv_fprop"], n_trials=2, backend="cuda").id
        job_id = client.submit(shape=shape, layers=["qkv_fprop"], n_trials=2, backend="cpu").id
        job = service.wait_for_job(job_id)
        trials = client.all_trials(job_id)
        assert job.status == "failed" and "qkv_fprop" in job.error, job
        assert len(trials) >= 2 and all(t.state == "failed" and t.error.startswith("hung") for t in trials)
        assert worker.process.poll() is None, "the worker died"
        assert client.job(cuda_job).status == "queued"
        (registered,) = client.workers()
        assert registered.status != "lost"
