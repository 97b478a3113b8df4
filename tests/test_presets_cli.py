"""`autotune preset validate|convert` as a user runs them: exit 0 with JSON/YAML, exit 2 with `error: field: rule`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import yaml

from search_spaces import preset_json, read_nemo, to_te_dict

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
PRESETS = Path(str(resources.files("search_spaces") / "nvidia_presets"))
LLAMA3_70B = PRESETS / "launcher" / "ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AUTOTUNE, "preset", *args], capture_output=True, text=True, timeout=60, check=False)


def test_validate_prints_normalized_configs_as_json() -> None:
    done = run("validate", str(LLAMA3_70B))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == preset_json(read_nemo(LLAMA3_70B)) | {"warnings": []}
    assert out["shape"]["hidden"] == 8192 and out["ub_cfgs"]["proj_fprop"]["num_sm"] == 24


def test_validate_reports_the_dummy_warning() -> None:
    done = run("validate", str(PRESETS / "nemo" / "ub_cfg_h100_h6144_tp4_mbs4_seqlen2048.yaml"))
    assert done.returncode == 0
    assert json.loads(done.stdout)["ub_cfgs"] == {} and "warning:" in done.stderr


def test_validate_of_a_bad_file_exits_2_naming_field_and_rule(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("qkv_fprp:\n  method: ring_exchange\n")
    done = run("validate", str(bad))
    assert done.returncode == 2
    assert (
        done.stderr.startswith("error: qkv_fprp: is not a TE userbuffers slot")
        and "did you mean qkv_fprop" in done.stderr
    )


def test_validate_of_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    assert run("validate", str(tmp_path / "nope.yaml")).returncode == 2


def test_convert_to_nemo_into_a_folder_uses_nvidia_file_name_and_validates_again(tmp_path: Path) -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "nemo", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    written = tmp_path / LLAMA3_70B.name
    assert done.stdout.strip() == str(written)
    assert preset_json(read_nemo(written)) == preset_json(read_nemo(LLAMA3_70B))


def test_convert_to_te_writes_the_ub_cfgs_dict(tmp_path: Path) -> None:
    out = tmp_path / "ub_cfgs.json"
    assert run("convert", str(LLAMA3_70B), "--to", "te", "--out", str(out)).returncode == 0
    assert json.loads(out.read_text()) == to_te_dict(read_nemo(LLAMA3_70B))
    assert set(json.loads(out.read_text())) == set(yaml.safe_load(LLAMA3_70B.read_text()))


def test_convert_to_nemo_without_out_prints_the_yaml() -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "nemo")
    assert done.returncode == 0 and yaml.safe_load(done.stdout) == yaml.safe_load(LLAMA3_70B.read_text())


def test_convert_to_an_unknown_format_exits_2() -> None:
    done = run("convert", str(LLAMA3_70B), "--to", "hydra")
    assert done.returncode == 2 and "hydra" in done.stderr


def test_a_te_json_validates_bare_or_with_its_shape(tmp_path: Path) -> None:
    """The JSON `convert --to te` and `autotune tune` write (shape from the file name), and the normalized
    view `GET /v1/presets?format=te` serves (shape inside), read back as the YAML they came from."""
    done = run("convert", str(LLAMA3_70B), "--to", "te", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    bare = Path(done.stdout.strip())
    normalized = tmp_path / "served.json"
    normalized.write_text(json.dumps(preset_json(read_nemo(LLAMA3_70B))))
    for file in (bare, normalized):
        validated = run("validate", str(file))
        assert validated.returncode == 0, validated.stderr
        assert json.loads(validated.stdout) == preset_json(read_nemo(LLAMA3_70B)) | {"warnings": []}
    normalized.write_text('{"ub_cfgs": {"qkv_fprp": {}}}')
    assert run("validate", str(normalized)).stderr.startswith("error: qkv_fprp: is not a TE userbuffers slot")
