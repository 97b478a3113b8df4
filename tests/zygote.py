"""The CLI processes of the service tests, forked from one process that imported the CLI once (a zygote).

A controller imports FastAPI, SQLAlchemy, Alembic and Optuna before it serves: 1.7-2.1 CPU-seconds of the
2-core test machine per start (a worker's imports: 0.6-0.7), and the suite starts about ninety controllers and
workers in all.  Here each pytest process starts one zygote, a plain ``python -c`` process that imports what
``autotune serve`` and ``autotune worker`` import and then only waits: for a request to start ``autotune ARGS``
(with an environment, a log file and a working folder), which it forks; and for its children's exits, which it
reports.

A forked child runs what ``python -c "from autotune.cli.app import main; main()" ARGS`` runs, in a session of
its own (``kill -9`` of its process group takes its TP group's ranks along), with its stdout and stderr in the
log: the same ``main``, the same argv, the environment replaced before ``main`` reads any of it (no module of
ours reads the environment on import), and an exit through the interpreter's own shutdown with its atexit
handlers.  What differs from a fresh process is only what ran before ``main``: the imports, done once, and no
thread (the zygote starts none, so the fork is safe).

The zygote is its pytest process's: it ends when that process closes its end of the pipe, or dies.
"""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, NoReturn

TESTS = str(Path(__file__).resolve().parent)
PRELOAD = ("autotune.cli.app", "autotune.cli.serve", "autotune.cli.worker", "api.main")
"""What the controller's and the worker's commands import when they run (the CLI imports a command's module
lazily), imported once by the zygote."""
REAP_EVERY_S = 0.05


@dataclass(frozen=True)
class Launch:
    """One ``autotune ARGS`` for the zygote to fork."""

    args: list[str]
    env: dict[str, str]
    log: str
    """Where stdout goes, and stderr unless `err` names a file of its own."""
    err: str | None
    cwd: str


class Forked:
    """A CLI process forked by the zygote: `subprocess.Popen`'s ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal`` and ``terminate`` (it is the zygote's child, so its exit code comes from the zygote)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._zygote.exit_code(self.pid, timeout_s=0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.exit_code(self.pid, timeout_s=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"autotune (pid {self.pid})", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """This pytest process's zygote (`start` starts it on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._exits: dict[int, int] = {}
        self._errors: IO[bytes] | None = None

    def _connect(self) -> Connection:
        if self._conn is None:
            ours, theirs = socket.socketpair()
            code = f"import sys; sys.path.insert(0, {TESTS!r}); import zygote; zygote.main({theirs.fileno()})"
            # Never the pytest process's stdout: a pytest-xdist process talks to its controller through it.
            self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (the zygote's for its life: `close` closes it)
            self._process = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=self._errors,
                stderr=self._errors,
            )
            theirs.close()
            self._conn = Connection(ours.detach())
        return self._conn

    def _recv(self) -> tuple[str, int, Any]:
        """The zygote's next message, an exit noted on the way (the caller holds the lock)."""
        assert self._conn is not None and self._errors is not None
        try:
            kind, pid, value = self._conn.recv()
        except EOFError:
            self._errors.seek(0)
            raise RuntimeError(f"the zygote ended:\n{self._errors.read().decode(errors='replace')}") from None
        if kind == "exited":
            self._exits[pid] = value
        return kind, pid, value

    def start(self, args: list[str], *, env: dict[str, str], log: Path, err: Path | None = None) -> Forked:
        """Fork ``autotune ARGS`` in this process's working folder, as `subprocess.Popen` would run it: stdout
        into ``log``, and stderr too unless ``err`` is given."""
        with self._lock:
            conn = self._connect()
            conn.send(Launch(list(args), dict(env), str(log), None if err is None else str(err), os.getcwd()))
            while True:
                kind, pid, value = self._recv()
                if kind == "failed":
                    raise RuntimeError(f"the zygote could not start autotune {' '.join(args)}: {value}")
                if kind == "started":
                    return Forked(self, pid)

    def exit_code(self, pid: int, *, timeout_s: float | None) -> int | None:
        """``pid``'s exit code, waiting up to ``timeout_s`` (None: for ever) for it; None if it still runs."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                assert self._conn is not None
                while pid not in self._exits and self._conn.poll(0):
                    kind, _, _ = self._recv()
                    assert kind == "exited", kind
                if pid in self._exits:
                    return self._exits[pid]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            time.sleep(REAP_EVERY_S if left is None else min(REAP_EVERY_S, left))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            assert self._process is not None
            self._process.wait()
            assert self._errors is not None
            self._errors.close()


def main(fd: int) -> None:
    """The zygote: import, then fork a child per request and report each child's exit, until the pipe closes.
    Returns only in a child, which then runs the CLI as ``python -c`` would."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made lives as long as every child: frozen, the collections of a child, its last ones at
    # exit included, skip it (a child's shutdown otherwise collected it all again, 0.4 CPU-s each).
    gc.freeze()
    assert threading.active_count() == 1, "a thread started on import: forking would be unsafe"
    conn = Connection(fd)
    launch = _serve(conn)
    conn.close()
    _run(launch)


def _serve(conn: Connection) -> Launch:
    children: set[int] = set()
    with selectors.DefaultSelector() as selector:
        selector.register(conn.fileno(), selectors.EVENT_READ)
        while True:
            if selector.select(REAP_EVERY_S if children else None):
                try:
                    launch = conn.recv()
                except EOFError:
                    return _stop(children)
                try:
                    pid = os.fork()
                except OSError as e:
                    conn.send(("failed", 0, str(e)))
                    continue
                if pid == 0:
                    return launch
                children.add(pid)
                conn.send(("started", pid, None))
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


def _stop(children: set[int]) -> NoReturn:
    """The pytest process is gone: end whatever of ours it left running, then the zygote."""
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os._exit(0)


def _run(launch: Launch) -> None:
    os.setsid()
    for fd, path in ((1, launch.log), (2, launch.err or launch.log)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(launch.env)
    os.chdir(launch.cwd)
    sys.path.remove(TESTS)
    sys.argv = ["-c", *launch.args]
    from autotune.cli.app import main as cli

    cli()
