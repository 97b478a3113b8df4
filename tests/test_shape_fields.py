"""`ModelShape` is the one definition of a shape: every layer that takes one covers every field of it.

The walk is over `ModelShape`'s fields, so a field added there and missed by the API's request or query
model, a command's options or the shape key fails here.  `CHANGED` needs the new field's entry too: a value
other than the base shape's, which must change the key.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from api.main import create_app
from api.schemas import JobCreate, ShapeCreate, ShapeLookup
from api.settings import Settings
from autotune.cli.app import app
from autotune.cli.shape_options import takes_shape, takes_shape_filter
from overlap_runtime.shape import ModelShape, shape_fields

NAMES = [f.name for f in fields(ModelShape) if f.init]
BASE = ModelShape(hidden=128, tp=2, seq=64, num_heads=4, num_query_groups=2)
"""Heads and groups given, so that each of them sizes the qkv GEMM."""
CHANGED: dict[str, Any] = {
    "hidden": 256,
    "tp": 1,
    "mbs": 2,
    "seq": 128,
    "ffn_hidden": 1024,
    "num_heads": 8,
    "num_query_groups": 4,
    "gated": True,
    "dtype": "fp8",
    "cp": 2,
}
"""One value per field other than `BASE`'s; all of them together are a valid shape too."""
SHAPE_COMMANDS = ("measure", "tune", "submit")
LOOKUP_COMMANDS = ("best", "export")


def args_of(values: dict[str, Any]) -> list[str]:
    """Command-line options setting ``values`` (a true bool is its switch)."""
    args: list[str] = []
    for name, value in values.items():
        flag = f"--{name.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


def test_every_field_has_a_changed_value() -> None:
    assert list(CHANGED) == NAMES
    assert [f.name for f in shape_fields()] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_field_is_in_the_key(name: str) -> None:
    assert replace(BASE, **{name: CHANGED[name]}).key != BASE.key


def test_the_request_model_takes_every_field_and_gives_the_shape() -> None:
    assert JobCreate.model_fields["shape"].annotation is ShapeCreate
    assert list(ShapeCreate.model_fields) == NAMES
    assert ShapeCreate.model_validate(CHANGED).to_shape() == ModelShape(**CHANGED)
    assert ShapeCreate.model_validate(BASE.as_given()).to_shape() == BASE


def test_the_query_model_takes_every_field_and_only_the_dimensions_are_required() -> None:
    assert list(ShapeLookup.model_fields) == [*NAMES, "gpu"]
    required = {name for name, f in ShapeLookup.model_fields.items() if f.is_required()}
    assert required == {"hidden", "tp", "seq"}
    assert ShapeLookup.model_validate({k: str(v).lower() for k, v in CHANGED.items()}).model_dump() == {
        **CHANGED,
        "gpu": None,
    }


def test_the_openapi_spec_lists_every_field_in_the_body_and_both_queries(tmp_path: Path) -> None:
    settings = Settings(db_url=f"sqlite:///{tmp_path / 'autotune.db'}", token="t", scheduler=False)
    spec = create_app(settings).openapi()
    assert list(spec["components"]["schemas"]["ShapeCreate"]["properties"]) == NAMES
    for path in ("/v1/best", "/v1/presets"):
        query = [p["name"] for p in spec["paths"][path]["get"]["parameters"] if p["in"] == "query"]
        assert set(NAMES) <= set(query), path


@pytest.mark.parametrize("command", SHAPE_COMMANDS + LOOKUP_COMMANDS)
def test_every_command_that_takes_a_shape_has_an_option_per_field(command: str) -> None:
    group = get_command(app)
    options = {p.name for p in group.get_command(typer.Context(group), command).params}  # type: ignore[attr-defined,union-attr]
    assert set(NAMES) <= options


def test_takes_shape_gives_the_command_the_shape_of_its_options() -> None:
    seen: list[ModelShape] = []

    @takes_shape
    def probe(shape: ModelShape, note: str = "") -> None:
        seen.append(shape)

    probe_app = typer.Typer()
    probe_app.command()(probe)
    done = CliRunner().invoke(probe_app, args_of(CHANGED))
    assert done.exit_code == 0, done.output
    minimal = CliRunner().invoke(probe_app, args_of({"hidden": 64, "tp": 2, "seq": 32}))
    assert minimal.exit_code == 0, minimal.output
    assert seen == [ModelShape(**CHANGED), ModelShape(hidden=64, tp=2, seq=32)]


def test_takes_shape_filter_gives_a_lookup_only_the_fields_given() -> None:
    seen: list[dict[str, object]] = []

    @takes_shape_filter
    def probe(shape: dict[str, object]) -> None:
        seen.append(shape)

    probe_app = typer.Typer()
    probe_app.command()(probe)
    for args in (args_of(CHANGED), [*args_of({"hidden": 64, "tp": 2, "seq": 32}), "--not-gated"]):
        done = CliRunner().invoke(probe_app, args)
        assert done.exit_code == 0, done.output
    assert seen == [CHANGED, {"hidden": 64, "tp": 2, "mbs": 1, "seq": 32, "gated": False}]
