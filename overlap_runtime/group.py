"""A tensor-parallel group of worker processes, started by us, reused across many configs.

One process per rank (NCCL on CUDA, gloo on CPU), spawned once; the parent sends each rank the same
task (a picklable module-level function and its arguments) over a pipe and collects one result per rank.
A watchdog bounds every task: if any rank hangs past the timeout, dies, or raises, the whole group is
killed and `TrialFailure` carries the reason; the next task starts a fresh group, so a bad config costs
one start-up and never the caller.  Time a rank spends compiling kernels (`RankContext.compiling`; on CUDA
every Triton compile reports itself) does not count against the timeout, only against `COMPILE_LIMIT_S`:
a kernel's first launch with new constants can compile for many seconds on a fresh host (a fused ring
config's first measurement took 51 s on the H200, most of it compiling), which a short trial timeout
would take for a hang.

The ranks never outlive the process that started them (a worker killed by ``kill -9``, an OOM kill, a lost
node's agent): on Linux each rank asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``;
the kernel means the parent *thread*, so start a group from a thread that outlives it), and on every
platform a thread in each rank blocks on a lifeline pipe whose only write end the parent holds, and ends the
rank the moment that end closes.  SIGKILL and ``os._exit`` print nothing: a dead worker leaves no rank
behind, and no traceback of a pipe that broke under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from overlap_runtime.errors import TrialFailure

COMPILE_LIMIT_S = 600.0
"""The longest a rank may compile kernels within one task before the watchdog calls it hung."""
COMPILING = "compiling"
"""Message kind of a rank's compile notice (True: started, False: done); not a task reply."""

_SAFE_ENV = {
    # Never NVLink multicast on the lent machines (and NVLS gains nothing at TP=2).
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(kw_only=True)
class RankContext:
    """What a task sees inside one rank process."""

    rank: int
    tp: int
    backend: str
    device: Any
    """torch.device of this rank."""
    state: dict[str, Any] = field(default_factory=dict)
    """Per-process cache that outlives tasks (measured baselines, communicators, compiled kernels)."""
    conn: Connection | None = field(default=None, repr=False)
    """The pipe to the parent: task replies and compile notices."""
    compiles: int = 0
    """Compiles reported so far."""

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Tell the watchdog that this rank compiles: the time inside does not count against the timeout."""
        self.compile_started()
        try:
            yield
        finally:
            self.compile_finished()

    def compile_started(self) -> None:
        self.compiles += 1
        self._notify(True)

    def compile_finished(self) -> None:
        self._notify(False)

    def _notify(self, compiling: bool) -> None:
        if self.conn is not None:
            self.conn.send((COMPILING, compiling))


Task = Callable[..., Any]

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when its parent (thread) dies."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_on_parent_death(sig: signal.Signals) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent (thread) dies; whether it could (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _die_with_parent(parent_pid: int, lifeline: Connection) -> None:
    """End this rank as soon as its parent is gone (module docstring); called first thing in a rank."""
    signal_on_parent_death(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the kernel was asked
        os._exit(0)
    threading.Thread(target=_wait_for_eof, args=(lifeline,), name="lifeline", daemon=True).start()


def _wait_for_eof(lifeline: Connection) -> None:
    """Block until the parent's end of ``lifeline`` closes (nothing is ever sent on it), then end the rank."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            lifeline.recv_bytes()
    os._exit(0)


def _rank_main(
    rank: int,
    tp: int,
    backend: str,
    port: int,
    conn: Connection,
    env: dict[str, str],
    parent: tuple[int, Connection],
) -> None:
    """One rank: join the process group, then run the tasks that arrive on ``conn`` until told to stop.
    ``parent``: the parent's pid and the read end of its lifeline pipe."""
    _die_with_parent(*parent)
    os.environ.update(_SAFE_ENV | env)
    import torch
    import torch.distributed as dist

    if backend == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        pg_backend = "nccl"
    else:
        # One intra-op thread per rank: ranks share the host's cores, and gloo needs its own threads.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        device = torch.device("cpu")
        pg_backend = "gloo"
    try:
        dist.init_process_group(
            pg_backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=tp,
            timeout=datetime.timedelta(seconds=600),
            device_id=device if backend == "cuda" else None,
        )
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    ctx = RankContext(rank=rank, tp=tp, backend=backend, device=device, conn=conn)
    if backend == "cuda":
        _report_triton_compiles(ctx)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(ctx, *args, **kwargs)))
        except Exception as e:
            conn.send(("raised", e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
    dist.destroy_process_group()


def _report_triton_compiles(ctx: RankContext) -> None:
    """Wrap every Triton compile of this process in `RankContext.compiling`, through Triton's JIT hooks
    (called before and after a kernel is compiled for new constants; a hook that returns True would skip the
    compile)."""
    from triton import knobs

    def before(**_: Any) -> bool:
        ctx.compile_started()
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = lambda **_: ctx.compile_finished()


def _picklable(e: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return False
    return True


class TPGroup:
    """``tp`` rank processes on ``backend`` ("cuda": one GPU each; "cpu": gloo), restarted after a failure."""

    def __init__(
        self,
        *,
        tp: int,
        backend: str,
        start_timeout_s: float = 120.0,
        compile_limit_s: float = COMPILE_LIMIT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.tp = tp
        self.backend = backend
        self.env = dict(env or {})
        """Environment variables every rank sets before it imports torch (the te backend's, `te_args.TE_ENV`)."""
        self.start_timeout_s = start_timeout_s
        self.compile_limit_s = compile_limit_s
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._lifeline: Connection | None = None
        """The write end of the ranks' lifeline pipe: it closes when this process dies, and the ranks end."""
        self.starts = 0

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Task, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Raises `TrialFailure` (and leaves the group to be restarted) when a rank hangs past ``timeout_s``
        (not counting time that a rank spends compiling, up to ``compile_limit_s``), dies, or raises anything
        but an `InputError`, which is re-raised as is: bad input is not a failure of the group.
        """
        if not self.alive:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(timeout_s, what=getattr(fn, "__name__", "task"))
        raised = [r for kind, r in replies if kind == "raised"]
        if raised:
            from overlap_runtime.errors import InputError

            if isinstance(raised[0], InputError):
                raise raised[0]
            self.close()
            raise TrialFailure(f"crashed: {type(raised[0]).__name__}: {raised[0]}")
        return [r for _, r in replies]

    def _collect(self, timeout_s: float, *, what: str) -> list[tuple[str, Any]]:
        clock = _WatchdogClock(timeout_s, self.compile_limit_s)
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            if clock.compile_overrun():
                self.close()
                raise TrialFailure(
                    f"hung: ranks {sorted(clock.compiling)} compiled kernels for over {self.compile_limit_s:g} s "
                    f"during {what}"
                )
            left = clock.left()
            if left <= 0:
                self.close()
                raise TrialFailure(f"hung: {what} did not finish within {timeout_s:g} s on ranks {sorted(pending)}")
            for conn in wait(list(pending.values()), timeout=min(left, 1.0)):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[rank].exitcode
                    self.close()
                    raise TrialFailure(f"crashed: rank {rank} died (exit code {code}) during {what}") from None
                if kind == COMPILING:
                    clock.compile(rank, body)
                    continue
                clock.compile(rank, False)
                replies[rank] = (kind, body)
                del pending[rank]
            dead = [r for r in pending if not self._procs[r].is_alive()]
            if dead:
                code = self._procs[dead[0]].exitcode
                self.close()
                raise TrialFailure(f"crashed: rank {dead[0]} died (exit code {code}) during {what}")
        return [replies[r] for r in range(self.tp)]

    def _start(self) -> None:
        self.close()
        ctx = mp.get_context("spawn")
        port = _free_port()
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        for rank in range(self.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, self.tp, self.backend, port, child, self.env, (os.getpid(), lifeline)),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        lifeline.close()
        self.starts += 1
        replies = self._collect(self.start_timeout_s, what="process group start-up")
        errors = [r for kind, r in replies if kind == "error"]
        if errors:
            self.close()
            raise TrialFailure(f"process group failed to start: {errors[0].strip().splitlines()[-1]}")

    def close(self) -> None:
        """Stop every rank: politely if it is idle, by SIGKILL if it hangs."""
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        if self._lifeline is not None:
            self._lifeline.close()
        self._procs, self._conns, self._lifeline = [], [], None


class _WatchdogClock:
    """A task's timeout that stands still while any rank compiles (see the module docstring)."""

    def __init__(self, timeout_s: float, compile_limit_s: float) -> None:
        self.started = time.monotonic()
        self.timeout_s = timeout_s
        self.compile_limit_s = compile_limit_s
        self.compiling: set[int] = set()
        self.paused_at: float | None = None
        self.paused_before_s = 0.0
        """Compile time of the pauses that ended."""

    def compile(self, rank: int, started: bool) -> None:
        if started:
            self.compiling.add(rank)
        else:
            self.compiling.discard(rank)
        if self.compiling and self.paused_at is None:
            self.paused_at = time.monotonic()
        elif not self.compiling and self.paused_at is not None:
            self.paused_before_s = self.paused_s()
            self.paused_at = None

    def paused_s(self) -> float:
        """Seconds that some rank has spent compiling in this task, the current pause included."""
        return self.paused_before_s + (time.monotonic() - self.paused_at if self.paused_at is not None else 0.0)

    def left(self) -> float:
        """Seconds of timeout left; it does not run down while a rank compiles."""
        return self.started + self.timeout_s + self.paused_s() - time.monotonic()

    def compile_overrun(self) -> bool:
        return self.paused_s() > self.compile_limit_s
