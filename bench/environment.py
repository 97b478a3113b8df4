"""The versions a GPU benchmark result must carry: the git commit, GPU, driver, torch, CUDA, NCCL, Triton."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT_VARIABLE = "BENCH_GIT_COMMIT"
"""Names the commit where the tree has no git metadata (a copy of the working tree on a GPU machine)."""


def git_commit() -> dict[str, object]:
    """``git_commit`` (the commit the code ran at: git's HEAD, else ``BENCH_GIT_COMMIT``, else None) and
    ``git_dirty`` (whether tracked files differed from it; None when git could not tell)."""
    try:
        return {"git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain", "-uno"))}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": os.environ.get(COMMIT_VARIABLE) or None, "git_dirty": None}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def environment() -> dict[str, object]:
    import torch

    env: dict[str, object] = {**git_commit(), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", None),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            pynvml.nvmlShutdown()
        except Exception as e:  # the numbers are still worth keeping without the driver string
            env["driver"] = f"unknown ({type(e).__name__})"
    return env
