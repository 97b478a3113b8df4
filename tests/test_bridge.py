"""Megatron-Bridge / NeMo 2 preset modules: NVIDIA's YAML -> ours -> a Bridge module -> ours, without loss, and
the module runs in plain Python against stand-in dataclasses of Bridge's fields, handing TE what we meant."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import (
    Preset,
    PresetError,
    PresetWarning,
    bridge_file_name,
    nvidia_presets,
    parse_bridge,
    preset_json,
    read_bridge,
    read_nemo,
    write_bridge,
)
from search_spaces.te_dict import parse_entry, te_config

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
PRESETS = nvidia_presets()
LLAMA3_70B = next(p for p in PRESETS if p.source == "nvidia:launcher/ub_cfg_h100_h8192_tp4_mbs1_seqlen8192.yaml")

STAND_INS = '''
"""Stand-ins with the fields and defaults of Megatron-Bridge's comm_overlap.py (NeMo 2's userbuffers.py)."""
from dataclasses import dataclass


@dataclass
class TPOverlapCfg:
    pass


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = (False,)
    atomic_gemm: bool = False
    method: str = "pipeline"


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    aggregate: bool = False
    method: str = "ring_exchange"
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = "bulk"


@dataclass
class TransformerLayerTPOverlapCfg:
    qkv_dgrad: TPOverlapCfg
    qkv_wgrad: TPOverlapCfg
    fc1_dgrad: TPOverlapCfg
    fc1_wgrad: TPOverlapCfg
    qkv_fprop: TPOverlapCfg
    proj_dgrad: TPOverlapCfg
    fc1_fprop: TPOverlapCfg
    fc2_dgrad: TPOverlapCfg
    proj_fprop: TPOverlapCfg
    fc2_fprop: TPOverlapCfg
'''

LOAD = """
import dataclasses, importlib.util, json, sys
out = {}
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("preset_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer = next(v for k, v in vars(module).items() if k.startswith("userbuffers") and dataclasses.is_dataclass(v))
    # what Megatron-Bridge's CommOverlapConfig.setup hands TE: asdict, top-level None dropped
    out[path] = {k: v for k, v in dataclasses.asdict(layer).items() if v is not None}
print(json.dumps(out))
"""


def tuned_preset() -> Preset:
    """A preset with every key Bridge's classes lack: use_ce, both priorities, pipeline_rs_overlap_first_gemm,
    and an external wgrad slot."""
    raw = {
        Slot.QKV_FPROP: OverlapConfig(method=Method.RING_EXCHANGE, use_ce=False, num_sm=2, set_sm_margin=True),
        Slot.PROJ_DGRAD: OverlapConfig(method=Method.RING_EXCHANGE, comm_priority=-2, gemm_priority=0),
        Slot.PROJ_FPROP: OverlapConfig(
            method=Method.PIPELINE, num_sm=8, num_splits=2, pipeline_rs_overlap_first_gemm=True, fp8_buf=True
        ),
        Slot.FC2_FPROP: OverlapConfig(method=Method.RING_EXCHANGE, num_sm=4, set_sm_margin=True),
        Slot.QKV_WGRAD: OverlapConfig(method=Method.BULK, num_sm=4, cga_size=1, set_sm_margin=True),
        Slot.FC2_DGRAD: OverlapConfig(method=Method.RING_EXCHANGE),
        Slot.FC2_WGRAD: OverlapConfig(method=Method.EXTERNAL, num_sm=2, comm_priority=-1),
    }
    configs = {slot: te_config(slot, config) for slot, config in raw.items()}
    notes = {Slot.QKV_FPROP: "measured with 1 compute streams (TE uses 2)", Slot.FC1_WGRAD: "left out: a note"}
    shape = ModelShape(hidden=8192, tp=2, seq=8192)
    return Preset(configs=configs, shape=shape, gpu="h200", dtype="bf16", notes=notes)


def same(a: Preset, b: Preset) -> bool:
    return (dict(a.configs), a.shape, a.gpu, a.dtype) == (dict(b.configs), b.shape, b.gpu, b.dtype)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.source)
def test_every_nvidia_preset_round_trips_through_a_bridge_module(preset: Preset) -> None:
    text = write_bridge(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PresetWarning)  # our own module never trips a warning
        back = parse_bridge(text)
    assert same(back, preset)


def test_a_tuned_preset_keeps_the_keys_bridge_lacks_in_subclasses() -> None:
    preset = tuned_preset()
    text = write_bridge(preset)
    assert "class RingExchangeOverlapCfgWithUseCe(RingExchangeOverlapCfg):" in text
    assert "class RingExchangeOverlapCfgWithCommPriorityGemmPriority(RingExchangeOverlapCfg):" in text
    assert "class PipelineOverlapCfgWithPipelineRsOverlapFirstGemm(PipelineOverlapCfg):" in text
    assert "fc2_wgrad=ExternalOverlapCfgWithCommPriority(" in text
    assert "# qkv_fprop: measured with 1 compute streams" in text and "# fc1_wgrad: left out" in text
    assert "fc1_dgrad=None" in text  # a left-out slot of a required field, as Bridge's LoRA presets write it
    assert same(parse_bridge(text), preset)


def test_bridge_modules_import_with_stand_in_dataclasses_and_hand_te_the_same_entries(tmp_path: Path) -> None:
    """Every NVIDIA preset and the tuned one, as modules run by plain Python: asdict() of each, read by our
    strict TE entry reader, is the preset's effective entry, and every fp8_buf is an explicit flag."""
    package = tmp_path / "site" / "megatron" / "bridge" / "training"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "comm_overlap.py").write_text(STAND_INS)
    presets = {str(tmp_path / f"m{i}.py"): p for i, p in enumerate([*PRESETS, tuned_preset()])}
    for path, preset in presets.items():
        Path(path).write_text(write_bridge(preset))
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); exec({LOAD!r})"
    done = subprocess.run(
        [sys.executable, "-I", "-c", code, *presets],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    handed = json.loads(done.stdout)
    for path, preset in presets.items():
        entries = handed[path]
        assert set(entries) == {slot.value for slot in preset.configs}, preset.source
        for slot, config in preset.configs.items():
            entry = entries[slot.value]
            assert "fp8_buf" not in entry or isinstance(entry["fp8_buf"], bool)
            with warnings.catch_warnings():
                warnings.simplefilter("error", PresetWarning)
                assert parse_entry(slot, entry) == config, (preset.source, slot)


def test_a_module_falls_back_to_nemo_2s_classes(tmp_path: Path) -> None:
    package = tmp_path / "site" / "nemo" / "collections" / "llm" / "recipes" / "tp_overlap_configs"
    package.mkdir(parents=True)
    for folder in [package, *list(package.parents)[: len(package.relative_to(tmp_path / "site").parts) - 1]]:
        (folder / "__init__.py").write_text("")
    (package / "userbuffers.py").write_text(STAND_INS)
    module = tmp_path / "m.py"
    module.write_text(write_bridge(LLAMA3_70B))
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); exec({LOAD!r})"
    done = subprocess.run(
        [sys.executable, "-I", "-c", code, str(module)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[str(module)]["proj_fprop"]["num_sm"] == 24


BRIDGE_STYLE = """
from megatron.bridge.training.comm_overlap import (
    BulkOverlapCfg, PipelineOverlapCfg, RingExchangeOverlapCfg, TransformerLayerTPOverlapCfg,
)

# written as Bridge writes its LoRA presets: the wgrads left out, a pipeline without fp8_buf
userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora = TransformerLayerTPOverlapCfg(
    qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
    qkv_wgrad=None,
    fc1_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
    fc1_wgrad=None,
    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
    proj_dgrad=RingExchangeOverlapCfg(set_sm_margin=True),
    fc1_fprop=RingExchangeOverlapCfg(),
    fc2_dgrad=RingExchangeOverlapCfg(),
    proj_fprop=PipelineOverlapCfg(num_sm=32, cga_size=2, num_splits=4, set_sm_margin=True),
    fc2_fprop=PipelineOverlapCfg(num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True, fp8_buf=False),
)
"""


def test_a_bridge_style_module_is_read_as_te_runs_it() -> None:
    with pytest.warns(PresetWarning, match=r"proj_fprop.fp8_buf: \(False,\) is truthy"):
        preset = parse_bridge(BRIDGE_STYLE, source="lora.py")
    assert preset.source == "lora.py:userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora"
    assert preset.shape == ModelShape(hidden=8192, tp=2, seq=4096, dtype="fp8")
    assert (preset.gpu, preset.dtype) == ("h100", "fp8")
    assert Slot.QKV_WGRAD not in preset.configs and Slot.FC1_WGRAD not in preset.configs
    assert preset.configs[Slot.PROJ_FPROP].fp8_buf is True  # the truthy default, as TE reads it
    assert preset.configs[Slot.FC2_FPROP].fp8_buf is False
    assert preset.configs[Slot.PROJ_DGRAD].set_sm_margin is True
    assert preset.configs[Slot.QKV_FPROP].fp8_buf is True  # TE forces FP8 buffers on all-gathers


def test_the_module_is_parsed_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    text = f"open({str(marker)!r}, 'w').close()\nraise SystemExit(3)\n" + BRIDGE_STYLE.replace(
        "fp8_buf=False", "fp8_buf=True"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        assert parse_bridge(text).configs[Slot.FC2_FPROP].fp8_buf is True
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "field", "rule"),
    [
        (("num_sm=16,", "num_sm=__import__('os').cpu_count(),"), "fc2_fprop.num_sm", "must be a literal"),
        (("aggregate=False", "agregate=False"), "qkv_fprop.agregate", "is not a field of RingExchangeOverlapCfg"),
        (("num_sm=2, cga_size=2,", "cga_size=2,"), "qkv_dgrad.num_sm", "is required by BulkOverlapCfg"),
        (("qkv_wgrad=None", "qkv_wgrad=None, qkv_wgard=None"), "TransformerLayerTPOverlapCfg.qkv_wgard", "not a field"),
        (
            ("fc1_fprop=RingExchangeOverlapCfg()", "fc1_fprop=RingExchangeOverlapCfg(num_splits=2)"),
            "fc1_fprop.num_splits",
            "not a field",
        ),
        (
            ("RingExchangeOverlapCfg(set_sm_margin=True)", "{'method': 'bulk'}"),
            "proj_dgrad",
            "must be an overlap config",
        ),
    ],
)
def test_a_bad_entry_is_rejected_naming_field_and_rule(change: tuple[str, str], field: str, rule: str) -> None:
    with pytest.raises(PresetError, match=rule) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        parse_bridge(BRIDGE_STYLE.replace(*change))
    assert caught.value.field == field


def test_a_key_te_does_not_know_is_rejected_even_in_a_subclass() -> None:
    subclass = """
from dataclasses import dataclass

@dataclass(kw_only=True)
class Mine(RingExchangeOverlapCfg):
    use_cee: bool
"""
    text = subclass + BRIDGE_STYLE.replace("fc1_fprop=RingExchangeOverlapCfg()", "fc1_fprop=Mine(use_cee=False)")
    with (
        pytest.raises(PresetError, match=r"is not a TE ub_cfgs key .*did you mean use_ce") as caught,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", PresetWarning)
        parse_bridge(text)
    assert caught.value.field == "fc1_fprop.use_cee"


def test_a_subclass_that_is_not_a_dataclass_is_rejected() -> None:
    """asdict() would silently drop the fields of a plain subclass: exactly the loss this format must avoid."""
    text = "class Mine(RingExchangeOverlapCfg):\n    use_ce: bool = False\n" + BRIDGE_STYLE
    with pytest.raises(PresetError, match="must be a @dataclass"):
        parse_bridge(text)


def test_a_module_with_its_own_class_definitions_uses_them() -> None:
    """Older NeMo versions define RingExchangeOverlapCfg with only aggregate and method."""
    old = """
from dataclasses import dataclass

@dataclass
class TPOverlapCfg:
    pass

@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    aggregate: bool = False
    method: str = 'ring_exchange'
"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        assert parse_bridge(old + BRIDGE_STYLE.replace("(set_sm_margin=True)", "()")).configs[Slot.PROJ_DGRAD]
        with pytest.raises(PresetError, match="is not a field of RingExchangeOverlapCfg"):
            parse_bridge(old + BRIDGE_STYLE)


def test_bridges_own_layout_is_read_class_definitions_and_all() -> None:
    """Bridge's comm_overlap.py itself: the classes defined in it, a try-import, an unrelated dataclass with
    non-literal defaults and methods, then several presets."""
    unrelated = """
try:
    import transformer_engine  # noqa: F401
    HAVE_TE = True
except ImportError:
    HAVE_TE = False


@dataclass(kw_only=True)
class CommOverlapConfig:
    tp_comm_overlap: bool
    tp_comm_overlap_cfg: Optional[TransformerLayerTPOverlapCfg] = None

    def setup(self):
        return asdict(self.tp_comm_overlap_cfg)
"""
    presets = BRIDGE_STYLE.split("\n", 4)[4]  # without its import
    text = STAND_INS + unrelated + presets + presets.replace("seqlen4096_lora =", "seqlen8192 =")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        preset = parse_bridge(text, name="userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen8192", source="comm_overlap.py")
    assert preset.source == "comm_overlap.py:userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen8192"
    assert preset.configs[Slot.PROJ_FPROP].num_sm == 32 and Slot.QKV_WGRAD not in preset.configs


def test_a_module_of_several_presets_needs_a_name() -> None:
    two = BRIDGE_STYLE + BRIDGE_STYLE.replace("seqlen4096_lora =", "seqlen8192 =")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        with pytest.raises(PresetError, match="several presets; name one of") as caught:
            parse_bridge(two)
        assert caught.value.field == "preset"
        chosen = parse_bridge(two, name="userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen8192")
    assert chosen.shape == ModelShape(hidden=8192, tp=2, seq=8192, dtype="fp8")
    with pytest.raises(PresetError, match="defines no TransformerLayerTPOverlapCfg"):
        parse_bridge("x = 1\n")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AUTOTUNE, "preset", *args], capture_output=True, text=True, timeout=60, check=False)


def test_cli_converts_yaml_to_a_bridge_module_and_validates_it(tmp_path: Path) -> None:
    yaml_file = Path(str(LLAMA3_70B.source).replace("nvidia:", ""))
    source = Path(__file__).resolve().parent.parent / "search_spaces" / "nvidia_presets" / yaml_file
    done = run("convert", str(source), "--to", "bridge", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    written = tmp_path / bridge_file_name(read_nemo(source))
    assert (
        done.stdout.strip() == str(written) and written.name == "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192.py"
    )  # its header says FP8
    validated = run("validate", str(written))
    assert validated.returncode == 0, validated.stderr
    assert json.loads(validated.stdout) == preset_json(read_nemo(source)) | {"warnings": []}
    back = run("convert", str(written), "--to", "nemo")
    assert back.returncode == 0 and "proj_fprop:" in back.stdout
    assert same(read_bridge(written), read_nemo(source))


def test_cli_names_the_preset_of_a_module_that_defines_several(tmp_path: Path) -> None:
    module = tmp_path / "presets.py"
    module.write_text(BRIDGE_STYLE + BRIDGE_STYLE.replace("seqlen4096_lora =", "seqlen8192 ="))
    done = run("validate", str(module))
    assert done.returncode == 2 and done.stderr.startswith("error: preset: the module defines several presets")
    done = run("validate", str(module), "--preset", "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen8192")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shape"]["seq"] == 8192 and "is truthy" in done.stderr
