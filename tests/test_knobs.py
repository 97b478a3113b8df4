"""The knob table against what it describes (`OverlapConfig`'s fields, NVIDIA's preset files, TE's key sets),
and what derives from it: the CLI's knob options and the API's config schema."""

from __future__ import annotations

import dataclasses
import json
import typing
from importlib import resources
from typing import Any

import pytest
import typer
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from api.schemas import OverlapConfigBody
from autotune.cli.measure import takes_knobs
from overlap_runtime.config import DEFAULTS, DeviceLimits, OverlapConfig, check_config, knob_options, problem
from overlap_runtime.errors import ConfigError
from overlap_runtime.knobs import BY_NAME, CONFIG_KNOBS, KNOBS, MAX_CGA_SIZE, TE_KEYS, Kind, Method, Origin
from overlap_runtime.methods import METHODS
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import slot_space, te_dict, tunable_slots

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
    assert all(k.te_default is None for k in ours)
    for spec in METHODS.values():
        assert spec.te_keys <= set(TE_KEYS) - {"method", "is_reduce_scatter"}, spec.method


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
    # use_ce, gemm and fused run on the CPU's emulated GPU (`overlap_runtime.emulation`)
    assert {k.name for k in cuda_only} >= {"num_sm", "cga_size", "set_sm_margin", "comm_priority", "num_max_streams"}
    for knob in cuda_only:
        value = {Kind.FLAG: True, Kind.CHOICE: "cublas"}.get(knob.kind, 1)
        config = dataclasses.replace(OverlapConfig(method=Method.PIPELINE, num_splits=2), **{knob.name: value})
        with pytest.raises(ConfigError, match="no meaning on the cpu backend") as info:
            check_config(config, gemm, backend="cpu")
        assert info.value.field == knob.name
        assert info.value.rule.endswith("false" if DEFAULTS[knob.name] is False else "unset")


def knob_command() -> typer.Typer:
    """A command with `autotune measure`'s knob options (`takes_knobs`), printing the knobs given."""

    @takes_knobs
    def command(knobs: dict[str, Any]) -> None:
        typer.echo(json.dumps(knobs))

    app = typer.Typer()
    app.command()(command)
    return app


def test_the_knob_options_give_every_knob_a_cli_flag_with_its_help_type_and_range() -> None:
    app, runner = knob_command(), CliRunner()
    shown = runner.invoke(app, ["--help"], env={"COLUMNS": "240", "TERMINAL_WIDTH": "240"})
    assert shown.exit_code == 0
    for flag in ("--comm-priority", "--gemm-priority", "--fp8-buf", "--pipeline-rs-overlap-first-gemm", "--no-ce"):
        assert flag in shown.output
    for option in knob_options():
        for flag in option.flags.split("/"):
            assert flag in shown.output, flag
    given = "--method pipeline --num-splits 2 --pipeline-rs-overlap-first-gemm --comm-priority -2 --fp8-buf --no-ce"
    ran = runner.invoke(app, [*given.split(), "--gemm-priority", "0", "--no-sm-margin"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.output) == {
        "method": "pipeline",
        "num_splits": 2,
        "use_ce": False,
        "fp8_buf": True,
        "comm_priority": -2,
        "gemm_priority": 0,
        "pipeline_rs_overlap_first_gemm": True,
        "set_sm_margin": False,
    }
    switches = runner.invoke(app, ["--aggregate", "--use-ce"])
    assert switches.exit_code == 0 and json.loads(switches.output) == {"aggregate": True, "use_ce": True}
    assert json.loads(runner.invoke(app, []).output) == {}
    refused = runner.invoke(app, ["--method", "bulk", "--num-sm", "65"], env={"COLUMNS": "240"})
    assert refused.exit_code == 2 and "--num-sm" in refused.output and "less than or equal to 64" in refused.output


@pytest.mark.parametrize("backend", ["cpu", "cuda", "te"])
def test_the_api_schema_writes_every_config_of_the_spaces_as_to_dict_does(backend: str) -> None:
    shape = ModelShape(hidden=8192, tp=8, seq=8192)
    limits = DeviceLimits(sm_count=132) if backend != "cpu" else None
    n = 0
    for slot in tunable_slots(shape):
        for config in slot_space(shape, slot, backend=backend, limits=limits).configs():
            body = OverlapConfigBody.model_validate_json(json.dumps(config.to_dict()))
            assert body.model_dump_json() == json.dumps(config.to_dict(), separators=(",", ":"))
            assert body.to_config() == config
            n += 1
    assert n > (20 if backend == "cpu" else 2000)


def test_the_api_schema_takes_every_knob_and_bounds_each_by_its_table_entry() -> None:
    schema = OverlapConfigBody.model_json_schema()
    assert list(schema["properties"]) == [f.name for f in dataclasses.fields(OverlapConfig)]
    assert schema["required"] == ["method"] and schema["additionalProperties"] is False
    for knob in CONFIG_KNOBS:
        assert schema["properties"][knob.name]["description"] == knob.help
    every = {"method": "pipeline", "comm_priority": -1, "gemm_priority": 0, "fp8_buf": True}
    every |= {"pipeline_rs_overlap_first_gemm": True, "atomic_gemm": True}
    assert OverlapConfigBody.model_validate(every).to_config().to_dict() == every
    with pytest.raises(ValidationError, match="cga_size"):
        OverlapConfigBody.model_validate({"method": "bulk", "cga_size": MAX_CGA_SIZE + 1})
