"""`autotune validate`: a preset timed in a whole TP transformer layer beside no overlap, TE's default, NVIDIA's
nearest preset and PyTorch's async TP (`autotune.cli.validation`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from autotune.cli.consumer_options import For
from autotune.cli.measure import default_backend
from autotune.cli.shape_options import takes_shape
from autotune.cli.validation import BACKENDS, Validation, validate
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape


@takes_shape
def validate_command(
    preset: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="NeMo YAML or TE ub_cfgs JSON")
    ],
    shape: ModelShape,
    backend: Annotated[str | None, typer.Option(help="te | cuda | cpu (default: cuda if GPUs are present)")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Timed steps per variant and round")] = 10,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed steps per variant first")] = 3,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds the variants are interleaved over")] = 3,
    gpu: Annotated[str | None, typer.Option(help="GPU model for NVIDIA's nearest preset (default: GPU 0's)")] = None,
    consumer: For = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Time a TP transformer layer (forward + backward) with the preset and its alternatives."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise InputError("backend", f"must be one of {', '.join(BACKENDS)}", backend)
    if consumer is not None and backend != "te":
        raise InputError(
            "for", "builds te.TransformerLayer with the consumer's switches: it needs --backend te", backend
        )
    result = validate(
        preset, shape, backend=backend, steps=steps, warmup=warmup, rounds=rounds, gpu=gpu, consumer=consumer
    )
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    Console().print(_table(result))
    for name, timing in result.variants.items():
        if timing.skipped:
            typer.echo(f"skipped: {name}: {timing.skipped}")
    for note in result.notes:
        typer.echo(f"note: {note}")


def _table(result: Validation) -> Table:
    table = Table(title=f"{result.shape.label()} {result.shape.dtype} on {result.backend}: {result.preset}")
    for name in ("variant", "median ms", "p20-p80 ms", "spread", "vs no overlap", "steps"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    for name, timing in result.to_dict()["variants"].items():
        if timing.get("skipped"):
            table.add_row(name, "-", "-", "-", "-", "skipped")
            continue
        table.add_row(
            name,
            f"{timing['median_ms']:.4g}",
            f"{timing['p20_ms']:.4g}-{timing['p80_ms']:.4g}",
            f"{timing['spread']:.1%}",
            f"{timing['vs_no_overlap']:.3f}x",
            str(timing["steps"]),
        )
    return table
