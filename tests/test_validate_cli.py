"""`autotune validate` end to end on the CPU backend, and presets read into the layers' configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.layers import NO_OVERLAP, TransformerOverlap
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.layer_configs import layer_configs_from_preset, slot_configs
from search_spaces.ours import OursPreset, OursSlot, write_ours
from search_spaces.registry import nearest

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
SHAPE = ["--hidden", "64", "--tp", "2", "--seq", "32", "--ffn-hidden", "128"]
PRESET = """\
qkv_fprop:
  method: ring_exchange
  aggregate: 0
proj_fprop:
  method: pipeline
  num_sm: 4
  cga_size: 1
  num_splits: 2
  set_sm_margin: 0
qkv_dgrad:
  method: bulk
  num_sm: 2
  cga_size: 2
  set_sm_margin: 0
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AUTOTUNE, *args], capture_output=True, text=True, timeout=400)


@pytest.fixture
def preset(tmp_path: Path) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(PRESET, encoding="utf-8")
    return path


def test_validate_times_every_variant_on_cpu_as_json(preset: Path) -> None:
    done = run("validate", str(preset), *SHAPE, "--backend", "cpu", "--steps", "2", "--rounds", "2", "--warmup", "1",
               "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result["variants"]) == {"preset", "no_overlap", "te_default", "nvidia", "torch_async_tp"}
    for name in ("preset", "no_overlap", "te_default", "nvidia"):
        timing = result["variants"][name]
        assert timing["median_ms"] > 0 and timing["spread"] >= 0 and timing["steps"] == 4, (name, timing)
        assert timing["p20_ms"] <= timing["median_ms"] <= timing["p80_ms"], (name, timing)
        assert timing["vs_no_overlap"] == pytest.approx(
            result["variants"]["no_overlap"]["median_ms"] / timing["median_ms"]
        )
    skipped = result["variants"]["torch_async_tp"]
    assert skipped["median_ms"] is None and skipped["p20_ms"] is None and "CUDA only" in skipped["skipped"]
    assert result["shape"]["hidden"] == 64 and result["backend"] == "cpu"
    assert any(note.startswith("nvidia: nvidia:") for note in result["notes"])


def test_validate_with_te_but_without_it_exits_2_saying_what_to_install(preset: Path) -> None:
    done = run("validate", str(preset), *SHAPE, "--backend", "te")
    assert done.returncode == 2, done.stderr
    assert "TransformerEngine" in done.stderr


def test_a_preset_slot_the_backend_cannot_run_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("fc1_fprop:\n  method: ring_exchange\n  aggregate: 1\n", encoding="utf-8")
    done = run("validate", str(path), *SHAPE, "--backend", "cpu", "--steps", "1", "--rounds", "1")
    assert done.returncode == 2
    assert "fc1_fprop.aggregate" in done.stderr


def test_a_preset_becomes_the_layers_configs_and_leaves_the_rest_without_overlap() -> None:
    shape = ModelShape(hidden=64, tp=2, seq=32, ffn_hidden=128)
    data = {"proj_fprop": {"method": "pipeline", "num_splits": 2}, "fc1_dgrad": {"method": "ring_exchange"}}
    layers = layer_configs_from_preset(data, shape, backend="cpu")
    assert layers.proj.fprop == OverlapConfig(method=Method.PIPELINE, num_splits=2)
    assert layers.fc1.dgrad.method == Method.RING_EXCHANGE and layers.fc1.wgrad == NO_OVERLAP
    assert layers.qkv == TransformerOverlap().qkv
    # the JSON that `autotune tune` writes beside the YAML holds the entries under ub_cfgs
    assert layer_configs_from_preset({"ub_cfgs": data}, shape, backend="cpu") == layers
    assert TransformerOverlap.from_slots(layers.slots()) == layers


def test_our_own_format_runs_its_winners_as_measured_for_its_shape_only(tmp_path: Path) -> None:
    """`export --format ours` files: each winner as measured, checked against the backend (a stream count is
    a GPU knob, refused on the CPU by name), and refused for another shape."""
    shape = ModelShape(hidden=64, tp=2, seq=32, ffn_hidden=128)
    pipeline = OverlapConfig(method=Method.PIPELINE, num_splits=2)
    measured = {"overlap_ms": 1.0, "serial_ms": 1.5, "gemm_ms": 0.9, "comm_ms": 0.5, "exposed_ms": 0.1}
    measured |= {"hidden_frac": 0.8, "cv": 0.01, "repeats": 5}
    slots = {Slot.PROJ_FPROP: OursSlot(config=pipeline, measured=measured)}
    path = tmp_path / "ours.yaml"
    path.write_text(write_ours(OursPreset(shape=shape, gpu="cpu", slots=slots)))
    layers = layer_configs_from_preset(path, shape, backend="cpu")
    assert layers.proj.fprop == pipeline and layers.fc1.dgrad == NO_OVERLAP
    with pytest.raises(InputError) as err:
        layer_configs_from_preset(path, ModelShape(hidden=128, tp=2, seq=32, ffn_hidden=256), backend="cpu")
    assert err.value.field == "shape"
    streams = OverlapConfig(method=Method.RING_EXCHANGE, num_max_streams=1)
    gpu = {Slot.QKV_FPROP: OursSlot(config=streams, measured=measured)}
    path.write_text(write_ours(OursPreset(shape=shape, gpu="NVIDIA H200", slots=gpu)))
    with pytest.raises(InputError) as err:
        layer_configs_from_preset(path, shape, backend="cpu")
    assert err.value.field == "qkv_fprop.num_max_streams"


def test_nvidias_nearest_preset_falls_back_to_te_defaults_where_it_cannot_run() -> None:
    shape = ModelShape(hidden=64, tp=2, seq=32, ffn_hidden=128)
    preset, _ = nearest(ModelShape(hidden=8192, tp=8, seq=8192))
    with pytest.raises(InputError):
        slot_configs(preset, shape, backend="cpu")
    lenient = slot_configs(preset, shape, backend="cpu", strict=False)
    assert lenient.notes and all("TE's default instead" in note for note in lenient.notes)
    assert set(lenient.configs) == {s for s in preset.configs if s not in (Slot.PROJ_WGRAD, Slot.FC2_WGRAD)}


def test_validate_on_cuda_without_the_gpus_exits_2(preset: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs: the cuda run is the lead's GPU check")
    done = run("validate", str(preset), *SHAPE, "--backend", "cuda")
    assert done.returncode == 2 and "cuda needs tp=2 GPUs" in done.stderr, done.stderr
