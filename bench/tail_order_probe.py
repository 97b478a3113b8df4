"""Probe: does a split tail cost less when its parts run first, or without its counters' memset (issue 33)?

`gemm.split_tail` cuts the tiles of a part-empty last round along K and runs those parts after every whole
tile, so each part's fp32 store, its count and the last part's read are the last thing a program does: nothing
hides them.  On one H100 (bench/results/README.md) 2048x2560x5120 BF16 in 128x128 tiles took 90.6-92.7 us as
the product, 82-84 us when the parts were stored and not read, and 70.0-70.7 us when nothing was stored (cuBLAS:
71.5-72.6 us): the stores alone cost more than the gap to the library.  Stream-K schedules in CUTLASS run the
split tiles first, so that their stores drain under the whole tiles that follow.  And every call with a split
tail zeroes its counters first (`gemm.TailSplit.plan`: ``torch.zeros``), a kernel of its own inside the timed
call, which the kernel would not need if the counters were kept: it resets each one after use.

This probe times both changes beside ours without touching the kernel: it writes copies of
`overlap_runtime/gemm.py` (``first``: the persistent kernel calls `split_tail` before its loop over whole tiles;
``kept``: the counters are zeroed once and kept for later calls on the benchmark's one stream; and both),
imports them and times them on the same operands:

    python bench/tail_order_probe.py --out OUT.json

Variants per shape (`tile_explore.WORST`): the library, the heuristic's config (`gemm.choose_config`), and for
the heuristic's config and `choose_config`'s 128x256 and 128x128 candidates, each with a split tail: ours, the
three copies (``_first``, ``_kept``, ``_first_kept``), and the same tiles without a split tail.  Timing and
checks as gemm_bench's (`bench.timing`, interleaved, relative error <= 1e-2).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gemm_bench import Bench, GemmShape  # noqa: E402
from bench.tile_explore import sweep_worst  # noqa: E402
from bench.timing import Variant, scales  # noqa: E402
from overlap_runtime import gemm  # noqa: E402

WHOLE_TILES = """    for tile in tl.range(pid, whole_tiles, C.GEMM_SMS, flatten=C.TMA):
        pid_m, pid_n = tile_position(tile, grid, C.GROUP_M)
        off = (pid_m * C.BLOCK_M, pid_n * C.BLOCK_N)
        acc = partial_product(a, b, off, (0, steps), dims, stride_a, stride_b, scales, C)
        store_tile(c, off, (M, N), stride_c, acc, C, C.TMA)
"""
SPLIT_TAIL = """    if C.SPLIT_TAIL:
        split_tail(a, b, c, scales, scratch, whole_tiles, tail, grid, dims, stride_a, stride_b, stride_c, C)
"""
"""The persistent kernel's body in `gemm.py`: the loop over whole tiles, then the split tail."""
LAST, FIRST = WHOLE_TILES + SPLIT_TAIL, SPLIT_TAIL + WHOLE_TILES

ZEROED = "locks=torch.zeros(tail, dtype=torch.int32, device=device)"
KEPT = "locks=_kept_locks(tail, device)"
KEEPER = """

_KEPT: dict[tuple[torch.device, int], torch.Tensor] = {}


def _kept_locks(tail: int, device: torch.device) -> torch.Tensor:
    if (device, tail) not in _KEPT:
        _KEPT[(device, tail)] = torch.zeros(tail, dtype=torch.int32, device=device)
    return _KEPT[(device, tail)]
"""
EDITS = {"first": ((LAST, FIRST),), "kept": ((ZEROED, KEPT),), "first_kept": ((LAST, FIRST), (ZEROED, KEPT))}
"""The copies of `overlap_runtime.gemm` and the (old, new) text edits that make each."""


def copy_of_gemm(name: str, folder: Path) -> ModuleType:
    """`overlap_runtime.gemm` with `EDITS`[``name``] made, imported from a copy in ``folder`` (Triton reads a
    kernel's source from its file)."""
    source = (REPO / "overlap_runtime" / "gemm.py").read_text()
    for old, new in EDITS[name]:
        if source.count(old) != 1:
            raise SystemExit(f"tail_order_probe: gemm.py is not as this probe expects; update {old[:40]!r}")
        source = source.replace(old, new)
    path = folder / f"gemm_{name}.py"
    path.write_text(source + (KEEPER if name.endswith("kept") else ""))
    spec = importlib.util.spec_from_file_location(f"gemm_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ours(module: ModuleType, cfg: gemm.GemmTileConfig | None) -> Variant:
    """``module``'s `matmul` on ``cfg`` (None: the heuristic's), as a benchmark variant.  The copy has a config
    class of its own, which its `matmul` checks for."""
    own = None if cfg is None else module.GemmTileConfig(**dataclasses.asdict(cfg))
    return lambda a, b, out: module.matmul(a, b, out, config=own, **scales(a))


def split_configs(bench: Bench, shape: GemmShape) -> list[gemm.GemmTileConfig]:
    """The heuristic's config and `choose_config`'s 128x256 and 128x128 candidates, each with a split tail."""
    found: list[gemm.GemmTileConfig] = []
    for cfg in (bench.config(shape), gemm.for_dtype(gemm.LARGE, bench.dtype), gemm.for_dtype(gemm.MEDIUM, bench.dtype)):
        cut = dataclasses.replace(cfg, split_tail=True)
        if cut not in found:
            found.append(cut)
    return found


def speed_row(timed: dict[str, dict], speed: dict[str, float]) -> tuple[dict[str, Any], str]:
    """This probe's row: every variant's speed and timings; printed, every speed."""
    said = ", ".join(f"{label} {s:.3f}" for label, s in speed.items() if label != "library")
    return {"speed": speed, "timed": timed}, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        copies = {name: copy_of_gemm(name, Path(folder)) for name in EDITS}

        def variants(bench: Bench, shape: GemmShape) -> dict[str, Variant]:
            """Per split config of the shape: without a split tail, ours, and each copy."""
            found: dict[str, Variant] = {"heuristic": ours(gemm, None)}
            for cfg in split_configs(bench, shape):
                whole = dataclasses.replace(cfg, split_tail=False)
                found[whole.label()] = ours(gemm, whole)
                found[cfg.label()] = ours(gemm, cfg)
                for copy, module in copies.items():
                    found[f"{cfg.label()}_{copy}"] = ours(module, cfg)
            return found

        sweep_worst(args.out, repeats=args.repeats, variants=variants, row=speed_row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
