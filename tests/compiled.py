"""Run a check script in a fresh Python process without TRITON_INTERPRET (the test process has it set, see
`triton_interpreter`), from the repository root: how the tests reach our compiled Triton kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_compiled(script: str) -> None:
    """Run ``script`` with ``python -c``; fail with the tail of its output unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
