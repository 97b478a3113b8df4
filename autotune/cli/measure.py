"""`autotune measure`: one config of one slot, measured on the local TP group."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from autotune.cli.field_options import FieldOption, takes
from autotune.cli.shape_options import Command, takes_shape
from overlap_runtime.config import OverlapConfig, check_backend_size, knob_options
from overlap_runtime.errors import InputError, TrialFailure
from overlap_runtime.runtime import available_gpus, open_runtime
from overlap_runtime.shape import ModelShape, Slot


def default_backend() -> str:
    """The CUDA backend where this host has GPUs, else the CPU backend."""
    return "cuda" if available_gpus() > 0 else "cpu"


BACKEND_HELP = "cpu | cuda | te (TransformerEngine itself; default: cuda if GPUs are present)"
"""The ``--backend`` option's help, the same in every command that measures."""
SET_SM_MARGIN = "set_sm_margin"
"""The knob whose option may be left unset: on wherever ``--num-sm`` is given."""


def takes_knobs(command: Command) -> Command:
    """The command's ``knobs`` parameter becomes one option per knob (`knob_options`); it gets the knobs given,
    i.e. those not at their option's default, by name, method first."""
    options = [
        FieldOption(
            name=o.name,
            type=bool | None if o.name == SET_SM_MARGIN else o.type,
            help=o.help,
            default=None if o.name == SET_SM_MARGIN else o.default,
            flags=o.flags,
            bounds=o.bounds,
        )
        for o in knob_options()
    ]
    defaults = {o.name: o.default for o in options}

    def given(**values: Any) -> dict[str, Any]:
        return {name: value for name, value in values.items() if value != defaults[name]}

    return takes("knobs", options, given)(command)


@takes_shape
@takes_knobs
def measure(
    layer: Annotated[str, typer.Option(help="Layer slot, e.g. qkv_fprop")],
    shape: ModelShape,
    knobs: dict[str, Any],
    config_json: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A whole config as JSON instead of --method and the knob flags, as `autotune best --json` prints "
            'it: \'{"method": "bulk", "use_ce": true, "gemm": "cublas"}\'',
        ),
    ] = None,
    backend: Annotated[str | None, typer.Option(help=BACKEND_HELP)] = None,
    repeats: Annotated[int, typer.Option(min=3)] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Measure one overlap config: gemm, comm, serial and overlapped time, hidden share, numerical error."""
    try:
        slot = Slot(layer)
    except ValueError:
        raise InputError("layer", f"must be one of {', '.join(s.value for s in Slot)}", layer) from None
    backend = backend or default_backend()
    if config_json is not None:
        if knobs:
            raise InputError(next(iter(knobs)), "give either --config or --method and the knob flags, not both")
        config = OverlapConfig.from_dict(_json_object("config", config_json))
    elif "method" not in knobs:
        raise InputError("method", "is required (or give the whole config with --config)")
    else:
        given = knobs.pop(SET_SM_MARGIN, None)
        config = OverlapConfig(**knobs, set_sm_margin=knobs.get("num_sm") is not None if given is None else given)
    check_backend_size(shape, backend)  # now, not after the TP group has started
    with open_runtime(tp=shape.tp, backend=backend) as runtime:
        try:
            result = runtime.measure(shape, slot, config, repeats=repeats)
            record = {"valid": result.valid, **result.to_dict()}
        except TrialFailure as e:
            record = {"valid": False, "error": e.reason}
    record = {"layer": slot.value, "shape": shape.to_dict(), "config": config.to_dict(), **record}
    if as_json:
        typer.echo(json.dumps(record))
    else:
        for key, value in record.items():
            typer.echo(f"{key:>12}: {value}")
    if "error" in record:
        raise typer.Exit(1)


def _json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(field, f"must be a JSON object ({e.msg} at character {e.pos})", text) from None
    if not isinstance(value, dict):
        raise InputError(field, "must be a JSON object", text)
    return value
