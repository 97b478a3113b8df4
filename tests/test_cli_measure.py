"""`autotune measure` as a user runs it: one JSON object on success, exit code 2 and a named field on bad input.

A measurement runs the console script.  Bad input runs the same app in-process (typer's runner), which ends
errors where the console script does: it is refused before any TP group starts, so a subprocess per case would
add only its own start-up (`tests/test_cli_bad_input.py` runs refusals through the console script itself)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.app import app

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
BASE = ["measure", "--hidden", "64", "--tp", "2", "--seq", "32", "--backend", "cpu", "--repeats", "3"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AUTOTUNE, *args], capture_output=True, text=True, timeout=120)


def test_measure_prints_the_measurement_contract_as_json() -> None:
    done = run(*BASE, "--layer", "proj_fprop", "--method", "pipeline", "--num-splits", "2", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    for field in ("gemm_ms", "comm_ms", "serial_ms", "overlap_ms", "exposed_ms", "hidden_frac", "rel_err", "cv"):
        assert isinstance(record[field], float), field
    assert record["valid"] is True
    assert record["layer"] == "proj_fprop"
    assert record["shape"]["hidden"] == 64 and record["shape"]["ffn_hidden"] == 256
    assert record["config"] == {"method": "pipeline", "num_splits": 2}
    # The times against the raw repeats printed with them (--repeats 3); exposed_ms and hidden_frac are
    # definitions over these fields, checked by hand in tests/test_measurement.py.
    assert record["repeats"] == len(record["samples"]) == 3
    assert record["overlap_ms"] == statistics.median(record["samples"])
    assert record["cv"] == pytest.approx(statistics.pstdev(record["samples"]) / statistics.fmean(record["samples"]))


def test_measure_takes_the_first_gemm_order_and_no_margin_as_flags() -> None:
    flags = ["--num-splits", "2", "--pipeline-rs-overlap-first-gemm", "--no-sm-margin"]
    done = run(*BASE, "--layer", "proj_fprop", "--method", "pipeline", *flags, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["config"] == {
        "method": "pipeline",
        "num_splits": 2,
        "pipeline_rs_overlap_first_gemm": True,
    }


def test_measure_takes_a_whole_config_as_json_as_best_prints_it() -> None:
    config = {"method": "pipeline", "num_splits": 2, "pipeline_rs_overlap_first_gemm": True}
    done = run(*BASE, "--layer", "proj_fprop", "--config", json.dumps(config), "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["valid"] is True
    assert record["config"] == config


def test_measure_runs_an_fp8_pipeline_through_its_fp8_buffer() -> None:
    done = run(*BASE, "--layer", "proj_fprop", "--method", "pipeline", "--num-splits", "2", "--fp8-buf", "--dtype",
               "fp8", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["valid"] is True and record["shape"]["dtype"] == "fp8"
    assert record["config"] == {"method": "pipeline", "num_splits": 2, "fp8_buf": True}


def test_measure_takes_a_gated_context_parallel_shape() -> None:
    done = run(*BASE, "--layer", "fc1_fprop", "--method", "ring_exchange", "--gated", "--cp", "2", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["valid"] is True
    assert record["shape"]["gated"] is True and record["shape"]["cp"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layer", "qkv_fprop", "--method", "pipeline"], "method: pipeline splits"),
        (["--layer", "qkv_fpropp", "--method", "none"], "layer: must be one of"),
        (["--layer", "qkv_fprop", "--method", "fastest"], "method: must be one of"),
        (["--layer", "proj_fprop", "--method", "pipeline", "--num-splits", "3"], "num_splits"),
        (["--layer", "proj_fprop", "--method", "bulk"], "method: bulk needs"),
        (["--layer", "qkv_fprop", "--method", "ring_exchange", "--num-sm", "4"], "num_sm: has no meaning on the cpu"),
        (["--layer", "qkv_fprop", "--method", "ring_exchange", "--fused"], 'fused: needs gemm="triton"'),
        (["--layer", "qkv_fprop"], "method: is required (or give the whole config with --config)"),
        (["--layer", "qkv_fprop", "--config", "{method: none}"], "config: must be a JSON object"),
        (["--layer", "qkv_fprop", "--config", '["none"]'], "config: must be a JSON object"),
        (["--layer", "qkv_fprop", "--config", '{"method": "none"}', "--method", "none"], "method: give either"),
        (["--layer", "qkv_fprop", "--config", '{"method": "none"}', "--no-sm-margin"], "set_sm_margin: give either"),
        (["--layer", "proj_fprop", "--method", "pipeline", "--gemm-priority", "-1"], "gemm_priority: has no meaning"),
        (["--layer", "proj_fprop", "--method", "pipeline", "--fp8-buf"], "fp8_buf: needs FP8 GEMMs"),
        (["--layer", "proj_fprop", "--config", '{"method": "pipeline", "num_splitz": 2}'], "num_splitz: is not a"),
    ],
)
def test_bad_arguments_exit_2_naming_the_field(args: list[str], message: str) -> None:
    done = CliRunner().invoke(app, [*BASE, *args, "--json"])
    assert done.exit_code == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: ")
    assert message in done.stderr


def test_bad_shape_exits_2() -> None:
    args = ["measure", "--hidden", "65", "--tp", "2", "--seq", "32", "--layer", "qkv_fprop", "--method", "none"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2
    assert "hidden: must be divisible by tp=2" in done.stderr
