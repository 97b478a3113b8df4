"""A TP group's ranks end with the process that started them, even a rank whose own threads cannot run: the
kernel's SIGKILL when their parent, the forkserver, exits (`overlap_runtime.group`'s module docstring)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"),
]

GONE_S = 2.0
STARTS_A_GROUP = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from overlap_runtime.group import TPGroup
from test_group_exit import _hold_the_gil, _pid
group = TPGroup(tp=2, backend="cpu")
print(*group.run(_pid), flush=True)
group.run(_hold_the_gil, timeout_s=600)
"""


def _pid(ctx) -> int:
    return os.getpid()


def _hold_the_gil(ctx) -> None:
    """Backtrack for ever in the regex engine, which never lets go of the GIL: the rank's lifeline thread, which
    would end it when its parent's pipe closes, cannot run."""
    re.match(r"(a+)+$", "a" * 64 + "b")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on (the third field of proc(5) is the first here)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _alive(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_kill_9_of_the_owner_takes_ranks_that_hold_the_gil_and_the_forkserver_within_2_s() -> None:
    owner = subprocess.Popen([sys.executable, "-c", STARTS_A_GROUP], stdout=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        assert owner.stdout is not None
        ranks = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(ranks) == 2, owner.wait(60)
        server = int(_stat(ranks[0])[1])
        assert server != owner.pid and int(_stat(ranks[1])[1]) == server  # forked by the forkserver, not the owner
        idle = [_cpu_s(pid) for pid in ranks]
        deadline = time.monotonic() + 60
        while any(_cpu_s(pid) < cpu + 1.0 for pid, cpu in zip(ranks, idle, strict=True)):  # deep in the regex
            assert time.monotonic() < deadline
            time.sleep(0.05)
        owner.send_signal(signal.SIGKILL)
        owner.wait(5)
        killed = time.monotonic()
        while any(_alive(pid) for pid in (*ranks, server)) and time.monotonic() - killed < GONE_S:
            time.sleep(0.02)
        assert not [pid for pid in (*ranks, server) if _alive(pid)]
    finally:
        owner.kill()
        owner.wait(5)
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
