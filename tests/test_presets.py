"""Preset I/O: NVIDIA's files read, round-trip and export exactly; malformed files fail with their own error."""

from __future__ import annotations

import json
import warnings
from importlib import resources
from pathlib import Path

import pytest
import yaml

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import (
    TE_KEYS,
    Preset,
    PresetError,
    PresetWarning,
    parse_file_name,
    parse_nemo,
    preset_file_name,
    preset_json,
    read_nemo,
    to_te_dict,
    write_nemo,
)
from search_spaces.nemo_yaml import MAX_PRESET_BYTES

PRESETS_DIR = Path(str(resources.files("search_spaces") / "nvidia_presets"))
NVIDIA_FILES = sorted(PRESETS_DIR.glob("*/*.yaml"))
DUMMIES = [f for f in NVIDIA_FILES if f.read_text().startswith("# dummy")]
CONFIGURED = [f for f in NVIDIA_FILES if f not in DUMMIES]
LLAMA3_70B = PRESETS_DIR / "launcher" / "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"


def ids(files: list[Path]) -> list[str]:
    return [f"{f.parent.name}/{f.name}" for f in files]


def read_quietly(path: Path) -> Preset:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        return read_nemo(path)


def error_for(text: str, name: str = "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml") -> PresetError:
    with pytest.raises(PresetError) as info:
        parse_nemo(text, name=name)
    return info.value


def test_the_package_ships_every_nvidia_preset_and_its_provenance() -> None:
    assert len(NVIDIA_FILES) == 24
    assert {f.parent.name for f in NVIDIA_FILES} == {"launcher", "nemo", "megatron_lm"}
    assert (PRESETS_DIR / "PROVENANCE.md").is_file()


@pytest.mark.parametrize("path", CONFIGURED, ids=ids(CONFIGURED))
def test_every_nvidia_preset_validates(path: Path) -> None:
    preset = read_nemo(path)
    assert len(preset.configs) == 10
    assert all(config.method != Method.NONE for config in preset.configs.values())


@pytest.mark.parametrize("path", DUMMIES, ids=ids(DUMMIES))
def test_nvidia_dummy_file_loads_as_an_empty_preset_with_a_warning(path: Path) -> None:
    with pytest.warns(PresetWarning, match="configures no slot"):
        preset = read_nemo(path)
    assert preset.empty and preset.shape is not None
    assert to_te_dict(preset) == {}
    assert yaml.safe_load(write_nemo(preset)) is None


@pytest.mark.parametrize("path", NVIDIA_FILES, ids=ids(NVIDIA_FILES))
def test_nemo_write_then_read_gives_the_same_normalized_json(path: Path, tmp_path: Path) -> None:
    preset = read_quietly(path)
    name = preset_file_name(preset) if preset.shape is not None else path.name
    (tmp_path / name).write_text(write_nemo(preset))
    again = read_quietly(tmp_path / name)
    assert json.dumps(preset_json(again), sort_keys=True) == json.dumps(preset_json(preset), sort_keys=True)


@pytest.mark.parametrize("path", CONFIGURED, ids=ids(CONFIGURED))
def test_te_dict_uses_only_keys_te_accepts(path: Path) -> None:
    te = to_te_dict(read_nemo(path))
    assert set(te) <= {s.value for s in Slot}
    for entry in te.values():
        assert set(entry) <= set(TE_KEYS)
        assert "num_max_streams" not in entry and "gemm" not in entry
        assert entry["method"] in ("ring_exchange", "pipeline", "bulk", "external")


@pytest.mark.parametrize("path", CONFIGURED, ids=ids(CONFIGURED))
def test_written_yaml_has_the_structure_of_nvidia_files(path: Path) -> None:
    original = yaml.safe_load(path.read_text())
    written = yaml.safe_load(write_nemo(read_nemo(path)))
    assert set(written) == set(original)
    for slot, entry in written.items():
        assert isinstance(entry, dict)
        assert entry["method"] == original[slot]["method"]
        for key, value in entry.items():
            assert isinstance(value, str) if key == "method" else type(value) is int, (slot, key, value)
        assert list(entry) == [k for k in TE_KEYS if k in entry]


def test_written_yaml_reproduces_nvidia_llama3_70b_preset_exactly() -> None:
    written = write_nemo(read_nemo(LLAMA3_70B))
    assert yaml.safe_load(written) == yaml.safe_load(LLAMA3_70B.read_text())
    assert written.startswith("# UB communicator configurations\n# Model configs: H100/h8192/TP4/MBS1/SeqLen8K/FP8\n")
    assert "# Bulk overlap with AllGather / ReduceScatter\nqkv_dgrad:\n  method: bulk\n" in written


def test_flags_are_written_as_0_and_1() -> None:
    written = write_nemo(read_nemo(LLAMA3_70B))
    assert "set_sm_margin: 0" in written and "set_sm_margin: 1" in written
    assert "true" not in written.lower().replace("# ", "")


def test_te_dict_states_every_key_the_method_reads_with_python_bools() -> None:
    te = to_te_dict(read_nemo(LLAMA3_70B))
    assert te["qkv_fprop"] == {
        "method": "ring_exchange",
        "num_sm": 1,
        "cga_size": 1,
        "set_sm_margin": False,
        "aggregate": False,
        "use_ce": True,
        "fp8_buf": True,
        "atomic_gemm": False,
    }
    assert te["proj_fprop"]["set_sm_margin"] is True and te["proj_fprop"]["num_splits"] == 4
    assert te["qkv_wgrad"] == {"method": "bulk", "num_sm": 24, "cga_size": 2, "set_sm_margin": False, "fp8_buf": False}


def test_missing_keys_take_te_defaults() -> None:
    preset = parse_nemo("proj_fprop:\n  method: pipeline\nqkv_dgrad: {}\n")
    assert preset.configs[Slot.PROJ_FPROP] == OverlapConfig(
        method=Method.PIPELINE, num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True
    )
    assert preset.configs[Slot.QKV_DGRAD].method == Method.BULK


# -- file names ----------------------------------------------------------------------------------------


def test_file_name_gives_shape_gpu_and_dtype_as_nvidia_names_them() -> None:
    shape, gpu, dtype = parse_file_name("ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192.yaml")
    assert shape == ModelShape(hidden=16384, tp=8, cp=2, mbs=1, seq=8192, dtype="bf16")
    assert (gpu, dtype) == ("h100", "bf16")
    shape, gpu, dtype = parse_file_name("ub_cfg_a100_h12288_tp4_mbs2_seqlen2048.yaml")
    assert shape == ModelShape(hidden=12288, tp=4, mbs=2, seq=2048) and (gpu, dtype) == ("a100", None)


def test_file_name_that_is_not_nvidia_style_gives_no_shape() -> None:
    assert parse_file_name("tp_comm_overlap_cfg.yaml") == (None, None, None)


def test_file_name_with_an_impossible_shape_is_rejected() -> None:
    with pytest.raises(PresetError, match="file name"):
        parse_file_name("ub_cfg_h100_h1000_tp3_mbs1_seqlen2048.yaml")


def test_written_file_name_places_cp_and_dtype_as_nvidia_does() -> None:
    shape = ModelShape(hidden=16384, tp=8, cp=2, mbs=1, seq=8192, dtype="fp8")
    preset = Preset(configs={}, shape=shape, gpu="h200", dtype="fp8")
    assert preset_file_name(preset) == "ub_cfg_h200_fp8_h16384_tp8_cp2_mbs1_seqlen8192.yaml"
    plain = Preset(configs={}, shape=ModelShape(hidden=8192, tp=2, seq=8192), gpu="h200")
    assert preset_file_name(plain) == "ub_cfg_h200_h8192_tp2_mbs1_seqlen8192.yaml"
    assert parse_file_name(preset_file_name(preset)) == (shape, "h200", "fp8")


def test_header_names_gpu_width_tp_cp_mbs_seq_and_dtype() -> None:
    shape = ModelShape(hidden=8192, tp=2, cp=2, mbs=1, seq=8192)
    preset = Preset(configs={}, shape=shape, gpu="h200", dtype="bf16")
    assert write_nemo(preset).splitlines()[:2] == [
        "# UB communicator configurations",
        "# Model configs: H200/h8192/TP2/CP2/MBS1/SeqLen8K/BF16",
    ]


# -- malformed input -----------------------------------------------------------------------------------


def test_preset_with_misspelled_slot_is_rejected_with_the_close_name() -> None:
    error = error_for("qkv_fprp:\n  method: ring_exchange\n")
    assert error.field == "qkv_fprp" and "did you mean qkv_fprop" in error.rule


def test_preset_with_unknown_key_is_rejected() -> None:
    error = error_for("qkv_dgrad:\n  method: bulk\n  num_sms: 4\n")
    assert error.field == "qkv_dgrad.num_sms" and "not a TE ub_cfgs key" in error.rule and "num_sm" in error.rule


@pytest.mark.parametrize("key", ["num_max_streams", "gemm"])
def test_preset_with_our_runtime_knob_is_rejected(key: str) -> None:
    assert error_for(f"proj_fprop:\n  method: pipeline\n  {key}: 2\n").field == f"proj_fprop.{key}"


@pytest.mark.parametrize(
    ("entry", "field", "rule"),
    [
        ("  method: bulk\n  set_sm_margin: 2", "qkv_dgrad.set_sm_margin", "flag"),
        ("  method: bulk\n  set_sm_margin: 'yes please'", "qkv_dgrad.set_sm_margin", "flag"),
        ("  method: bulk\n  num_sm: 4.0", "qkv_dgrad.num_sm", "integer"),
        ("  method: bulk\n  num_sm: true", "qkv_dgrad.num_sm", "integer"),
        ("  method: bulk\n  num_sm: 0", "qkv_dgrad.num_sm", "positive"),
        ("  method: 3", "qkv_dgrad.method", "must be one of"),
        ("  method: bulky", "qkv_dgrad.method", "did you mean bulk"),
    ],
)
def test_preset_with_bad_type_is_rejected(entry: str, field: str, rule: str) -> None:
    error = error_for(f"qkv_dgrad:\n{entry}\n")
    assert error.field == field and rule in error.rule


def test_preset_slot_that_is_not_a_mapping_is_rejected() -> None:
    assert "mapping" in error_for("qkv_dgrad: bulk\n").rule


def test_pipeline_on_an_all_gather_slot_is_rejected() -> None:
    error = error_for("fc1_fprop:\n  method: pipeline\n")
    assert error.field == "fc1_fprop.method" and "not supported for AllGather" in error.rule


@pytest.mark.parametrize(
    ("slot", "method"),
    [("qkv_wgrad", "ring_exchange"), ("proj_dgrad", "bulk"), ("proj_fprop", "bulk"), ("qkv_fprop", "external")],
)
def test_method_a_slot_cannot_run_is_rejected(slot: str, method: str) -> None:
    error = error_for(f"{slot}:\n  method: {method}\n")
    assert error.field == f"{slot}.method" and "only with" in error.rule


def test_none_is_not_a_te_method() -> None:
    assert "none is not a TE method" in error_for("qkv_fprop:\n  method: none\n").rule


def test_wgrad_with_reduce_scatter_dgrad_is_rejected() -> None:
    error = error_for("qkv_dgrad:\n  method: ring_exchange\nqkv_wgrad:\n  method: bulk\n")
    assert error.field == "qkv_wgrad" and "reduce-scatter dgrad" in error.rule


def test_reduce_scatter_dgrad_without_its_wgrad_is_accepted() -> None:
    preset = parse_nemo("fc1_dgrad:\n  method: pipeline\n  num_sm: 16\n  num_splits: 4\n")
    assert to_te_dict(preset)["fc1_dgrad"]["method"] == "pipeline"


def test_key_the_method_ignores_is_rejected_unless_it_is_te_default() -> None:
    error = error_for("proj_fprop:\n  method: pipeline\n  aggregate: 1\n")
    assert error.field == "proj_fprop.aggregate" and "ignores" in error.rule
    assert error_for("qkv_fprop:\n  method: ring_exchange\n  num_splits: 4\n").field == "qkv_fprop.num_splits"
    parse_nemo("proj_fprop:\n  method: pipeline\n  aggregate: 0\n  use_ce: 1\n")


def test_is_reduce_scatter_against_the_slot_direction_is_rejected() -> None:
    error = error_for("qkv_fprop:\n  method: ring_exchange\n  is_reduce_scatter: 1\n")
    assert error.field == "qkv_fprop.is_reduce_scatter"
    parse_nemo("proj_fprop:\n  method: pipeline\n  is_reduce_scatter: true\n")


def test_fp8_buf_that_te_ignores_gives_a_warning() -> None:
    with pytest.warns(PresetWarning, match="fp8_buf"):
        preset = parse_nemo("proj_fprop:\n  method: ring_exchange\n  fp8_buf: 1\n")
    assert preset.configs[Slot.PROJ_FPROP].fp8_buf is False


def test_atomic_ring_exchange_needs_its_partner_to_be_atomic_too() -> None:
    text = "qkv_fprop:\n  method: ring_exchange\n  atomic_gemm: 1\n"
    error = error_for(text, name="ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml")
    assert error.field == "qkv_fprop.atomic_gemm" and "go together" in error.rule
    paired = text + "proj_fprop:\n  method: ring_exchange\n  atomic_gemm: 1\n"
    parse_nemo(paired, name="ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml")


def test_atomic_gemm_in_a_bf16_preset_is_rejected() -> None:
    text = "fc2_fprop:\n  method: pipeline\n  atomic_gemm: 1\n"
    error = error_for(text, name="ub_cfg_h100_bf16_h8192_tp4_mbs1_seqlen8192.yaml")
    assert error.field == "fc2_fprop.atomic_gemm" and "FP8" in error.rule


def test_external_slot_needs_its_dgrad_on_ring_exchange() -> None:
    preset = parse_nemo("proj_wgrad:\n  method: external\nproj_dgrad:\n  method: ring_exchange\n")
    assert to_te_dict(preset)["proj_wgrad"]["method"] == "external"


def test_yaml_tag_is_rejected_clearly() -> None:
    error = error_for("qkv_fprop: !!python/object:os.system\n  method: ring_exchange\n")
    assert error.field == "file" and "YAML tags" in error.rule


def test_duplicate_key_is_rejected() -> None:
    error = error_for("qkv_fprop:\n  method: ring_exchange\nqkv_fprop:\n  method: ring_exchange\n")
    assert error.field == "qkv_fprop" and "twice" in error.rule


def test_invalid_yaml_is_rejected() -> None:
    assert "not valid YAML" in error_for("qkv_fprop: [\n").rule


def test_top_level_list_is_rejected() -> None:
    assert error_for("- qkv_fprop\n").field == "file"


def test_oversize_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * (MAX_PRESET_BYTES // 10 + 1))
    with pytest.raises(PresetError) as info:
        read_nemo(path)
    assert info.value.field == "file" and "at most 1048576 bytes" in info.value.rule


# -- the Preset object ---------------------------------------------------------------------------------


def test_preset_refuses_method_none() -> None:
    with pytest.raises(PresetError, match="none is not a TE method"):
        Preset(configs={Slot.QKV_FPROP: OverlapConfig(method=Method.NONE)})


def test_preset_refuses_runtime_only_knobs() -> None:
    with pytest.raises(PresetError) as info:
        Preset(configs={Slot.PROJ_FPROP: OverlapConfig(method=Method.PIPELINE, num_max_streams=2)})
    assert info.value.field == "proj_fprop.num_max_streams"


def test_preset_dtype_must_match_its_shape() -> None:
    with pytest.raises(PresetError) as info:
        Preset(configs={}, shape=ModelShape(hidden=1024, tp=2, seq=512), dtype="fp8")
    assert info.value.field == "dtype"


def test_preset_orders_slots_as_nvidia_files_do() -> None:
    text = "proj_fprop:\n  method: pipeline\nqkv_dgrad:\n  method: bulk\n"
    assert list(parse_nemo(text).configs) == [Slot.QKV_DGRAD, Slot.PROJ_FPROP]
