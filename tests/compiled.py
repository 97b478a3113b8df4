"""Fresh Python processes from the repository root: check scripts without TRITON_INTERPRET (the test process
has it set, see `triton_interpreter`), which is how the tests reach our compiled Triton kernels, and the
benchmarks' dry runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_compiled(script: str) -> None:
    """Run ``script`` with ``python -c``; fail with the tail of its output unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def dry_run(bench: str, out: Path, *args: str) -> dict[str, Any]:
    """Run ``bench`` (a script path from the root) with ``--dry-run --out out`` and ``args``: the JSON it wrote."""
    proc = subprocess.run(
        [sys.executable, bench, "--dry-run", "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())
