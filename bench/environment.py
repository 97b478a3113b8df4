"""What every benchmark result must carry: the git commit of the code that produced it, and the versions
(GPU, driver, torch, CUDA, NCCL, Triton) it ran on.

The commit is read from git in the repository; a copy of the tree without ``.git`` (the lent GPU machine
gets one) takes it from ``AUTOTUNE_COMMIT``, which whoever ships the tree sets to ``git rev-parse HEAD``.
A result whose commit is None is undated, and ``bench/readme_tables.py`` says so wherever it is quoted.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMIT_ENV = "AUTOTUNE_COMMIT"


def source() -> dict[str, object]:
    """``commit`` (None when unknown) and ``dirty``: whether tracked files differed from that commit (None
    when the commit came from ``AUTOTUNE_COMMIT``, which cannot tell)."""
    given = os.environ.get(COMMIT_ENV)
    if given:
        return {"commit": given, "dirty": None}
    try:
        commit = _git("rev-parse", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed)}


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30)
    return done.stdout.strip()


def environment() -> dict[str, object]:
    import torch

    env: dict[str, object] = {**source(), "python": platform.python_version(), "torch": torch.__version__}
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
