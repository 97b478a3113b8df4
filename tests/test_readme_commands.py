"""Every shell block of README.md runs as printed on the CPU backend, or says beside it why not.

A block is run unless the line above its fence marks it ``<!-- gpu-only: REASON -->`` or
``<!-- not-run: REASON -->``.  The blocks run in README order in one folder, as a newcomer types them:
``.venv/bin/autotune`` is this environment's console script, ``search_spaces/`` the repository's, and a
controller started as `make run` starts it (``serve --local-worker``, here on the CPU backend) answers the
client commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest_service import Service

pytest_plugins = ("conftest_service",)  # make_service

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- (gpu-only|not-run): ([^\n]*?) -->\n)?^```bash\n(.*?)^```\n", re.S | re.M)
BLOCK_TIMEOUT_S = 600


def blocks() -> list[tuple[str | None, str, str]]:
    """(mark, reason, commands) of each shell block of the README, in order."""
    return [(m[1], m[2] or "", m[3]) for m in BLOCK.finditer((REPO / "README.md").read_text())]


def test_every_block_that_does_not_run_here_says_why() -> None:
    found = blocks()
    assert found and any(mark is None for mark, _, _ in found)
    for mark, reason, commands in found:
        assert mark is None or len(reason) > 20, f"{mark} without a reason: {commands}"
        if mark is None:  # the files a runnable block names are where a newcomer stands
            for name in re.findall(r"(?:search_spaces|examples)/[\w./-]+", commands):
                assert (REPO / name).exists(), name


@pytest.mark.slow
def test_the_readme_commands_run_on_the_cpu_backend(make_service: Callable[..., Service], tmp_path: Path) -> None:
    here = tmp_path / "checkout"
    (here / ".venv" / "bin").mkdir(parents=True)
    (here / ".venv" / "bin" / "autotune").symlink_to(Path(sys.executable).with_name("autotune"))
    (here / "search_spaces").symlink_to(REPO / "search_spaces")
    service = make_service(db_url=f"sqlite:///{tmp_path / 'autotune.db'}")
    service.start_controller(extra=["--local-worker", "--backend", "cpu"])
    # What make run prints besides the migration lines: where the dashboard is, and the README's first command.
    log = (tmp_path / "service0" / "controller.log").read_text()
    assert f"dashboard: {service.url}/  (REST API docs: {service.url}/docs)\n" in log
    (suggested,) = [line.split("autotune ", 1)[1] for line in log.splitlines() if line.startswith("next, in another")]
    assert f".venv/bin/autotune {suggested}" in (REPO / "README.md").read_text()
    env = service.env | {"AUTOTUNE_CONTROLLER": service.url, "AUTOTUNE_TOKEN": service.token}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    timings = []
    for mark, _, commands in blocks():
        if mark is not None:
            continue
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", commands],
            cwd=here,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
        timings.append(time.monotonic() - started)
        assert done.returncode == 0, f"{commands}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr
    assert (here / "presets" / "ub_cfg_cpu_bf16_h256_tp2_mbs1_seqlen256.yaml").is_file()
    print("block seconds:", [round(t) for t in timings])
