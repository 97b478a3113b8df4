"""Consumers: which switches each one has, what TE modules run under them, the joint choice and the checks of
a preset as written (search_spaces/consumers.py), one test per rule of `RULES` and per consumer."""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from pathlib import Path

import pytest

from autotune.cli.validation import preset_flags
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.errors import InputError
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.bridge import parse_bridge, read_bridge, write_bridge
from search_spaces.catalog import CATALOG
from search_spaces.consumers import (
    COLUMN,
    CUBLASMP_IGNORED,
    RULES,
    SWITCHES,
    Arg,
    Consumer,
    Measured,
    Mode,
    Module,
    SlotModes,
    check,
    choose,
    defaults,
    module_args,
    parse_switch_record,
    rendered,
    settings,
    slot_modes,
    switch_record,
    why,
)
from search_spaces.export import SlotResult, preset_from_results
from search_spaces.nemo_yaml import parse_nemo, write_nemo
from search_spaces.presets import Preset, PresetWarning
from search_spaces.registry import nvidia_presets
from search_spaces.te_dict import TE_KEYS

ROOT = Path(__file__).resolve().parent.parent
BRIDGE_PRESETS = ROOT / "search_spaces" / "nvidia_presets" / "bridge" / "comm_overlap_presets.py"
LORA = "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora"
SHAPE = ModelShape(hidden=8192, tp=2, seq=8192)

BULK = OverlapConfig(method=Method.BULK, num_sm=16, cga_size=2, set_sm_margin=True)
RING = OverlapConfig(method=Method.RING_EXCHANGE)
PIPE = OverlapConfig(method=Method.PIPELINE, num_sm=16, cga_size=2, num_splits=4, set_sm_margin=True)
NONE = OverlapConfig(method=Method.NONE)


def timed(overlap_ms: float, *, gemm_ms: float = 1.0, comm_ms: float = 0.4) -> Measurement:
    return Measurement(
        gemm_ms=gemm_ms,
        comm_ms=comm_ms,
        serial_ms=gemm_ms + comm_ms,
        overlap_ms=overlap_ms,
        rel_err=1e-3,
        cv=0.01,
        repeats=20,
        valid=True,
    )


def modes(**times: float) -> SlotModes:
    """A slot's measured modes: ``bulk=1.1, rs_dgrad=1.05, overlap=..., off=...`` (ms)."""
    config = {Mode.BULK: BULK, Mode.RS_DGRAD: RING, Mode.OVERLAP: RING, Mode.OFF: NONE}
    return SlotModes(
        by_mode={Mode(m): Measured(config=config[Mode(m)], measurement=timed(t)) for m, t in times.items()}
    )


def layer(*, qkv_bulk: float, qkv_rs: float, fc1_bulk: float, fc1_rs: float) -> dict[Slot, SlotModes]:
    """A whole layer whose fprop and row slots overlap at 1.0 ms (none at 1.4), dgrads as given, wgrads bulk at
    1.1 ms with a 1.0 ms GEMM."""
    measured = {slot: modes(overlap=1.0, off=1.4) for slot in (Slot.QKV_FPROP, Slot.PROJ_DGRAD, Slot.FC1_FPROP, Slot.FC2_DGRAD, Slot.PROJ_FPROP, Slot.FC2_FPROP)}  # fmt: skip
    measured[Slot.QKV_DGRAD] = modes(bulk=qkv_bulk, rs_dgrad=qkv_rs, off=1.4)
    measured[Slot.FC1_DGRAD] = modes(bulk=fc1_bulk, rs_dgrad=fc1_rs, off=1.4)
    measured[Slot.QKV_WGRAD] = modes(bulk=1.1, off=1.4)
    measured[Slot.FC1_WGRAD] = modes(bulk=1.1, off=1.4)
    return measured


# -- the rules ------------------------------------------------------------------------------------------


def test_every_rule_is_listed_with_its_source_in_docs_te_rules() -> None:
    doc = (ROOT / "docs" / "te_rules.md").read_text(encoding="utf-8")
    for rule in RULES:
        assert f"`{rule.id}`" in doc, rule.id
        repo, _, rest = rule.source.partition("@")
        assert repo in doc and rest.split(":")[0] in doc, rule.id


def test_rule_rs_dgrad_entry_drops_the_wgrad_from_an_export() -> None:
    results = {Slot.QKV_DGRAD: SlotResult(best=RING, best_ms=1.0), Slot.QKV_WGRAD: SlotResult(best=BULK, best_ms=1.0)}
    preset = preset_from_results(SHAPE, results)
    assert Slot.QKV_WGRAD not in preset.configs and "refuses" in preset.notes[Slot.QKV_WGRAD]


def test_rule_te_module_mode_rs_dgrad_turns_both_bulk_arguments_off() -> None:
    on = dict.fromkeys(Arg, True)
    args = {m: on for m in Module}
    got = slot_modes(args)
    assert (got[Slot.QKV_DGRAD], got[Slot.QKV_WGRAD]) == (Mode.RS_DGRAD, Mode.NO_COMM)
    args = {m: on | {Arg.RS_DGRAD: False, Arg.BULK_WGRAD: False} for m in Module}
    got = slot_modes(args)
    assert (got[Slot.FC1_DGRAD], got[Slot.FC1_WGRAD]) == (Mode.BULK, Mode.OFF)


@pytest.mark.parametrize("rule", ["rs-dgrad-on-bulk", "bulk-on-ring"])
def test_rules_on_mismatched_communicators_are_named_when_a_consumer_cannot_run_a_mixed_preset(rule: str) -> None:
    """A bulk entry beside an RS one: Megatron runs one of them in the other's mode, and says which rule bites."""
    entries = {Slot.QKV_DGRAD: BULK, Slot.FC1_DGRAD: RING, Slot.QKV_FPROP: RING, Slot.FC1_FPROP: RING}
    fixed = {"tp_comm_overlap_rs_dgrad": rule == "rs-dgrad-on-bulk"}
    result = check(Consumer.MEGATRON, entries, fixed=fixed)
    (run,) = result.not_as_written
    assert run.slot == (Slot.QKV_DGRAD if rule == "rs-dgrad-on-bulk" else Slot.FC1_DGRAD)
    text = why(run, Consumer.MEGATRON, entries)
    assert "shared-dgrad-mode" in text and rule in text
    assert ("pipelined GEMM+RS" in text) == (rule == "rs-dgrad-on-bulk")


@pytest.mark.parametrize("consumer", [Consumer.MEGATRON, Consumer.BRIDGE, Consumer.TE_LAYER])
def test_rule_shared_dgrad_mode_no_setting_gives_qkv_and_fc1_different_dgrad_modes_with_overlap_on(
    consumer: Consumer,
) -> None:
    for setting in settings(consumer):
        got = slot_modes(module_args(consumer, setting))
        both_on = got[Slot.QKV_FPROP] == got[Slot.FC1_FPROP] == Mode.OVERLAP
        if both_on:
            assert got[Slot.QKV_DGRAD] == got[Slot.FC1_DGRAD] or Mode.OFF in (got[Slot.QKV_DGRAD], got[Slot.FC1_DGRAD])


@pytest.mark.parametrize("consumer", [Consumer.MEGATRON, Consumer.BRIDGE, Consumer.TE_LAYER])
def test_rule_shared_ag_rs_one_switch_turns_every_all_gather_overlap_off(consumer: Consumer) -> None:
    name = "tp_comm_overlap_ag" if consumer != Consumer.TE_LAYER else "ub_overlap_ag"
    got = slot_modes(module_args(consumer, {name: False}))
    assert {got[s] for s in (Slot.QKV_FPROP, Slot.FC1_FPROP, Slot.PROJ_DGRAD, Slot.FC2_DGRAD)} == {Mode.OFF}
    assert got[Slot.PROJ_FPROP] == Mode.OVERLAP


@pytest.mark.parametrize("consumer", [Consumer.MEGATRON, Consumer.BRIDGE])
def test_rule_per_layer_disable_runs_qkv_bulk_beside_an_rs_dgrad_fc1_and_loses_qkv_fprop(consumer: Consumer) -> None:
    got = slot_modes(module_args(consumer, {"tp_comm_overlap_rs_dgrad": True, "tp_comm_overlap_disable_qkv": True}))
    assert (got[Slot.QKV_DGRAD], got[Slot.QKV_WGRAD], got[Slot.QKV_FPROP]) == (Mode.BULK, Mode.BULK, Mode.OFF)
    assert (got[Slot.FC1_DGRAD], got[Slot.FC1_WGRAD], got[Slot.FC1_FPROP]) == (
        Mode.RS_DGRAD,
        Mode.NO_COMM,
        Mode.OVERLAP,
    )
    assert not any(s.flag for s in SWITCHES[consumer] if s.name.startswith("tp_comm_overlap_disable"))


def test_rule_megatron_flags_render_as_megatron_lm_spells_them() -> None:
    setting = {"tp_comm_overlap_rs_dgrad": True, "tp_comm_bulk_wgrad": False, "tp_comm_overlap_disable_qkv": True}
    out = rendered(Consumer.MEGATRON, setting)
    assert out == {
        "flags": ["--tp-comm-overlap", "--tp-comm-overlap-rs-dgrad", "--disable-tp-comm-bulk-wgrad"],
        "config": {"tp_comm_overlap_disable_qkv": True},
    }
    flags = {s.flag for s in SWITCHES[Consumer.MEGATRON] if s.flag}
    assert flags == {
        "--disable-tp-comm-overlap-ag",
        "--disable-tp-comm-overlap-rs",
        "--tp-comm-overlap-rs-dgrad",
        "--disable-tp-comm-bulk-dgrad",
        "--disable-tp-comm-bulk-wgrad",
    }


def test_rule_bridge_model_config_carries_the_fields_a_bridge_module_defines() -> None:
    assert rendered(Consumer.BRIDGE, {"tp_comm_overlap_rs_dgrad": True}) == {
        "model_config": {"tp_comm_overlap": True, "tp_comm_overlap_rs_dgrad": True}
    }
    assert all(s.flag is None for s in SWITCHES[Consumer.BRIDGE])


def test_rule_te_modules_own_args_every_module_has_its_own_arguments_all_off() -> None:
    names = {s.name for s in SWITCHES[Consumer.TE_MODULES]}
    assert "qkv.ub_overlap_rs_dgrad" in names and "fc1.ub_bulk_dgrad" in names and "proj.ub_overlap_rs" in names
    assert set(defaults(Consumer.TE_MODULES).values()) == {False}
    got = slot_modes(module_args(Consumer.TE_MODULES, {"fc1.ub_overlap_rs_dgrad": True, "qkv.ub_bulk_dgrad": True}))
    assert (got[Slot.QKV_DGRAD], got[Slot.FC1_DGRAD]) == (Mode.BULK, Mode.RS_DGRAD)


def test_rule_cublasmp_ignores_every_tuned_key_but_num_sm_and_atomic_gemm() -> None:
    assert set(CUBLASMP_IGNORED) <= set(TE_KEYS)
    assert "num_sm" not in CUBLASMP_IGNORED and "atomic_gemm" not in CUBLASMP_IGNORED


# -- the joint choice ---------------------------------------------------------------------------------


def test_megatron_chooses_both_rs_when_their_summed_time_beats_both_bulk_and_shows_the_sums() -> None:
    # bulk: 1.2 + 1.1 (wgrad) per layer = 4.6; rs: max(1.05, 0.4 ag) + 1.0 (wgrad GEMM) per layer = 4.1
    choice = choose(Consumer.MEGATRON, layer(qkv_bulk=1.2, qkv_rs=1.05, fc1_bulk=1.2, fc1_rs=1.05))
    assert choice.chosen.changed == {"tp_comm_overlap_rs_dgrad": True}
    fprops = 6 * 1.0
    assert choice.chosen.total_ms == pytest.approx(fprops + 2 * (1.05 + 1.0))
    bulk = next(a for a in choice.alternatives if not a.changed)
    assert bulk.total_ms == pytest.approx(fprops + 2 * (1.2 + 1.1))
    assert choice.entries[Slot.QKV_DGRAD].config == RING and Slot.QKV_WGRAD not in choice.entries


def test_megatron_never_mixes_dgrad_modes_where_te_modules_would() -> None:
    measured = layer(qkv_bulk=1.0, qkv_rs=1.6, fc1_bulk=1.8, fc1_rs=1.0)  # qkv wants bulk, fc1 wants rs
    per_module = choose(Consumer.TE_MODULES, measured)
    got = per_module.chosen.modes
    assert (got[Slot.QKV_DGRAD], got[Slot.FC1_DGRAD]) == (Mode.BULK, Mode.RS_DGRAD)
    joint = choose(Consumer.MEGATRON, measured).chosen
    mixed = joint.modes[Slot.QKV_DGRAD] != joint.modes[Slot.FC1_DGRAD]
    assert (
        not mixed
        or joint.changed.get("tp_comm_overlap_disable_qkv")
        or joint.changed.get("tp_comm_overlap_disable_fc1")
    )


def test_an_rs_dgrad_counts_the_unmeasured_all_gather_beside_it_up_to_its_own_time() -> None:
    slot = SlotModes(
        by_mode={
            Mode.RS_DGRAD: Measured(config=RING, measurement=timed(0.9)),
            Mode.BULK: Measured(config=BULK, measurement=timed(1.2, comm_ms=1.5)),
        }
    )
    assert slot.time_ms(Mode.RS_DGRAD) == 1.5 and slot.time_ms(Mode.NO_COMM) == 1.0 and slot.time_ms(Mode.OFF) is None


def test_a_setting_whose_mode_was_never_measured_cannot_win() -> None:
    measured = layer(qkv_bulk=1.2, qkv_rs=1.05, fc1_bulk=1.2, fc1_rs=1.05)
    measured[Slot.FC1_DGRAD] = modes(bulk=1.2, off=1.4)  # no RS measured for fc1
    choice = choose(Consumer.MEGATRON, measured)
    assert choice.chosen.modes[Slot.FC1_DGRAD] != Mode.RS_DGRAD
    unmeasured = [a for a in choice.alternatives if a.total_ms is None]
    assert unmeasured and all(
        Slot.FC1_DGRAD in a.unmeasured for a in unmeasured if a.modes[Slot.FC1_DGRAD] == Mode.RS_DGRAD
    )


@pytest.mark.parametrize("consumer", list(Consumer))
def test_every_consumers_export_runs_as_measured_under_its_own_switches(consumer: Consumer) -> None:
    """Whatever the numbers, the preset made for a consumer passes that consumer's check with its own switches."""
    for qkv_bulk, fc1_bulk in itertools.product((0.9, 1.3), repeat=2):
        results = {
            slot: SlotResult(best=m.by_mode[Mode.OFF].config, best_ms=1.4, modes=m)
            for slot, m in layer(qkv_bulk=qkv_bulk, qkv_rs=1.1, fc1_bulk=fc1_bulk, fc1_rs=1.1).items()
        }
        preset = preset_from_results(SHAPE, results, gpu="h200", consumer=consumer)
        assert check(consumer, preset.configs, fixed=preset.setting).ok
        if consumer == Consumer.MEGATRON:
            modes_ = slot_modes(module_args(consumer, preset.setting))
            layers_off = preset.setting["tp_comm_overlap_disable_qkv"] or preset.setting["tp_comm_overlap_disable_fc1"]
            assert modes_[Slot.QKV_DGRAD] == modes_[Slot.FC1_DGRAD] or layers_off


# -- presets as written ---------------------------------------------------------------------------------


def test_nvidias_bridge_lora_preset_needs_disable_qkv_in_megatron_and_bridge_and_runs_as_written_in_te_modules() -> (
    None
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        lora = read_bridge(BRIDGE_PRESETS, name=LORA)
    for consumer in (Consumer.MEGATRON, Consumer.BRIDGE):
        result = check(consumer, lora.configs)
        assert [r.slot for r in result.not_as_written] == [Slot.FC1_DGRAD]
        assert "tp_comm_overlap_disable_qkv=true" in why(result.not_as_written[0], consumer, lora.configs)
        fixed = check(consumer, lora.configs, fixed={"tp_comm_overlap_disable_qkv": True})
        assert fixed.ok and fixed.changed == {"tp_comm_overlap_rs_dgrad": True, "tp_comm_overlap_disable_qkv": True}
    assert not check(Consumer.TE_LAYER, lora.configs).ok
    assert check(Consumer.TE_MODULES, lora.configs).ok


def _nvidia_presets() -> list[tuple[str, dict[Slot, OverlapConfig]]]:
    found = [(p.source or "?", dict(p.configs)) for p in nvidia_presets()]
    names = re.findall(r"^(userbuffers_\w+) =", BRIDGE_PRESETS.read_text(encoding="utf-8"), re.MULTILINE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PresetWarning)
        found += [(f"bridge:{n}", dict(read_bridge(BRIDGE_PRESETS, name=n).configs)) for n in names]
    return found


@pytest.mark.parametrize("consumer", list(Consumer))
def test_every_nvidia_preset_gets_a_verdict_with_an_explanation_per_consumer(consumer: Consumer) -> None:
    presets = _nvidia_presets()
    assert len(presets) == 24 + 19  # NVIDIA's YAML files (hydra dummies included) and Bridge's presets
    failing = []
    for source, configs in presets:
        result = check(consumer, configs)
        assert set(result.setting) == set(defaults(consumer)), source
        for run in result.not_as_written:
            assert why(run, consumer, configs).startswith(run.slot.value), source
        if not result.ok:
            failing.append(source)
    # NVIDIA's mixed LoRA presets are the ones Megatron-LM cannot run as written without disable_qkv/fc1.
    expected = {
        s
        for s, c in presets
        if {Slot.QKV_DGRAD, Slot.FC1_DGRAD} <= set(c) and c[Slot.QKV_DGRAD].method != c[Slot.FC1_DGRAD].method
    }
    assert expected, "NVIDIA ships mixed dgrad presets (the Bridge LoRA ones)"
    assert set(failing) == (set() if consumer == Consumer.TE_MODULES else expected)


# -- the record in a file -----------------------------------------------------------------------------


@pytest.mark.parametrize("consumer", list(Consumer))
def test_the_switch_record_reads_back(consumer: Consumer) -> None:
    setting = defaults(consumer) | {SWITCHES[consumer][0].name: not SWITCHES[consumer][0].default}
    assert parse_switch_record("# " + switch_record(consumer, setting)) == (consumer, setting)


def test_a_megatron_export_says_its_flags_in_the_yaml_and_the_bridge_module_and_both_read_back() -> None:
    results = {
        slot: SlotResult(best=NONE, best_ms=1.4, modes=m)
        for slot, m in layer(qkv_bulk=1.3, qkv_rs=1.0, fc1_bulk=1.3, fc1_rs=1.0).items()
    }
    preset = preset_from_results(SHAPE, results, gpu="h200", consumer=Consumer.MEGATRON)
    text = write_nemo(preset)
    assert "--tp-comm-overlap-rs-dgrad" in text and "Made for megatron" in text
    back = parse_nemo(text, name="ub_cfg_h200_bf16_h8192_tp2_mbs1_seqlen8192.yaml")
    assert (back.consumer, dict(back.setting)) == (Consumer.MEGATRON, dict(preset.setting))
    module = write_bridge(preset)
    assert "_model_config = {'tp_comm_overlap': True, 'tp_comm_overlap_rs_dgrad': True}" in module
    read = parse_bridge(module)
    assert (read.consumer, dict(read.setting)) == (Consumer.MEGATRON, dict(preset.setting))


def test_column_modules_are_the_ones_with_dgrad_modes() -> None:
    assert {m.value for m in COLUMN} == {"qkv", "fc1"}
    assert {info.slot for info in CATALOG if info.tuned} == set(slot_modes(module_args(Consumer.TE_LAYER, {})))


def test_validate_on_te_builds_the_layer_with_the_consumers_switches_or_says_why_it_cannot() -> None:
    """`autotune validate --backend te --for C` times te.TransformerLayer under C's switches (one set for the
    layer): megatron's defaults and te-layer's map to one set; a per-layer disable cannot."""
    both_rs = Preset(configs={Slot.QKV_DGRAD: RING, Slot.FC1_DGRAD: RING, Slot.QKV_FPROP: RING})
    assert preset_flags(both_rs, Consumer.MEGATRON) == {
        "ub_overlap_ag": True,
        "ub_overlap_rs": True,
        "ub_overlap_rs_dgrad": True,
        "ub_bulk_dgrad": True,
        "ub_bulk_wgrad": True,
    }
    assert preset_flags(both_rs, Consumer.TE_LAYER)["ub_overlap_rs_dgrad"] is True
    qkv_bulk = Preset(configs={Slot.QKV_DGRAD: BULK, Slot.FC1_DGRAD: RING})
    switches = {"tp_comm_overlap_rs_dgrad": True, "tp_comm_overlap_disable_qkv": True}
    disabled = dataclasses.replace(qkv_bulk, consumer=Consumer.MEGATRON, setting=defaults(Consumer.MEGATRON) | switches)
    with pytest.raises(InputError, match=r"te\.TransformerLayer takes one set"):
        preset_flags(disabled, Consumer.MEGATRON)
    mixed = Preset(configs={Slot.QKV_DGRAD: BULK, Slot.FC1_DGRAD: RING, Slot.QKV_FPROP: RING, Slot.FC1_FPROP: RING})
    with pytest.raises(InputError, match="shared-dgrad-mode"):
        preset_flags(mixed, Consumer.TE_LAYER)
