"""The knob table against what it describes: `OverlapConfig`'s fields, NVIDIA's preset files and TE's key sets."""

from __future__ import annotations

import dataclasses
import typing
from importlib import resources

import pytest
import yaml

from overlap_runtime.config import DEFAULTS, OverlapConfig, check_config, problem
from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import BY_NAME, CONFIG_KNOBS, KNOBS, TE_KEYS, Kind, Method, Origin, te_used
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import te_dict

FIELD_TYPES = {
    Kind.FLAG: {bool, bool | None},
    Kind.COUNT: {int | None},
    Kind.INTEGER: {int | None},
    Kind.CHOICE: {str | None, Method},
}


def nvidia_entries() -> list[tuple[str, list[str]]]:
    """(file and slot, keys in the order the file writes them) for every entry of NVIDIA's preset files."""
    entries = []
    for folder in (resources.files("search_spaces") / "nvidia_presets").iterdir():
        for file in folder.iterdir() if folder.is_dir() else ():
            data = yaml.safe_load(file.read_text(encoding="utf-8")) if file.name.endswith(".yaml") else None
            entries += [(f"{folder.name}/{file.name}:{slot}", list(entry)) for slot, entry in (data or {}).items()]
    return entries


def test_every_config_field_has_exactly_one_knob_and_every_knob_a_field() -> None:
    names = [knob.name for knob in KNOBS]
    assert len(names) == len(set(names))
    assert [k.name for k in CONFIG_KNOBS] == [k.name for k in KNOBS if k.field]
    assert {k.name for k in CONFIG_KNOBS} == {f.name for f in dataclasses.fields(OverlapConfig)}
    assert [k.name for k in KNOBS if not k.field] == ["is_reduce_scatter"]  # implied by the slot and method


def test_each_knobs_kind_matches_its_field_type() -> None:
    hints = typing.get_type_hints(OverlapConfig)
    for knob in CONFIG_KNOBS:
        assert hints[knob.name] in FIELD_TYPES[knob.kind], knob.name
        assert (knob.kind == Kind.CHOICE) == bool(knob.choices), knob.name
        assert (knob.kind in (Kind.COUNT, Kind.INTEGER)) == (knob.bounds is not None), knob.name


def test_te_keys_are_the_tables_te_knobs_in_the_order_nvidias_files_write_them() -> None:
    assert te_dict.TE_KEYS == TE_KEYS == tuple(k.name for k in KNOBS if k.origin == Origin.TE)
    entries = nvidia_entries()
    assert len(entries) > 50
    for where, keys in entries:
        assert set(keys) <= set(TE_KEYS), where
        assert keys == sorted(keys, key=TE_KEYS.index), where


def test_our_knobs_are_no_te_keys_and_te_reads_none_of_them() -> None:
    ours = [k for k in KNOBS if k.origin == Origin.RUNTIME]
    assert [k.name for k in ours] == ["num_max_streams", "gemm", "fused"]
    assert all(not k.te_methods and k.te_default is None for k in ours)
    for method in (Method.RING_EXCHANGE, Method.PIPELINE, Method.BULK, Method.EXTERNAL):
        assert set(te_used(method)) <= set(TE_KEYS) - {"method", "is_reduce_scatter"}


@pytest.mark.parametrize(("slot", "method"), [(Slot.PROJ_FPROP, "pipeline"), (Slot.QKV_FPROP, "ring_exchange")])
def test_te_reads_each_key_of_its_method_and_refuses_a_key_it_would_ignore(slot: Slot, method: str) -> None:
    used = set(te_dict.used_keys(slot, Method(method)))
    ignored = [BY_NAME[key] for key in TE_KEYS if key not in used | {"method", "is_reduce_scatter"}]
    assert ignored
    for knob in ignored:
        value = (not knob.te_default) if knob.kind == Kind.FLAG else 3  # not TE's default: TE would drop it
        with pytest.raises(te_dict.PresetError, match=knob.name):
            te_dict.parse_entry(slot, {"method": method, knob.name: value})


def test_a_knob_the_cpu_backend_lacks_is_refused_there_by_name() -> None:
    shape = ModelShape(hidden=64, tp=2, seq=32)
    gemm = problem(shape, Slot.PROJ_FPROP, Method.PIPELINE)
    cuda_only = [k for k in CONFIG_KNOBS if "cpu" not in k.backends and k.fp8 is None]
    assert {k.name for k in cuda_only} >= {"num_sm", "use_ce", "comm_priority", "gemm_priority", "gemm", "fused"}
    for knob in cuda_only:
        value = {Kind.FLAG: True, Kind.CHOICE: "cublas"}.get(knob.kind, 1)
        config = dataclasses.replace(OverlapConfig(method=Method.PIPELINE, num_splits=2), **{knob.name: value})
        with pytest.raises(ConfigError, match="no meaning on the cpu backend") as info:
            check_config(config, gemm, backend="cpu")
        assert info.value.field == knob.name
        assert info.value.rule.endswith("false" if DEFAULTS[knob.name] is False else "unset")
