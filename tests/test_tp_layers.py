"""The library layers (`overlap_runtime.layers`) on the CPU backend: outputs and gradients equal a non-parallel
reference for every method each GEMM can run, over several optimizer steps, in our own TP group and under
torchrun on a DP x TP DeviceMesh; bad shapes and configs fail at construction; a dead peer fails the call."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_runtime.config import OverlapConfig, problem
from overlap_runtime.group import TPGroup
from overlap_runtime.shape import ModelShape, Slot

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4
"""fp32 GEMMs summed in other orders (chunks, ring steps) than the reference's."""


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, nproc: int, timeout: float = 240) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_importing_the_layers_imports_no_torch() -> None:
    code = "import sys, overlap_runtime.layers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True)


@pytest.mark.parametrize("tp", [2, 4], ids=lambda tp: f"tp{tp}")
def test_layers_match_the_reference_for_every_method_over_steps(tp: int, tp2: TPGroup) -> None:
    from tests.layer_cases import compare_task

    # two ranks: the module's group (a group start costs seconds of CPU); four: a group of this test's own
    with contextlib.nullcontext(tp2) if tp == 2 else TPGroup(tp=tp, backend="cpu") as group:
        # epoch_limit 3: every copy-engine buffer restarts its flags several times in 5 steps
        results = group.run(compare_task, tp, steps=5, epoch_limit=3, timeout_s=240)
    for name, worst in results[0].items():
        assert worst.pop("max_epoch") <= 3, name
        assert all(v < TOLERANCE for v in worst.values()), (name, worst)
    assert set(results[0]) >= {"none", "ring_bulk", "copy_engine", "fused_rs_dgrad", "pipeline"}


def test_layers_under_torchrun_on_a_dp_by_tp_mesh() -> None:
    out = torchrun("tests/layer_cases.py", "2", nproc=4)
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 4 * 6, out
    assert all(line.endswith(": ok") for line in lines), out


def test_a_dead_peer_fails_the_call_within_the_wait_timeout() -> None:
    out = torchrun("tests/layer_cases.py", "2", "die", nproc=2)
    line = next(line for line in out.splitlines() if line.startswith("died:"))
    assert "StreamError" in line, line
    seconds = float(line.split(" after ")[1].split(" s")[0])
    assert seconds < 10, line


def test_the_layers_gemms_are_the_slots_gemms() -> None:
    from overlap_runtime.tp_linear import _column_gemms, _row_gemms

    shape = ModelShape(hidden=64, tp=2, seq=32, mbs=2, ffn_hidden=128)
    t = shape.tokens
    for method in ("bulk", "ring_exchange"):
        column = _column_gemms("fc1", t, shape.hidden, shape.fc1_width, 2, method)
        assert column["dgrad"] == problem(shape, Slot.FC1_DGRAD, method)
    column = _column_gemms("qkv", t, shape.hidden, shape.qkv_width, 2, "bulk")
    assert column["fprop"] == problem(shape, Slot.QKV_FPROP, "ring_exchange")
    assert column["wgrad"] == problem(shape, Slot.QKV_WGRAD, "bulk")
    row = _row_gemms("fc2", t, shape.ffn, shape.hidden, 2)
    assert row["fprop"] == problem(shape, Slot.FC2_FPROP, "pipeline")
    assert row["dgrad"] == problem(shape, Slot.FC2_DGRAD, "ring_exchange")


def _construct(ctx, kind: str, kwargs: dict) -> str:
    from overlap_runtime.errors import InputError
    from overlap_runtime.layers import ColumnParallelLinear, RowParallelLinear

    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    try:
        cls(**kwargs)
    except InputError as e:
        return e.field
    return "no error"


@pytest.mark.parametrize(
    ("kind", "kwargs", "field"),
    [
        ("column", {"in_features": 16, "out_features": 7}, "out_features"),
        ("row", {"in_features": 7, "out_features": 16}, "in_features"),
        ("column", {"in_features": 16, "out_features": 16, "tokens": 9}, "tokens"),
        ("row", {"in_features": 16, "out_features": 16, "layer": "qkv"}, "layer"),
        (
            "row",
            {"in_features": 16, "out_features": 12, "overlap": {"fprop": {"method": "pipeline", "num_splits": 5}}},
            "proj_fprop.num_splits",
        ),
        (
            "column",
            {"in_features": 16, "out_features": 16, "overlap": {"fprop": {"method": "bulk"}}},
            "qkv_fprop.method",
        ),
        (
            "column",
            {
                "in_features": 16,
                "out_features": 16,
                "overlap": {"dgrad": {"method": "ring_exchange"}, "wgrad": {"method": "bulk"}},
            },
            "qkv_wgrad",
        ),
        ("row", {"in_features": 16, "out_features": 16, "overlap": {"wgrad": {"method": "bulk"}}}, "proj_wgrad"),
        (
            "row",
            {
                "in_features": 16,
                "out_features": 16,
                "overlap": {"dgrad": {"method": "ring_exchange", "aggregate": True}},
            },
            "proj_dgrad.aggregate",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_layer_that_cannot_run_fails_at_construction_naming_the_field(
    tp2: TPGroup, kind: str, kwargs: dict, field: str
) -> None:
    from overlap_runtime.layers import LinearOverlap

    if "overlap" in kwargs:
        roles = {role: OverlapConfig.from_dict(c) for role, c in kwargs["overlap"].items()}
        kwargs = kwargs | {"overlap": LinearOverlap(**roles)}
    assert tp2.run(_construct, kind, kwargs, timeout_s=60)[0] == field


@pytest.fixture(scope="module")
def tp2():
    with TPGroup(tp=2, backend="cpu") as group:
        yield group


def test_the_readme_example_trains_with_a_tuned_preset_under_torchrun() -> None:
    preset = "bench/results/presets/ub_cfg_h200_bf16_h8192_tp2_mbs1_seqlen8192.yaml"
    args = ["--hidden", "64", "--ffn-hidden", "256", "--seq", "64", "--steps", "4", "--preset", preset]
    out = torchrun("examples/tp_mlp.py", *args, nproc=2)
    assert "fc1_dgrad: {'method': 'bulk'}" in out and "fc2_fprop: {'method': 'ring_exchange'}" in out, out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0], out


RELEASED_AT_EXIT = """
import atexit, gc, os, sys, weakref
import torch.distributed as dist
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
world = weakref.ref(dist.group.WORLD)

def freed() -> None:  # registered before the layers' hook, so it runs after it
    gc.collect()
    os._exit(0 if world() is None else 3)

atexit.register(freed)
from overlap_runtime.layers import ColumnParallelLinear
ColumnParallelLinear(8, 8, layer="fc1")
dist.destroy_process_group()
"""


def test_a_destroyed_group_is_freed_before_the_interpreter_finalizes(tmp_path: Path) -> None:
    """The layers' registry lets go of its groups at exit: a group it kept alive past ``destroy_process_group``
    would keep gloo's workers running into finalization, where one that drops its last work aborts the process."""
    store = tmp_path / "store"
    done = subprocess.run([sys.executable, "-c", RELEASED_AT_EXIT, str(store)], cwd=ROOT, env=_env(), timeout=120)
    assert done.returncode == 0, "the default group outlived the exit hooks"


def _state(ctx) -> dict:
    import torch

    from overlap_runtime.layers import ColumnParallelLinear, RowParallelLinear

    column, row = ColumnParallelLinear(16, 32, layer="fc1"), RowParallelLinear(32, 16, layer="fc2", bias=False)
    other = ColumnParallelLinear(16, 32, layer="fc1")
    other.load_state_dict(column.state_dict())
    loaded = torch.equal(other.weight, column.weight)
    column.reset_parameters()
    return {
        "column": {k: tuple(v.shape) for k, v in column.state_dict().items()},
        "row": {k: tuple(v.shape) for k, v in row.state_dict().items()},
        "loaded": loaded,
        "redrawn": not torch.equal(other.weight, column.weight),
        "bound": float(column.weight.abs().max()) <= 1 / 16**0.5,
        "bias_zero": bool((column.bias == 0).all()),
        "dtype": str(ColumnParallelLinear(16, 32, dtype=torch.float64).weight.dtype),
    }


def test_the_layers_follow_pytorchs_parameter_conventions(tp2: TPGroup) -> None:
    state = tp2.run(_state, timeout_s=60)[0]
    assert state["column"] == {"weight": (16, 16), "bias": (16,)}  # [out / tp, in], bias sharded with it
    assert state["row"] == {"weight": (16, 16)}  # [out, in / tp]
    assert state["loaded"] and state["redrawn"]  # load_state_dict copies; reset_parameters draws anew
    assert state["bound"] and state["bias_zero"] and state["dtype"] == "torch.float64"
