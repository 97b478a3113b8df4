"""`bench/scheduler_pass.py` times an idle scheduler pass on SQLite and PostgreSQL; the committed figure is
bench/results/scheduler_pass.json."""

from __future__ import annotations

import json

import pytest

from bench import scheduler_pass

pytest_plugins = ("conftest_storage",)  # db_url: a fresh SQLite file or PostgreSQL database


def test_an_idle_pass_is_timed_on_each_database(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = scheduler_pass.main(["--db", db_url, "--passes", "20", "--warmup", "2"])
    assert result["database"] == db_url.split(":", 1)[0].split("+", 1)[0]
    assert result["passes"] == 20 and 0 < result["cpu_ms_per_idle_pass"] < 1000
    assert json.loads(capsys.readouterr().out)["cpu_ms_per_idle_pass"] == result["cpu_ms_per_idle_pass"]


def test_the_committed_figure_names_its_commit() -> None:
    data = json.loads((scheduler_pass.REPO / "bench" / "results" / "scheduler_pass.json").read_text())
    assert data["environment"]["commit"] and data["database"] == "sqlite" and data["cpu_ms_per_idle_pass"] > 0


def test_bad_usage_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        scheduler_pass.main(["--passes", "0"])
    assert stopped.value.code == 2 and "--passes: must be at least 1" in capsys.readouterr().err
