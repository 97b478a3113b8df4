"""Our GEMM and the Gluon reduce-scatter kernel compile for Hopper on this machine, without a GPU
(`bench/sm90_compile.py`, in the Triton 3.6 environment that `make test` creates): no variant fails to compile,
spills a register or asks for more shared memory than an H100 or H200 gives one program.  Gluon has no
interpreter, so this is the only check of `ring_gluon` that runs without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import triton

REPO = Path(__file__).resolve().parents[1]
SM90_PYTHON = REPO / ".venv-sm90" / "bin" / "python"


def test_every_kernel_variant_compiles_for_sm90_without_spills_in_hopper_shared_memory(tmp_path: Path) -> None:
    assert SM90_PYTHON.exists(), "the Triton 3.6 environment is missing: make .venv-sm90/.installed"
    out = tmp_path / "sm90.json"
    done = subprocess.run(
        [str(SM90_PYTHON), "bench/sm90_compile.py", "--out", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["triton"].startswith("3.6.") and report["target"] == "sm_90a"
    kernels = report["kernels"]
    gluon = {f"ring_gluon {dtype} chunks={chunks}" for dtype in ("bf16", "fp8") for chunks in (2, 4)}
    assert gluon <= kernels.keys()
    assert sum(label.startswith("gemm ") for label in kernels) == 2 * 3 * 2  # dtypes x base configs x split tail
    for label, kernel in kernels.items():
        assert kernel["spill_bytes"] == 0, label
        assert 0 < kernel["shared_bytes"] <= report["shared_limit"], label
        assert 0 < kernel["registers"] <= 255, label
    # a split tail costs registers of its own: it is compiled where the label says so
    assert (
        kernels["gemm bf16 128x256x64_w8_s4_g8_st"]["registers"] > kernels["gemm bf16 128x256x64_w8_s4_g8"]["registers"]
    )


def test_the_compile_check_refuses_a_triton_without_the_gluon_it_is_written_in(tmp_path: Path) -> None:
    """In the project's own environment (the CPU machine's newer Triton) it says what it needs, as a usage error."""
    done = subprocess.run(
        [sys.executable, "bench/sm90_compile.py", "--out", str(tmp_path / "x.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if triton.__version__.startswith("3.6."):
        assert done.returncode == 0
    else:
        assert done.returncode == 2 and "needs Triton 3.6.x" in done.stderr, done.stderr[-2000:]
