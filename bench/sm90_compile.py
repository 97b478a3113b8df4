"""Compile our GEMM and the Gluon reduce-scatter kernel for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs the Triton kernels on CPU, but not Gluon's, and it says nothing about what the compiled
code needs: registers, spills, shared memory.  This compiles each kernel the way its launch would on an H100 or
H200, through Triton's own compiler and ptxas, and reports per kernel variant what ptxas reports:

    .venv-sm90/bin/python bench/sm90_compile.py --out OUT.json     # `make .venv-sm90/.installed` makes it

``.venv-sm90`` is the project's environment with Triton 3.6, the release our GPU hosts run and the one
`ring_gluon` is written in (`ring_gluon.GLUON_TRITON`); `make test` creates it for tests/test_sm90_compile.py.

How, without a GPU: Triton asks its active driver for the device's target and, once a kernel is compiled, for a
launcher.  `Sm90` answers the first with sm_90 and the second with `Compiled`, so that each launch compiles
its kernel from CPU tensors of the real shapes and stops before it would run.  The variants: every base tile
config of `gemm.choose_config` (128x256, 128x128, 64x128) with and without a split tail, at BF16 and FP8, and
`ring_gluon`'s kernel at BF16 and FP8 with 2 and 4 chunks.  Not the Triton ring kernels: Triton's interpreter
runs them on CPU (tests/test_ring_gemm.py), and their launches take plans and flags that this would build by hand.

Exit status: 0 every variant compiled, 1 one failed (the JSON is written either way), 2 usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# Compiled, never interpreted: a test process that ran kernels in the interpreter passes its TRITON_INTERPRET on.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from bench.timing import write_json  # noqa: E402
from overlap_runtime import gemm, ring_gemm, ring_gluon  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448
"""Bytes of shared memory one program may opt into on an H100 or H200 (227 KiB)."""
SM_COUNT = 132
GEMM_TILE_ROWS, GEMM_N, GEMM_K = 16, 2560, 5120
"""The GEMM compiled: 16 rows of tiles by 2560 x 5120 (for 128-row tiles h5120 s2048 proj_dgrad), which leaves a
part-empty last round on 132 SMs in every base config, so that a split tail is cut where the config asks."""
SCATTER_SHAPE = (4096, 2048, 1024)
"""A chunk of h2048 s8192 proj_fprop at tp = 2."""


class Compiled(Exception):
    """Raised where Triton asks for a launcher: the kernel is compiled, and nothing can run it here."""


class Sm90:
    """Triton's active driver on a machine without a GPU: device 0 is an sm_90 GPU that runs nothing."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER

    def launcher_cls(self, src: Any, metadata: Any) -> None:
        raise Compiled


def compile_launch(kernel: Any, launch: Callable[[], None]) -> Any:
    """``kernel`` as ``launch`` compiles it for sm_90: the launch runs to its launcher, which stops it."""
    try:
        launch()
    except Compiled:
        pass
    else:
        raise RuntimeError("the launch returned without asking for a launcher")
    cache = kernel.device_caches[0][0]
    (compiled,) = cache.values()
    cache.clear()
    return compiled


def ptxas_report(ptx: str) -> dict[str, int]:
    """Registers per thread and spill bytes that Triton's ptxas reports for ``ptx`` on sm_90a."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run(
            [get_ptxas(HOPPER.arch).path, "-arch=sm_90a", "-v", str(source), "-o", str(source.with_suffix(".cubin"))],
            capture_output=True,
            text=True,
            check=True,
        )
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas said nothing of registers and spills: {done.stderr[-500:]}")
    return {"registers": int(registers[1]), "spill_bytes": int(spills[1]) + int(spills[2])}


def gemm_launch(cfg: gemm.GemmTileConfig, dtype: torch.dtype) -> Callable[[], None]:
    """`gemm.matmul`'s launch of ``cfg`` on `GEMM_TILE_ROWS` rows of its tiles, ``dtype`` operands (FP8: b K-major,
    scaled)."""
    m, n, k = GEMM_TILE_ROWS * cfg.block_m, GEMM_N, GEMM_K
    tiles = GEMM_TILE_ROWS * triton.cdiv(n, cfg.block_n)
    if cfg.split_tail and not gemm.tail_splits(tiles, SM_COUNT, triton.cdiv(k, cfg.block_k)):
        raise ValueError(f"{cfg.label()}: {m}x{n}x{k} cuts no split tail on {SM_COUNT} SMs")
    a = torch.empty(m, k, dtype=dtype)
    b = torch.empty(n, k, dtype=dtype).t() if dtype == gemm.FP8 else torch.empty(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=gemm.out_dtype(dtype))
    one = torch.ones(1) if dtype == gemm.FP8 else None
    tiled = {"a": (a, "a"), "b": (b, "b"), "c": (out, "c")}
    scales = gemm.check_scales(a, one, one)
    return lambda: gemm.launch(
        gemm._persistent_matmul_kernel, tiled, a=a, b=b, out=out, cfg=cfg, gemm_sms=SM_COUNT, tma=True, scales=scales
    )


def gluon_launch(dtype: torch.dtype, chunks: int) -> Callable[[], None]:
    """`ring_gluon.scatter_matmul` on ``chunks`` chunks of `SCATTER_SHAPE`, on `ring_gemm.gluon_tiling`'s plan."""
    rows, n, k = SCATTER_SHAPE
    plan = ring_gemm.gluon_tiling(rows, n, k, chunks=chunks, dtype=dtype, gemm_sms=SM_COUNT)
    a = torch.empty(chunks * rows, k, dtype=dtype)
    b = torch.empty(n, k, dtype=dtype).t() if dtype == gemm.FP8 else torch.empty(k, n, dtype=dtype)
    partials = torch.empty((chunks - 1) * rows, n, dtype=torch.bfloat16)
    return lambda: ring_gluon.scatter_matmul(
        a,
        b,
        torch.empty(rows, n, dtype=torch.bfloat16),
        parts=partials.view(-1),
        counts=torch.zeros(len(plan.segments) * (chunks - 1), dtype=torch.int32),
        recv=torch.empty_like(partials),
        ready=torch.zeros(chunks * len(plan.segments), dtype=torch.int32),
        epoch=1,
        rank=0,
        plan=plan,
        scales=(torch.ones(1), torch.ones(1)) if dtype == gemm.FP8 else None,
    )


def variants() -> dict[str, tuple[Any, Callable[[], None]]]:
    """Label -> (kernel, its launch) of every variant this compiles."""
    found: dict[str, tuple[Any, Callable[[], None]]] = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (gemm.FP8, "fp8")):
        for base in (gemm.LARGE, gemm.MEDIUM, gemm.SMALL):
            for split_tail in (False, True):
                cfg = dataclasses.replace(gemm.for_dtype(base, dtype), split_tail=split_tail)
                found[f"gemm {name} {cfg.label()}"] = (gemm._persistent_matmul_kernel, gemm_launch(cfg, dtype))
        for chunks in (2, 4):
            found[f"ring_gluon {name} chunks={chunks}"] = (ring_gluon._scatter_kernel, gluon_launch(dtype, chunks))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if ring_gluon.GLUON_ERROR is not None or not triton.__version__.startswith(ring_gluon.GLUON_TRITON):
        parser.error(
            f"needs Triton {ring_gluon.GLUON_TRITON}x with Gluon (`make .venv-sm90/.installed`), not "
            f"{triton.__version__} ({ring_gluon.GLUON_ERROR or 'Gluon imported'})"
        )
    triton.runtime.driver.set_active(Sm90())
    payload: dict[str, Any] = {"triton": triton.__version__, "target": "sm_90a", "shared_limit": SHARED_LIMIT}
    kernels: dict[str, dict[str, Any]] = {}
    for label, (kernel, launch) in variants().items():
        try:
            compiled = compile_launch(kernel, launch)
            kernels[label] = {"shared_bytes": compiled.metadata.shared, **ptxas_report(compiled.asm["ptx"])}
        except Exception as e:  # a variant that does not compile is recorded, and the rest still run
            kernels[label] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(label, kernels[label], flush=True)
    payload["kernels"] = kernels
    write_json(args.out, payload)
    return 1 if any("error" in k for k in kernels.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
