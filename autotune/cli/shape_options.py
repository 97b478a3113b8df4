"""The model-shape options of every command that takes a shape, defined once (typer reads them from each
command's signature, so the commands list them, but their flags and help live here)."""

from __future__ import annotations

from typing import Annotated

import typer

Hidden = Annotated[int, typer.Option(help="Model width H")]
Tp = Annotated[int, typer.Option(help="Tensor-parallel size")]
Seq = Annotated[int, typer.Option(help="Sequence length")]
Mbs = Annotated[int, typer.Option(help="Micro-batch size")]
# Left out, these mean TE's defaults when a shape is tuned, and "any" when results are looked up.
FfnHidden = Annotated[int | None, typer.Option(help="MLP width F (tuning default: 4 x hidden)")]
NumHeads = Annotated[int | None, typer.Option(help="Attention heads (tuning default: qkv width 3 x hidden)")]
NumQueryGroups = Annotated[int | None, typer.Option(help="GQA key/value groups (tuning default: num_heads)")]
Gated = Annotated[bool, typer.Option("--gated", help="Gated MLP (SwiGLU): fc1 is twice as wide")]
ShapeDtype = Annotated[str, typer.Option(help="bf16 | fp8")]
Cp = Annotated[int, typer.Option(help="Context-parallel size: each TP group sees seq / cp tokens")]

# Lookups (best, export): only the results of the model that these name, when several were tuned.
GatedFilter = Annotated[
    bool | None, typer.Option("--gated/--not-gated", help="Only gated (SwiGLU) models, or only the others")
]
CpFilter = Annotated[int | None, typer.Option("--cp", help="Only this context-parallel size")]
