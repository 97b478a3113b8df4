"""`autotune tune`: every layer slot of one shape, tuned on this machine; the logic is `autotune.cli.local_tuning`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from autotune.cli import local_tuning, output, signals
from autotune.cli.consumer_options import For
from autotune.cli.measure import BACKEND_HELP, default_backend
from autotune.cli.report import CPU_NOTE, choice_lines, outcome_table
from autotune.cli.shape_options import takes_shape
from autotune.tuner.drive import DEFAULT_TRIALS
from autotune.tuner.gpu import CPU
from overlap_runtime.shape import ModelShape


@takes_shape
def tune(
    shape: ModelShape,
    layers: Annotated[str, typer.Option(help="all, or slots separated by commas (qkv_fprop,proj_fprop)")] = "all",
    trials: Annotated[int, typer.Option(min=1, help="Configs measured per slot at most")] = DEFAULT_TRIALS,
    backend: Annotated[str | None, typer.Option(help=BACKEND_HELP)] = None,
    db: Annotated[str | None, typer.Option(help="Database URL (default: the local SQLite file)")] = None,
    out: Annotated[Path, typer.Option(help="Folder for the NeMo YAML and the TE dict")] = Path("presets"),
    gpu: Annotated[str | None, typer.Option(help="GPU model name to key results by (default: GPU 0's)")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampler seed, for reproducible searches")] = None,
    consumer: For = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Tune every slot anew: delete this shape's studies on this GPU model from an earlier run first",
        ),
    ] = False,
) -> None:
    """Tune every layer slot of a shape locally; run it again with the same arguments to resume."""
    signals.stop_on_sigterm()  # `kill` stops like Ctrl-C: the TP group is shut down, exit 130
    request = local_tuning.TuneRequest(
        shape=shape,
        out=out,
        layers=None if layers.strip() == "all" else [name.strip() for name in layers.split(",")],
        n_trials=trials,
        backend=backend or default_backend(),
        db=db,
        gpu=gpu,
        seed=seed,
        consumer=consumer,
        fresh=fresh,
    )
    console = output.console()
    report = local_tuning.tune(request, console=console)
    if report.reused:
        names = ", ".join(slot.value for slot in report.reused)
        print(
            f"note: {names}: finished by an earlier run in this database, so re-used as they are (nothing of "
            "them was measured now); --fresh tunes them anew",
            file=sys.stderr,
        )
    console.print(outcome_table(report))
    if report.choice is not None:
        for line in choice_lines(report.choice):
            console.print(line, highlight=False)
    for path in report.files:
        console.print(f"wrote {path}")
    if report.gpu == CPU:
        print(CPU_NOTE, file=sys.stderr)
    if not report.ok:
        failed = ", ".join(slot.value for slot, o in report.outcomes.items() if o is None)
        print(f"error: no config ran correctly for {failed}", file=sys.stderr)
        raise typer.Exit(1)
