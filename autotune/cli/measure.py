"""`autotune measure`: one config of one slot, measured on the local TP group."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from autotune.cli.shape_options import takes_shape
from overlap_runtime.config import OverlapConfig
from overlap_runtime.errors import InputError, TrialFailure
from overlap_runtime.runtime import Runtime, available_gpus
from overlap_runtime.shape import ModelShape, Slot


def default_backend() -> str:
    """The CUDA backend where this host has GPUs, else the CPU backend."""
    return "cuda" if available_gpus() > 0 else "cpu"


@takes_shape
def measure(
    layer: Annotated[str, typer.Option(help="Layer slot, e.g. qkv_fprop")],
    shape: ModelShape,
    method: Annotated[str | None, typer.Option(help="none | ring_exchange | pipeline | bulk")] = None,
    num_sm: Annotated[int | None, typer.Option()] = None,
    num_splits: Annotated[int | None, typer.Option()] = None,
    num_max_streams: Annotated[int | None, typer.Option()] = None,
    cga_size: Annotated[int | None, typer.Option()] = None,
    gemm: Annotated[str | None, typer.Option(help="triton | cublas")] = None,
    aggregate: Annotated[bool, typer.Option("--aggregate")] = False,
    fused: Annotated[
        bool, typer.Option("--fused", help="ring_exchange: our GEMM runs every chunk in one launch (--gemm triton)")
    ] = False,
    no_ce: Annotated[bool, typer.Option("--no-ce", help="SM-driven (NCCL) copies instead of the copy engine")] = False,
    no_sm_margin: Annotated[bool, typer.Option("--no-sm-margin", help="Let the GEMM use every SM")] = False,
    atomic_gemm: Annotated[bool, typer.Option("--atomic-gemm")] = False,
    config_json: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="A whole config as JSON instead of --method and the knob flags, as `autotune best --json` prints "
            'it: \'{"method": "bulk", "use_ce": true, "gemm": "cublas"}\'',
        ),
    ] = None,
    backend: Annotated[str | None, typer.Option(help="cpu | cuda (default: cuda if GPUs are present)")] = None,
    repeats: Annotated[int, typer.Option(min=3)] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Measure one overlap config: gemm, comm, serial and overlapped time, hidden share, numerical error."""
    try:
        slot = Slot(layer)
    except ValueError:
        raise InputError("layer", f"must be one of {', '.join(s.value for s in Slot)}", layer) from None
    backend = backend or default_backend()
    knobs = {
        "num_sm": num_sm,
        "num_splits": num_splits,
        "num_max_streams": num_max_streams,
        "cga_size": cga_size,
        "gemm": gemm,
        "aggregate": aggregate,
        "fused": fused,
        "atomic_gemm": atomic_gemm,
    }
    if config_json is not None:
        flags = {"method": method, **knobs, "no_ce": no_ce, "no_sm_margin": no_sm_margin}
        given = [name for name, value in flags.items() if value not in (None, False)]
        if given:
            raise InputError(given[0], "give either --config or --method and the knob flags, not both")
        config = OverlapConfig.from_dict(_json_object("config", config_json))
    elif method is None:
        raise InputError("method", "is required (or give the whole config with --config)")
    else:
        # TE's margin default: on for SM-driven comm with num_sm given, which --no-sm-margin turns off.
        config = OverlapConfig(
            method=method,
            **knobs,
            use_ce=False if no_ce else None,
            set_sm_margin=num_sm is not None and not no_sm_margin,
        )
    with Runtime(tp=shape.tp, backend=backend) as runtime:
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


def _json_object(field: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(field, f"must be a JSON object ({e.msg} at character {e.pos})", text) from None
    if not isinstance(value, dict):
        raise InputError(field, "must be a JSON object", text)
    return value
