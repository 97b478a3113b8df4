"""The overlap benchmark's dry run on CPU (gloo, a tiny shape): two runs, each slot's best scored against its
own problem's baselines timed in its rounds, the median hidden with an interval, and the commit recorded."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from compiled import ROOT, dry_run

from overlap_runtime.config import OverlapConfig, problem
from overlap_runtime.shape import ModelShape, Slot

BENCH = "bench/overlap_bench.py"
TINY = ModelShape(tp=2, mbs=1, hidden=64, seq=64, ffn_hidden=128)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench") / "dry.json"
    return dry_run(BENCH, out), out


def collective_of(slot: str, config: dict[str, Any]) -> str:
    return problem(TINY, Slot(slot), OverlapConfig.from_dict(config).method).collective.value


def test_the_result_records_the_commit_that_produced_it(result: tuple[dict[str, Any], Path]) -> None:
    data, _ = result
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert data["environment"]["commit"] == head.stdout.strip()
    assert all(run["environment"]["commit"] == head.stdout.strip() for run in data["runs"])


def test_each_best_is_scored_against_its_own_problem_timed_in_its_rounds(result: tuple[dict[str, Any], Path]) -> None:
    data, _ = result
    assert len(data["runs"]) == 2 and data["dry_run"]
    for run in data["runs"]:
        assert {r["slot"] for r in run["records"]} == {"proj_fprop", "qkv_dgrad"}
        for record in run["records"]:
            again = record["best_again"]
            assert again["config"] == record["best"]["config"]
            baselines = again["baselines"]
            assert baselines["source"] == "same_rounds"
            assert record["collective"] == baselines["collective"] == collective_of(record["slot"], again["config"])
            timed = ("gemm", "gemm_ours", "comm", "serial")
            rounds = [len(again["positions"]), *(len(baselines[n]["positions"]) for n in timed)]
            assert rounds == [3, 3, 3, 3, 3]
            for name in ("comm", "serial"):
                assert record[f"{name}_ms"] == statistics.median(baselines[name]["samples"])
            # the faster of the two GEMMs alone (docs/measurement.md, "The share hidden and its interval")
            assert record["gemm_ms"] == min(statistics.median(baselines[n]["samples"]) for n in ("gemm", "gemm_ours"))
            lo, hi = record["hidden_ci"]
            assert lo <= hi
            for row in record["configs"]:  # the grid: cached baselines of each row's own problem
                if "error" not in row:
                    assert row["baselines"]["source"] == "cached"
                    assert row["baselines"]["collective"] == collective_of(record["slot"], row["config"])


def test_the_summary_is_the_median_over_slots_of_the_runs_mean_with_an_interval(
    result: tuple[dict[str, Any], Path],
) -> None:
    data, _ = result
    per_slot: dict[str, list[float]] = {}
    for run in data["runs"]:
        for r in run["records"]:
            per_slot.setdefault(f"{r['shape']}/{r['slot']}", []).append(r["hidden"])
        hidden = [r["hidden"] for r in run["records"]]
        assert run["summary"]["hidden_median"]["value"] == pytest.approx(statistics.median(hidden))
        assert run["summary"]["hidden_worst"]["value"] == pytest.approx(min(hidden))
    summary = data["summary"]
    assert summary["runs"] == 2 and summary["slots"] == 2
    pooled = [statistics.fmean(v) for v in per_slot.values()]
    assert summary["hidden_median"]["value"] == pytest.approx(statistics.median(pooled))
    lo, hi = summary["hidden_median"]["ci"]
    assert lo <= hi
    assert "hidden_median_ci_low>=0.90" in summary["targets"]


def test_two_result_files_merge_into_one_with_every_run_kept(
    result: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    _, out = result
    merged = tmp_path / "merged.json"
    proc = subprocess.run(
        [sys.executable, BENCH, "--merge", str(out), str(out), "--out", str(merged)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(merged.read_text())
    assert len(data["runs"]) == 4 and data["summary"]["runs"] == 4
    assert "median hidden" in proc.stdout
