"""A tensor-parallel group of worker processes, started by us, reused across many configs.

One process per rank (NCCL on CUDA, gloo on CPU), started once; the parent sends each rank the same
task (a picklable module-level function and its arguments) over a pipe and collects one result per rank.
A watchdog bounds every task: if any rank hangs past the timeout, dies, or raises, the whole group is
killed and `TrialFailure` carries the reason; the next task starts a fresh group, so a bad config costs
one start-up and never the caller.  Time a rank spends compiling kernels (`RankContext.compiling`; on CUDA
every Triton compile reports itself) does not count against the timeout, only against `COMPILE_LIMIT_S`:
a kernel's first launch with new constants can compile for many seconds on a fresh host (a fused ring
config's first measurement took 51 s on the H200, most of it compiling), which a short trial timeout
would take for a hang.

Only rank 0 is spawned: it imports torch (on CPU also the emulated devices and the kernels' modules), then
forks the other ranks from itself before it starts any thread or touches a device, so a group (and its restart
after a failed config) pays one torch import instead of ``tp`` (about 3 CPU-seconds each).  Rank 0 reaps the
ranks it forked and reports their exit codes to the parent.
The ranks meet in a file (torch's FileStore in a fresh temporary folder), not on a TCP port: a port picked
free by the parent can be taken by another group or program before rank 0 listens on it, which failed a
start with EADDRINUSE (a rank could as well reach another group's store on that port).

The ranks never outlive the process that started them (a worker killed by ``kill -9``, an OOM kill, a lost
node's agent): on Linux each rank asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``;
the kernel means the parent *thread*, so start a group from a thread that outlives it; a forked rank's parent
is rank 0, which the same signal ends), and on every platform a thread in each rank blocks on a lifeline pipe
whose only write end the parent holds, and ends the rank the moment that end closes.  SIGKILL and
``os._exit`` print nothing: a dead worker leaves no rank behind, and no traceback of a pipe that broke
under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
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


def signal_on_parent_death(sig: signal.Signals) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent (thread) dies; whether it could (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel end this rank when its parent goes (module docstring); called first thing in a rank."""
    signal_on_parent_death(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the kernel was asked
        os._exit(0)


def _wait_for_eof(lifeline: Connection) -> None:
    """Block until the parent's end of ``lifeline`` closes (nothing is ever sent on it), then end the rank."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            lifeline.recv_bytes()
    os._exit(0)


def _watch(target: Callable[..., None], *args: Any, name: str) -> None:
    threading.Thread(target=target, args=args, name=name, daemon=True).start()


@dataclass(frozen=True, kw_only=True)
class _Start:
    """What rank 0 gets from the parent to start the group."""

    tp: int
    backend: str
    store_path: str
    """The file the ranks meet in (torch's FileStore): a fresh one per start, in a folder the parent removes."""
    env: dict[str, str]
    conns: list[Connection]
    """The rank end of each rank's pipe to the parent."""
    exits: Connection
    """Where rank 0 reports each forked rank's exit code, as (rank, code)."""
    parent_pid: int
    lifeline: Connection
    """The read end of the parent's lifeline pipe."""


def _group_main(start: _Start) -> None:
    """Rank 0: import torch once, fork ranks 1..tp-1 from this process, then serve as rank 0."""
    _die_with_parent(start.parent_pid)
    os.environ.update(_SAFE_ENV | start.env)
    import torch.distributed  # noqa: F401  (before the fork: what the forked ranks save)

    if start.backend == "cpu":
        # Every task of the runtime unpickles into the devices' module, which imports the kernels and Triton
        # (0.4-0.5 CPU-s a rank). Imported here the forked ranks share it; a CUDA group's ranks import it
        # after the fork, so that nothing but torch's own import precedes a fork there.
        import overlap_runtime.emulation  # noqa: F401

    forked = _Forked(start.exits)
    zygote = os.getpid()
    for rank in range(1, start.tp):
        pid = os.fork()
        if pid == 0:
            _forked_rank(start, rank, zygote)
        forked.ranks[pid] = rank
    for rank in range(1, start.tp):
        start.conns[rank].close()
    _watch(_wait_for_eof, start.lifeline, name="lifeline")
    forked.watch()
    try:
        _serve(start, 0)
    finally:
        forked.stop(grace_s=2.0)
    # Ended as the forked ranks end, without the interpreter's shutdown: its collection and module teardown
    # cost rank 0 about 0.5 CPU-s and the closing caller as much wall time (torch, Triton and the emulated
    # devices are loaded), and the rank has nothing left to clean up (the process group is destroyed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _forked_rank(start: _Start, rank: int, zygote: int) -> None:
    """A rank forked from rank 0 (``zygote``): drop the other ranks' pipes, then serve; never returns."""
    code = 0
    try:
        _die_with_parent(zygote)
        for other, conn in enumerate(start.conns):
            if other != rank:
                conn.close()
        start.exits.close()
        _watch(_wait_for_eof, start.lifeline, name="lifeline")
        _serve(start, rank)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


@dataclass
class _Forked:
    """The ranks that rank 0 forked (pid -> rank), each waited for by a thread that reports its exit code."""

    exits: Connection
    ranks: dict[int, int] = field(default_factory=dict)
    _waiters: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self) -> None:
        for pid in self.ranks:
            waiter = threading.Thread(target=self._wait, args=(pid,), name=f"reap-{pid}", daemon=True)
            waiter.start()
            self._waiters.append(waiter)

    def _wait(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        with self._lock, contextlib.suppress(OSError):
            self.exits.send((self.ranks[pid], os.waitstatus_to_exitcode(status)))

    def stop(self, *, grace_s: float) -> None:
        """Give the ranks (told to stop as rank 0 was) ``grace_s`` to leave, then kill any that has not."""
        deadline = time.monotonic() + grace_s
        for waiter in self._waiters:
            waiter.join(timeout=max(0.0, deadline - time.monotonic()))
        for pid, waiter in zip(self.ranks, self._waiters, strict=True):
            if waiter.is_alive():  # not reaped yet, so the pid is still this rank's
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _serve(start: _Start, rank: int) -> None:
    """One rank: join the process group, then run the tasks that arrive on its pipe until told to stop."""
    import torch
    import torch.distributed as dist

    conn = start.conns[rank]
    if start.backend == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        pg_backend = "nccl"
    else:
        # One intra-op thread per rank: ranks share the host's cores, and gloo needs its own threads.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // start.tp))
        device = torch.device("cpu")
        pg_backend = "gloo"
    try:
        dist.init_process_group(
            pg_backend,
            init_method=f"file://{start.store_path}",
            rank=rank,
            world_size=start.tp,
            timeout=datetime.timedelta(seconds=600),
            device_id=device if start.backend == "cuda" else None,
        )
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    ctx = RankContext(rank=rank, tp=start.tp, backend=start.backend, device=device, conn=conn)
    if start.backend == "cuda":
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
        self._rank0: mp.process.BaseProcess | None = None
        self._conns: list[Connection] = []
        """The parent's end of each rank's pipe."""
        self._exits: Connection | None = None
        """Where rank 0 reports the exit codes of the ranks it forked."""
        self._exited: dict[int, int] = {}
        self._lifeline: Connection | None = None
        """The write end of the ranks' lifeline pipe: it closes when this process dies, and the ranks end."""
        self._store_dir: str | None = None
        """The folder of the current start's rendezvous file."""
        self.starts = 0

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._rank0 is not None and not self._dead()

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
                    code = self._exit_code(rank)
                    self.close()
                    raise TrialFailure(f"crashed: rank {rank} died (exit code {code}) during {what}") from None
                if kind == COMPILING:
                    clock.compile(rank, body)
                    continue
                clock.compile(rank, False)
                replies[rank] = (kind, body)
                del pending[rank]
            dead = {r: code for r, code in self._dead().items() if r in pending}
            if dead:
                rank = min(dead)
                self.close()
                raise TrialFailure(f"crashed: rank {rank} died (exit code {dead[rank]}) during {what}")
        return [replies[r] for r in range(self.tp)]

    def _start(self) -> None:
        self.close()
        ctx = mp.get_context("spawn")
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self._exits, exits = ctx.Pipe(duplex=False)
        pipes = [ctx.Pipe() for _ in range(self.tp)]
        self._store_dir = tempfile.mkdtemp(prefix="tp-group-")
        start = _Start(
            tp=self.tp,
            backend=self.backend,
            store_path=os.path.join(self._store_dir, "store"),
            env=self.env,
            conns=[child for _, child in pipes],
            exits=exits,
            parent_pid=os.getpid(),
            lifeline=lifeline,
        )
        rank0 = ctx.Process(target=_group_main, args=(start,), daemon=True)
        # Kept only once started: a signal inside start() (a worker's SIGTERM) would leave close() a process it
        # cannot join, and a rank 0 that start() may have made ends when close() shuts the lifeline.
        rank0.start()
        self._rank0 = rank0
        for end in (lifeline, exits, *start.conns):
            end.close()
        self._conns = [parent for parent, _ in pipes]
        self.starts += 1
        replies = self._collect(self.start_timeout_s, what="process group start-up")
        errors = [r for kind, r in replies if kind == "error"]
        if errors:
            self.close()
            raise TrialFailure(f"process group failed to start: {errors[0].strip().splitlines()[-1]}")

    def _dead(self) -> dict[int, int | None]:
        """The ranks known to have ended, with their exit codes (None: not known yet)."""
        if self._exits is not None:
            with contextlib.suppress(EOFError, OSError):
                while self._exits.poll():
                    rank, code = self._exits.recv()
                    self._exited[rank] = code
        dead: dict[int, int | None] = dict(self._exited)
        if self._rank0 is not None and not self._rank0.is_alive():
            dead[0] = self._rank0.exitcode
        return dead

    def _exit_code(self, rank: int) -> int | None:
        """The exit code of a rank whose pipe broke, once its reaper (or ours, for rank 0) has seen it."""
        deadline = time.monotonic() + 1.0
        while rank not in (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return dead.get(rank)

    def close(self) -> None:
        """Stop every rank: politely if it is idle, by SIGKILL if it hangs (rank 0's death ends the others)."""
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        if self._rank0 is not None:
            self._rank0.join(timeout=3.0)
            if self._rank0.is_alive():
                self._rank0.kill()
                self._rank0.join(timeout=5.0)
        for end in (*self._conns, self._lifeline, self._exits):
            if end is not None:
                end.close()
        self._rank0, self._conns, self._lifeline, self._exits, self._exited = None, [], None, None, {}
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None


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
