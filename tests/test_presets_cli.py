"""`autotune preset validate|convert` as a user runs them: exit 0 with JSON/YAML, exit 2 with `error: field: rule`.

The commands run in-process (typer's runner, the console script's own `app`), so each costs no interpreter
start; none of these tests looks at the process itself.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from conftest_tuner import measurement
from typer.testing import CliRunner

from autotune.cli.app import app
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import OursPreset, OursSlot, ours_file_name, preset_json, read_nemo, to_te_dict, write_ours

if TYPE_CHECKING:
    from click.testing import Result

PRESETS = Path(str(resources.files("search_spaces") / "nvidia_presets"))
LLAMA3_70B = PRESETS / "launcher" / "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"


def run(*args: str) -> Result:
    """``autotune preset ARGS``: its exit code, and its stdout and stderr apart."""
    return CliRunner().invoke(app, ["preset", *args])


def test_validate_prints_normalized_configs_as_json() -> None:
    done = run("validate", str(LLAMA3_70B))
    assert done.exit_code == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == preset_json(read_nemo(LLAMA3_70B)) | {"warnings": []}
    assert out["shape"]["hidden"] == 8192 and out["ub_cfgs"]["proj_fprop"]["num_sm"] == 24


def test_validate_reports_fp8_for_an_nvidia_file_whose_header_says_fp8() -> None:
    """The file name names no dtype; NVIDIA's header line ends in /FP8, so the preset is an FP8 one."""
    assert "/FP8\n" in LLAMA3_70B.read_text()
    out = json.loads(run("validate", str(LLAMA3_70B)).stdout)
    assert out["dtype"] == "fp8" and out["shape"]["dtype"] == "fp8"
    a100 = json.loads(run("validate", str(PRESETS / "launcher" / "ub_cfg_a100_h12288_tp4_mbs1_seqlen2048.yaml")).stdout)
    assert a100["dtype"] == "bf16"  # its header ends in /BF16


def test_validate_warns_where_name_and_header_disagree_and_keeps_the_name() -> None:
    done = run("validate", str(PRESETS / "launcher" / "ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192.yaml"))
    assert done.exit_code == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["dtype"] == "bf16"
    assert out["warnings"] == [
        "ub_cfg_h100_bf16_h16384_tp8_cp2_mbs1_seqlen8192.yaml: the header says FP8 but the file name says bf16; "
        "the file name is used"
    ]


def test_validate_reports_the_dummy_warning() -> None:
    done = run("validate", str(PRESETS / "nemo" / "ub_cfg_h100_h6144_tp4_mbs4_seqlen2048.yaml"))
    assert done.exit_code == 0
    assert json.loads(done.stdout)["ub_cfgs"] == {} and "warning:" in done.stderr


def test_validate_of_a_bad_file_exits_2_naming_field_and_rule(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_fprp:\n  method: ring_exchange\n")
    done = run("validate", str(bad))
    assert done.exit_code == 2
    assert (
        done.stderr.startswith("error: qkv_fprp: is not a TE userbuffers slot")
        and "did you mean qkv_fprop" in done.stderr
    )


def test_validate_of_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    assert run("validate", str(tmp_path / "nope.yaml")).exit_code == 2


def test_convert_to_nemo_into_a_folder_uses_nvidia_file_name_and_validates_again(tmp_path: Path) -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "nemo", "--out", str(tmp_path))
    assert done.exit_code == 0, done.stderr
    written = tmp_path / "ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.yaml"  # its header's FP8, named as NVIDIA does
    assert done.stdout.strip() == str(written)
    assert preset_json(read_nemo(written)) == preset_json(read_nemo(LLAMA3_70B))


def test_convert_to_te_writes_the_ub_cfgs_dict(tmp_path: Path) -> None:
    out = tmp_path / "ub_cfgs.json"
    assert run("convert", str(LLAMA3_70B), "--to", "te", "--out", str(out)).exit_code == 0
    assert json.loads(out.read_text()) == to_te_dict(read_nemo(LLAMA3_70B))
    assert set(json.loads(out.read_text())) == set(yaml.safe_load(LLAMA3_70B.read_text()))


def test_convert_to_nemo_without_out_prints_the_yaml() -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "nemo")
    assert done.exit_code == 0 and yaml.safe_load(done.stdout) == yaml.safe_load(LLAMA3_70B.read_text())


def test_convert_to_an_unknown_format_exits_2() -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "hydra")
    assert done.exit_code == 2 and "hydra" in done.stderr


def test_convert_to_te_into_a_new_folder_creates_it_and_names_the_file_as_nvidia(tmp_path: Path) -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "te", "--out", f"{tmp_path}/te/")
    assert done.exit_code == 0, done.stderr
    # The dtype NVIDIA's header gives (FP8) goes into the name: a TE dict has no header to carry it.
    assert done.stdout.strip() == str(tmp_path / "te" / "ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192.json")


def test_convert_into_a_missing_parent_exits_2_naming_out(tmp_path: Path) -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "nemo", "--out", str(tmp_path / "no" / "such.yaml"))
    assert done.exit_code == 2 and done.stderr.startswith("error: out: must be in an existing folder")


def _truncated(tmp_path: Path, lines: int) -> Path:
    """NVIDIA's Llama 3 70B file cut after ``lines`` lines, under its own name (so the shape is still known)."""
    cut = tmp_path / LLAMA3_70B.name
    cut.write_text("\n".join(LLAMA3_70B.read_text().splitlines()[:lines]) + "\n")
    return cut


def test_validate_of_a_truncated_file_exits_2_naming_the_missing_slots(tmp_path: Path) -> None:
    cut = _truncated(tmp_path, 24)
    kept = set(yaml.safe_load(cut.read_text()))
    assert 0 < len(kept) < 10
    done = run("validate", str(cut))
    assert done.exit_code == 2
    assert done.stderr.startswith(f"error: file: leaves out {10 - len(kept)} slots: qkv_fprop, ")
    assert "pass --partial" in done.stderr


def test_validate_partial_accepts_a_truncated_file_with_a_warning(tmp_path: Path) -> None:
    done = run("validate", "--partial", str(_truncated(tmp_path, 24)))
    assert done.exit_code == 0, done.stderr
    (warning,) = json.loads(done.stdout)["warnings"]
    assert warning.startswith("leaves out ") and "fc2_fprop" in warning and "warning: leaves out" in done.stderr


def test_validate_refuses_a_count_beyond_the_knob_bound_naming_it(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    text = LLAMA3_70B.read_text()
    assert "  num_sm: 24\n" in text
    big.write_text(text.replace("  num_sm: 24\n", "  num_sm: 99999999999999999999999\n", 1))
    done = run("validate", str(big))
    assert done.exit_code == 2
    assert done.stderr.startswith("error: ") and "num_sm: must be between 1 and 64 (got 99999999999999999999999)" in (
        done.stderr
    )


def test_a_te_json_validates_bare_or_with_its_shape(tmp_path: Path) -> None:
    """The JSON `convert --to te` and `autotune tune` write (shape from the file name), and the normalized
    view `GET /v1/presets?format=te` serves (shape inside), read back as the YAML they came from."""
    done = run("convert", str(LLAMA3_70B), "--to", "te", "--out", str(tmp_path))
    assert done.exit_code == 0, done.stderr
    bare = Path(done.stdout.strip())
    normalized = tmp_path / "served.json"
    normalized.write_text(json.dumps(preset_json(read_nemo(LLAMA3_70B))))
    for file in (bare, normalized):
        validated = run("validate", str(file))
        assert validated.exit_code == 0, validated.stderr
        got = json.loads(validated.stdout)
        # The bare JSON's name says fp8, which the YAML's name leaves to its header: both read fp8.
        assert got["shape"]["dtype"] == "fp8" and got["dtype"] == "fp8"
        assert got == preset_json(read_nemo(LLAMA3_70B)) | {"warnings": []}
    normalized.write_text('{"ub_cfgs": {"qkv_fprp": {}}}')
    assert run("validate", str(normalized)).stderr.startswith("error: qkv_fprp: is not a TE userbuffers slot")


BRIDGE_PRESETS = PRESETS / "bridge" / "comm_overlap_presets.py"
LORA = "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora"


def test_validate_for_a_consumer_says_what_it_runs_and_refuses_what_it_cannot_run_as_written() -> None:
    """NVIDIA's Bridge LoRA preset mixes a bulk qkv_dgrad with a pipeline fc1_dgrad: Megatron and Bridge run it
    only with tp_comm_overlap_disable_qkv (as NeMo's own script sets), hand-built TE modules as it is."""
    refused = run("validate", str(BRIDGE_PRESETS), "--preset", LORA, "--for", "megatron")
    assert refused.exit_code == 2, refused.stderr
    assert "error: fc1_dgrad: " in refused.stderr and "tp_comm_overlap_disable_qkv=true" in refused.stderr
    runs = json.loads(refused.stdout)["runs"]
    assert runs["slots"]["fc1_dgrad"] == {"runs": "bulk", "asked": "rs_dgrad"}
    fixed = run(
        "validate",
        str(BRIDGE_PRESETS),
        "--preset",
        LORA,
        "--for",
        "bridge",
        "--set",
        "tp_comm_overlap_disable_qkv=true",
    )
    assert fixed.exit_code == 0, fixed.stderr
    runs = json.loads(fixed.stdout)["runs"]
    assert runs["switches"] == {
        "model_config": {"tp_comm_overlap": True, "tp_comm_overlap_rs_dgrad": True, "tp_comm_overlap_disable_qkv": True}
    }
    assert runs["slots"]["qkv_fprop"] == {"runs": "off", "asked": "overlap"} and runs["problems"] == []
    own = run("validate", str(BRIDGE_PRESETS), "--preset", LORA, "--for", "te-modules")
    assert own.exit_code == 0 and json.loads(own.stdout)["runs"]["switches"]["modules"]["fc1"]["ub_overlap_rs_dgrad"]
    for bad, field in (
        (["--for", "nemo"], "--for"),
        (["--for", "megatron", "--set", "tp_comm_overlap_rs_dgrad"], "--set"),
        (["--for", "megatron", "--set", "nosuch=true"], "switch"),
    ):
        wrong = run("validate", str(BRIDGE_PRESETS), "--preset", LORA, *bad)
        assert wrong.exit_code == 2 and field in wrong.stderr, (bad, wrong.stderr)


@pytest.mark.parametrize("consumer", ["megatron", "bridge", "te-layer", "te-modules"])
def test_an_nvidia_yaml_validates_for_every_consumer_with_the_switches_it_needs(consumer: str) -> None:
    """(Every NVIDIA preset's verdict per consumer is checked in-process: tests/test_consumers.py.)"""
    done = run("validate", str(LLAMA3_70B), "--for", consumer)
    assert done.exit_code == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert runs["consumer"] == consumer and runs["problems"] == []
    assert runs["slots"]["qkv_dgrad"] == {"runs": "bulk", "asked": "bulk"}


def test_our_own_format_validates_and_converts_to_te_as_te_runs_it(tmp_path: Path) -> None:
    ours = OursPreset(
        shape=ModelShape(hidden=1024, tp=2, seq=2048),
        gpu="NVIDIA H200",
        slots={
            Slot.QKV_FPROP: OursSlot.of(
                OverlapConfig(method=Method.RING_EXCHANGE, gemm="triton", num_max_streams=1), measurement(1.0)
            )
        },
    )
    path = tmp_path / ours_file_name(ours)
    path.write_text(write_ours(ours))
    checked = run("validate", str(path))
    assert checked.exit_code == 0, checked.stderr
    view = json.loads(checked.stdout)
    assert view["ours"]["slots"]["qkv_fprop"]["config"]["gemm"] == "triton"
    assert "measured with" in view["notes"]["qkv_fprop"]  # what TE runs differs, and the note says how
    converted = run("convert", str(path), "--to", "te")
    assert converted.exit_code == 0 and json.loads(converted.stdout)["qkv_fprop"]["method"] == "ring_exchange"


def test_convert_for_a_consumer_heads_the_file_with_the_switches_it_needs_and_they_read_back(tmp_path: Path) -> None:
    done = run("convert", str(BRIDGE_PRESETS), "--preset", LORA, "--to", "nemo", "--for", "megatron",
               "--set", "tp_comm_overlap_disable_qkv=true")  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert (
        "# autotune-switches (megatron): tp_comm_overlap_rs_dgrad=true, tp_comm_overlap_disable_qkv=true" in done.stdout
    )
    assert "TransformerConfig (no CLI flag): tp_comm_overlap_disable_qkv=True" in done.stdout
    path = tmp_path / "ub_cfg_h100_fp8_h8192_tp2_mbs1_seqlen4096.yaml"
    path.write_text(done.stdout)
    again = run("validate", str(path), "--partial", "--for", "megatron")  # the header's switches hold
    assert again.exit_code == 0, again.stderr
    refused = run("convert", str(BRIDGE_PRESETS), "--preset", LORA, "--to", "nemo", "--for", "megatron")
    assert refused.exit_code == 2 and "shared-dgrad-mode" in refused.stderr
