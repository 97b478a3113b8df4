"""How CLI processes stop: SIGTERM like Ctrl-C, and a worker that `serve` started stops with it.

`stop_on_sigterm` makes SIGTERM (``kill``, ``docker stop``, `serve` stopping its local worker) raise
`KeyboardInterrupt`, so ``finally`` blocks run: the TP group is shut down, `serve` stops its local worker,
and the exit code is 130.  uvicorn takes SIGTERM over while it serves and raises it again once it has shut
down, which without this handler would kill `serve` before it stops its worker.

`exit_with_parent` covers the parent that dies without running any ``finally`` (``kill -9``, a crash): the
child gets SIGTERM then, from the kernel on Linux (``PR_SET_PDEATHSIG``) or from a thread that watches its
parent elsewhere, so no worker is left retrying forever with PPID 1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

from overlap_runtime.group import signal_on_parent_death

PARENT_WATCH_S = 1.0
"""How often the watch thread (where there is no PR_SET_PDEATHSIG) looks at its parent."""


def stop_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def exit_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process once ``parent_pid``, its parent, is gone (call `stop_on_sigterm` first)."""
    if signal_on_parent_death(signal.SIGTERM):
        if os.getppid() != parent_pid:  # the parent died before the kernel was asked
            os.kill(os.getpid(), signal.SIGTERM)
        return
    threading.Thread(target=_watch, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_WATCH_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread
