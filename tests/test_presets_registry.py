"""The nearest known preset for a shape, and presets built from tuning results under the export rule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from conftest_tuner import measurement

from autotune.tuner.baselines import PRESET, TE_DEFAULT, baselines
from overlap_runtime.config import DeviceLimits, Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import (
    Preset,
    PresetRegistry,
    PresetWarning,
    SlotResult,
    distance,
    nearest,
    nvidia_presets,
    parse_nemo,
    preset_file_name,
    preset_from_results,
    preset_json,
    te_config,
    to_te_dict,
    write_nemo,
)
from search_spaces.export import NO_TE_EXACT, measured_text
from search_spaces.registry import DTYPE_MISMATCH
from search_spaces.space import slot_space

LLAMA3_70B = ModelShape(hidden=8192, tp=4, seq=8192)
PIPELINE = OverlapConfig(
    method=Method.PIPELINE, num_sm=24, cga_size=2, num_splits=4, set_sm_margin=True, num_max_streams=3, gemm="cublas"
)


def test_registry_holds_every_nvidia_file() -> None:
    presets = nvidia_presets()
    assert len(presets) == 24
    assert all(p.source is not None and p.source.startswith("nvidia:") for p in presets)


def test_exact_shape_gpu_and_dtype_is_at_distance_zero() -> None:
    preset, d = nearest(ModelShape(hidden=8192, tp=4, seq=8192, dtype="fp8"), gpu="h100", dtype="fp8")
    assert d == 0
    assert preset.source == "nvidia:launcher/ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml"


def test_nearest_prefers_the_same_tp() -> None:
    preset, _ = nearest(ModelShape(hidden=8192, tp=2, seq=8192), gpu="h100")
    assert preset.shape is not None and preset.shape.tp == 2


def test_distance_counts_doublings_of_tokens_and_width_and_double_for_tp() -> None:
    preset = Preset(configs={}, shape=ModelShape(hidden=4096, tp=2, seq=2048), gpu="h100", dtype="bf16")
    assert distance(ModelShape(hidden=8192, tp=2, seq=8192), preset) == pytest.approx(3.0)
    assert distance(ModelShape(hidden=4096, tp=4, seq=2048), preset) == pytest.approx(2.0)
    assert distance(ModelShape(hidden=4096, tp=2, seq=2048), preset, gpu="h200", dtype="fp8") == pytest.approx(1.5)


def test_nearest_never_answers_a_dummy_or_a_preset_without_shape() -> None:
    for shape in (ModelShape(hidden=6144, tp=4, mbs=4, seq=2048), ModelShape(hidden=512, tp=2, mbs=2, seq=1024)):
        preset, _ = nearest(shape)
        assert preset.shape is not None and not preset.empty


def test_preset_added_at_run_time_wins_ties_and_replaces_its_predecessor() -> None:
    registry = PresetRegistry.with_nvidia()
    nvidia, _ = registry.nearest(LLAMA3_70B, gpu="h100")
    tuned = Preset(configs=nvidia.configs, shape=LLAMA3_70B, gpu="h100", source="tuned-1")
    registry.add(tuned)
    registry.add(Preset(configs=nvidia.configs, shape=LLAMA3_70B, gpu="h100", source="tuned-2"))
    preset, d = registry.nearest(LLAMA3_70B, gpu="h100")
    assert (preset.source, d) == ("tuned-2", 0)
    assert sum(1 for p in registry.presets() if p.source and p.source.startswith("tuned")) == 1


def test_registry_refuses_presets_it_could_never_answer() -> None:
    with pytest.raises(InputError, match="shape"):
        PresetRegistry().add(Preset(configs={}, shape=LLAMA3_70B))
    with pytest.raises(InputError):
        PresetRegistry().nearest(LLAMA3_70B)


# -- export --------------------------------------------------------------------------------------------


def exact(best: OverlapConfig, best_ms: float, te_exact: OverlapConfig, te_ms: float) -> SlotResult:
    """A slot's result with its TE-exact winner measured at ``te_ms``."""
    return SlotResult(best=best, best_ms=best_ms, te_exact=te_exact, te_exact_measurement=measurement(te_ms))


def test_winning_overlap_configs_become_te_entries_without_runtime_knobs() -> None:
    preset = preset_from_results(LLAMA3_70B, {Slot.PROJ_FPROP: exact(PIPELINE, 1.0, PIPELINE, 1.0)}, gpu="h200")
    assert to_te_dict(preset)["proj_fprop"] == {
        "method": "pipeline",
        "num_sm": 24,
        "cga_size": 2,
        "num_splits": 4,
        "set_sm_margin": True,
        "fp8_buf": False,
        "atomic_gemm": False,
        "pipeline_rs_overlap_first_gemm": False,
    }
    assert preset.notes == {Slot.PROJ_FPROP: f"TE-exact: {measured_text(measurement(1.0))}"}
    assert preset_json(preset)["measurements"]["proj_fprop"]["overlap_ms"] == 1.0
    assert preset_file_name(preset) == "ub_cfg_h200_bf16_h8192_tp4_mbs1_seqlen8192.yaml"


def test_the_te_exact_winner_is_exported_with_its_numbers_not_our_runtimes_faster_winner() -> None:
    triton = replace(PIPELINE, gemm="triton")
    preset = preset_from_results(LLAMA3_70B, {Slot.PROJ_FPROP: exact(triton, 0.8, PIPELINE, 1.0)}, gpu="h200")
    assert preset.configs[Slot.PROJ_FPROP] == te_config(Slot.PROJ_FPROP, PIPELINE)
    note = preset.notes[Slot.PROJ_FPROP]
    assert note.startswith("TE-exact: overlap 1 ms, serial 1.126 ms, exposed")
    assert "our runtime's winner ran 0.8 ms (20.0% faster" in note and "measured with" not in note
    text = write_nemo(preset)
    assert "# proj_fprop: TE-exact: overlap 1 ms" in text and "measured with" not in text
    assert preset_json(preset)["measurements"]["proj_fprop"]["serial_ms"] == 1.126


def test_a_te_exact_winner_that_te_runs_otherwise_is_refused() -> None:
    triton = replace(PIPELINE, gemm="triton")
    with pytest.raises(InputError, match=r"te_exact.*triton GEMM"):
        preset_from_results(LLAMA3_70B, {Slot.PROJ_FPROP: exact(triton, 0.8, triton, 0.8)})


def test_a_slot_without_a_te_exact_measurement_says_so_first() -> None:
    triton = replace(PIPELINE, gemm="triton")
    preset = preset_from_results(LLAMA3_70B, {Slot.PROJ_FPROP: SlotResult(best=triton, best_ms=0.8)})
    note = preset.notes[Slot.PROJ_FPROP]
    assert note.startswith(NO_TE_EXACT) and "measured with our triton GEMM" in note
    assert preset.measurements == {}
    assert f"# proj_fprop: {NO_TE_EXACT}" in write_nemo(preset)


def test_when_none_wins_the_preset_carries_the_te_exact_winner_and_says_how_to_turn_it_off() -> None:
    preset = preset_from_results(
        LLAMA3_70B, {Slot.PROJ_FPROP: exact(OverlapConfig(method=Method.NONE), 0.9, PIPELINE, 1.0)}, gpu="h200"
    )
    assert preset.configs[Slot.PROJ_FPROP].method == Method.PIPELINE
    note = preset.notes[Slot.PROJ_FPROP]
    assert "no overlap was 0.1 ms (10.0%) faster" in note and "--disable-tp-comm-overlap-rs" in note
    text = write_nemo(preset)
    assert "# proj_fprop: TE-exact: overlap 1 ms" in text and "no overlap was 0.1 ms" in text
    assert yaml.safe_load(text)["proj_fprop"]["method"] == "pipeline"


def test_without_a_te_exact_winner_when_none_wins_the_best_overlap_is_carried() -> None:
    result = SlotResult(best=OverlapConfig(method=Method.NONE), best_ms=0.9, best_overlap=PIPELINE, best_overlap_ms=1.0)
    preset = preset_from_results(LLAMA3_70B, {Slot.PROJ_FPROP: result}, gpu="h200")
    assert preset.configs[Slot.PROJ_FPROP].method == Method.PIPELINE
    note = preset.notes[Slot.PROJ_FPROP]
    assert note.startswith(NO_TE_EXACT) and "no overlap was 0.1 ms (10.0%) faster" in note


def test_reduce_scatter_dgrad_winner_drops_its_wgrad_with_a_note() -> None:
    rx = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, num_max_streams=3, gemm="cublas")
    bulk = OverlapConfig(method=Method.BULK, num_sm=8, cga_size=2, gemm="cublas")
    results = {Slot.QKV_DGRAD: SlotResult(best=rx, best_ms=1.0), Slot.QKV_WGRAD: SlotResult(best=bulk, best_ms=1.0)}
    preset = preset_from_results(LLAMA3_70B, results)
    assert Slot.QKV_WGRAD not in preset.configs
    assert "--tp-comm-overlap-rs-dgrad" in preset.notes[Slot.QKV_DGRAD]
    assert "left out" in preset.notes[Slot.QKV_WGRAD]
    parse_nemo(write_nemo(preset))


def test_runtime_only_choices_are_noted_because_te_cannot_reproduce_them() -> None:
    triton = OverlapConfig(method=Method.RING_EXCHANGE, use_ce=True, num_max_streams=1, gemm="triton")
    preset = preset_from_results(LLAMA3_70B, {Slot.QKV_FPROP: SlotResult(best=triton, best_ms=1.0)})
    assert (
        "triton GEMM" in preset.notes[Slot.QKV_FPROP]
        and "1 compute streams (TE uses 3)" in preset.notes[Slot.QKV_FPROP]
    )


def test_copy_engine_bulk_winner_is_noted_because_te_bulk_runs_sm_kernels() -> None:
    ce_bulk = OverlapConfig(method="bulk", use_ce=True, gemm="cublas")
    preset = preset_from_results(LLAMA3_70B, {Slot.QKV_WGRAD: SlotResult(best=ce_bulk, best_ms=1.0)})
    assert "copy-engine bulk" in preset.notes[Slot.QKV_WGRAD]
    assert preset.configs[Slot.QKV_WGRAD].method == "bulk"


def test_num_sm_beyond_te_userbuffers_limit_is_noted_on_export_and_warned_on_import() -> None:
    bulk = OverlapConfig(method=Method.BULK, num_sm=48, cga_size=2, gemm="cublas")
    preset = preset_from_results(LLAMA3_70B, {Slot.QKV_WGRAD: SlotResult(best=bulk, best_ms=1.0)})
    assert "NVTE_MAX_SMS=32" in preset.notes[Slot.QKV_WGRAD]
    with pytest.warns(PresetWarning, match="NVTE_MAX_SMS"):
        parse_nemo(write_nemo(preset))


def test_exported_preset_round_trips_through_nemo_yaml() -> None:
    results = {Slot.PROJ_FPROP: SlotResult(best=PIPELINE, best_ms=1.0)}
    preset = preset_from_results(ModelShape(hidden=8192, tp=4, seq=8192, dtype="fp8"), results, gpu="h200")
    again = parse_nemo(write_nemo(preset), name=preset_file_name(preset))
    assert preset_json(again)["ub_cfgs"] == preset_json(preset)["ub_cfgs"]
    assert (again.shape, again.gpu, again.dtype) == (preset.shape, preset.gpu, preset.dtype)


def test_note_with_line_breaks_stays_a_comment() -> None:
    preset = Preset(configs={}, shape=LLAMA3_70B, notes={Slot.QKV_FPROP: "first line\nqkv_fprop:\n  method: bulk"})
    assert yaml.safe_load(write_nemo(preset)) is None


def test_slot_result_needs_both_overlap_config_and_time() -> None:
    with pytest.raises(InputError):
        SlotResult(best=OverlapConfig(method=Method.NONE), best_ms=1.0, best_overlap=PIPELINE)


def test_nvidia_fp8_presets_are_the_nearest_presets_of_fp8_shapes() -> None:
    """Most of NVIDIA's H100 files name no dtype and say FP8 in their header: they count as FP8 presets."""
    fp8 = ModelShape(hidden=8192, tp=2, seq=4096, dtype="fp8")
    preset, d = nearest(fp8, gpu="h100", dtype="fp8")
    assert (preset.source, preset.dtype, d) == ("nvidia:launcher/ub_cfg_h100_h8192_tp2_mbs1_seqlen4096.yaml", "fp8", 0)
    bf16 = ModelShape(hidden=8192, tp=2, seq=4096)
    assert nearest(bf16, gpu="h100", dtype="bf16")[1] == pytest.approx(DTYPE_MISMATCH)


def test_an_fp8_shape_starts_from_nvidias_fp8_preset_with_its_fp8_buffer() -> None:
    """The study's preset baseline for an fp8 pipeline slot is NVIDIA's FP8 entry, FP8 reduce-scatter buffer kept."""
    shape = ModelShape(hidden=8192, tp=4, seq=8192, dtype="fp8")
    space = slot_space(shape, Slot.PROJ_FPROP, backend="cuda", limits=DeviceLimits(sm_count=132))
    found = baselines(space, gpu="NVIDIA H100 80GB HBM3")
    (preset,) = [b.config for b in found.configs if PRESET in b.labels]
    assert preset.method == Method.PIPELINE and preset.fp8_buf and preset.num_sm == 24 and preset.num_splits == 4
    assert found.caveats == ()  # NVIDIA's files set no atomic GEMM
    assert not next(b.config for b in found.configs if TE_DEFAULT in b.labels).fp8_buf  # TE's default: bf16 partials


def test_a_preset_atomic_gemm_is_scored_as_its_nearest_runnable_equivalent_and_the_study_says_so() -> None:
    shape = ModelShape(hidden=1024, tp=2, seq=1024, dtype="fp8")
    text = "proj_fprop:\n  method: pipeline\n  num_sm: 16\n  num_splits: 4\n  set_sm_margin: 1\n  fp8_buf: 1\n"
    atomic = parse_nemo(text + "  atomic_gemm: 1\n", name="ub_cfg_h200_fp8_h1024_tp2_mbs1_seqlen1024.yaml")
    space = slot_space(shape, Slot.PROJ_FPROP, backend="cuda", limits=DeviceLimits(sm_count=132))
    found = baselines(space, gpu="NVIDIA H200", registry=PresetRegistry([atomic]))
    (preset,) = [b.config for b in found.configs if PRESET in b.labels]
    assert not preset.atomic_gemm and preset.fp8_buf and preset.num_sm == 16
    (caveat,) = found.caveats
    assert caveat.startswith("preset: ub_cfg_h200_fp8_h1024_tp2_mbs1_seqlen1024.yaml (distance 0.00) proj_fprop:")
    assert "atomic_gemm scored as the same entry without it" in caveat and "cuBLAS >= 12.2 and < 13.0" in caveat
    assert type(found).from_dict(found.to_dict()) == found  # kept with the study across restarts
