"""The service's studies are plain Optuna RDB studies: after a finished CPU-backend job, Optuna's own API
(`optuna.load_study` on the service's storage URL) and optuna-dashboard's server, started on the same URL,
see every trial the service ran, with its value and parameters (SQLite and PostgreSQL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import optuna
import pytest

from autotune.tuner.history import DUPLICATE_OF
from autotune.tuner.params import trial_params
from autotune.tuner.studies import NAME_PREFIX
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import slot_space

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service, db_url

SHAPE = ModelShape(hidden=64, tp=2, seq=32)
DASHBOARD = str(Path(sys.executable).with_name("optuna-dashboard"))


def finished_job(make_service: Callable[..., Service], db_url: str) -> tuple[Service, str]:
    service = make_service(db_url=db_url)
    service.start_controller()
    service.start_worker()
    with service.client() as client:
        job = client.submit(shape=SHAPE, layers=["qkv_fprop", "proj_fprop"], n_trials=4, backend="cpu")
    assert service.wait_for_job(job.id).status == "succeeded"
    return service, job.id


@pytest.mark.slow
def test_optuna_loads_the_services_studies_with_their_trials(
    make_service: Callable[..., Service], db_url: str, tmp_path: Path
) -> None:
    service, job_id = finished_job(make_service, db_url)
    with service.client() as client:
        trials, job = client.all_trials(job_id), client.job(job_id)
    names = [n for n in optuna.study.get_all_study_names(storage=db_url) if n.startswith(NAME_PREFIX)]
    assert sorted(name.rsplit(":", 1)[1] for name in names) == ["proj_fprop", "qkv_fprop"]
    for name in names:
        slot = Slot(name.rsplit(":", 1)[1])
        assert SHAPE.key in name
        study = optuna.load_study(study_name=name, storage=db_url)
        space = slot_space(SHAPE, slot, backend="cpu", limits=None)
        ours = {t.optuna_trial_number: t for t in trials if t.slot == slot.value}
        seen = {t.number: t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
        measured_by_us = {n for n, t in ours.items() if t.state == "complete"}
        assert len(measured_by_us) >= 2 and measured_by_us <= set(seen)
        for number, frozen in seen.items():
            if number not in measured_by_us:  # a config proposed again: told the first one's time, not re-measured
                first = seen[frozen.user_attrs[DUPLICATE_OF]]
                assert (frozen.value, frozen.params) == (first.value, first.params)
                continue
            mine = ours[number]
            measured = zip(mine.config.configs, mine.measurement["measurements"], strict=True)  # type: ignore[index]
            # Optuna's value is the overlap time of the config its params walk to (a finalist batch's winner)
            told = [
                config
                for config, measurement in measured
                if frozen.value == pytest.approx(measurement["overlap_ms"])
                and frozen.params == trial_params(space, config.to_config())[0]
            ]
            assert told and frozen.params["method"] == told[0].method, (name, number)
        (winner,) = [s.best for s in job.slots if s.slot == slot.value]
        assert winner is not None and winner.final
        last = max(seen.values(), key=lambda t: t.number)  # the finalists' trial, told last, holds the winner
        assert ours[last.number].purpose == "finalist"
        assert last.params == trial_params(space, winner.config.to_config())[0]
    _dashboard_lists(db_url, names, tmp_path)


def _dashboard_lists(db_url: str, names: list[str], tmp_path: Path) -> None:
    """optuna-dashboard, pointed at the same URL as the README says, serves the studies and their trials."""
    from conftest_service import wait_until
    from ports import free_port

    port = free_port()
    log = (tmp_path / "dashboard.log").open("w")
    proc = subprocess.Popen(
        [DASHBOARD, db_url, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    try:

        def studies() -> list[dict[str, Any]] | None:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).json()["study_summaries"]
            except httpx.TransportError:
                return None

        summaries = wait_until(studies, timeout_s=60, what="optuna-dashboard to answer")
        by_name = {s["study_name"]: s for s in summaries}
        assert set(names) <= set(by_name)
        detail = httpx.get(f"http://127.0.0.1:{port}/api/studies/{by_name[names[0]]['study_id']}", timeout=5).json()
        assert len(detail["trials"]) == len(optuna.load_study(study_name=names[0], storage=db_url).trials)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
