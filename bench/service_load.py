"""Load on ``GET /v1/best`` over many shapes: requests per second and latency at 64 concurrent clients, with
the controller's 1 s answer cache and without it, beside a bare FastAPI endpoint served the same way in the
same run, so the ratios say what our stack costs on this machine.

    python bench/service_load.py --out bench/results/service_load.json
    python bench/service_load.py --duration 5 --concurrency 16      # a quick look
    python bench/service_load.py --server-workers 8 --load-procs 4  # a many-core host
    python bench/service_load.py --shapes 1                          # one shape: what the cache alone serves

Both servers are uvicorn on loopback with ``--server-workers`` processes each (1 by default; the same number
for both, so the ratio stays fair), access log off; the load starts once every process has finished its
start-up.  The controller runs with its scheduler (every process, one of them holding the lease) and a
SQLite database holding the best configs of all ten slots for each of ``--shapes`` shapes (128 by default:
16 hidden sizes x 4 sequence lengths x 2 micro-batch sizes).  Every client asks for the shapes in turn,
starting at its own, so consecutive requests ask for different shapes; the bare endpoint gets the same
requests (it ignores the query).  The load generator is
``--load-procs`` asyncio processes (1 by default) sharing ``--concurrency`` clients, each client sending its
next request as soon as the last returned (closed loop) on one keep-alive connection; the connections are
opened one after the other, so with several server processes each is accepted by whichever process is idle
(opened at once, they would mostly go to the first process to wake, and stay there).  CPUs: the load
generator gets the first cores, one each, the servers the next ``--server-workers`` cores, shared by both
servers' processes in turn; a machine with fewer cores shares what it has (``machine.pinning`` records it).
``best`` is the default controller (answers cached 1 s, `api.cache`: with N shapes, at most N misses a
second); ``best_uncached`` reads the database on every request.  Beside each endpoint's numbers, ``cpu_use``
says how busy each load-generator process was (CPU seconds per second; near 1.0, it and not the server may
be the limit) and each server process (how evenly they shared the work).  ``machine.load_average_before``
says whether other work shared the machine.
Targets (issue 5): at least 50% of the bare endpoint's rate, p99 at most 50 ms, cached; the uncached
numbers are reported beside them, without a target.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import itertools
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import storage
from autotune.tuner.outcome import SlotOutcome
from bench.environment import source
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape
from search_spaces import tunable_slots

HIDDEN = tuple(range(1024, 16385, 1024))
SEQ = (1024, 2048, 4096, 8192, 16384)
MBS = (1, 2, 4)
TP = 2
GPU = "NVIDIA H200"
TOKEN = "bench"
TARGET_RATIO = 0.5
TARGET_P99_MS = 50.0
START_TIMEOUT_S = 60.0
STARTED = "Application startup complete."
"""What uvicorn logs (at info) in each process once its app is up."""


def bare_app() -> Any:
    """The reference: FastAPI with one GET route that returns a small constant (``--factory`` for uvicorn)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/bare")
    def bare() -> dict[str, bool]:
        return {"ok": True}

    return app


def shapes(n: int) -> list[ModelShape]:
    """The first ``n`` of the benchmark's shapes (hidden sizes, then sequence lengths, then micro-batches)."""
    every = [ModelShape(hidden=h, tp=TP, mbs=b, seq=s) for b in MBS for s in SEQ for h in HIDDEN]
    if not 1 <= n <= len(every):
        raise ValueError(f"--shapes must be between 1 and {len(every)} (got {n})")
    return every[:n]


def query(shape: ModelShape) -> dict[str, int]:
    return {"hidden": shape.hidden, "tp": shape.tp, "mbs": shape.mbs, "seq": shape.seq}


def seed_best_configs(db_url: str, asked: list[ModelShape]) -> None:
    """Winners for all ten slots of every shape on `GPU`, shaped like the scheduler writes them."""
    engine = storage.create_engine_for(url=db_url)
    storage.upgrade(engine=engine)
    samples = tuple(1.0 + 0.01 * i for i in range(20))
    m = Measurement(
        gemm_ms=1.0,
        comm_ms=0.5,
        serial_ms=1.5,
        overlap_ms=1.1,
        rel_err=1e-3,
        cv=0.01,
        repeats=20,
        valid=True,
        samples=samples,
    )
    config = OverlapConfig(method=Method.NONE)
    with storage.session_factory(engine=engine)() as session:
        for shape, slot in ((a, slot) for a in asked for slot in tunable_slots(a)):
            outcome = SlotOutcome(
                slot=slot,
                best=config,
                best_measurement=m,
                best_overlap=None,
                best_overlap_measurement=None,
                te_default_measurement=m,
                spread=0.01,
                n_trials=30,
                n_failed=1,
            )
            storage.upsert_best(
                session=session,
                gpu=GPU,
                shape=shape,
                slot=slot.value,
                config=config.to_dict(),
                measurement=m.to_dict(),
                outcome=outcome.to_dict(),
            )
    engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuPlan:
    """Which cores the load generator and the servers run on."""

    load: list[int]
    """One core per load-generator process (round-robin when there are more processes than cores)."""
    server: list[int]
    """The cores both servers' processes share (the OS places each process among them)."""


def plan_cpus(*, server_workers: int, load_procs: int) -> CpuPlan:
    """The load generator on the first cores, one server process per core on the next ones, as far as this
    machine has cores; with one core, everything shares it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) == 1:
        return CpuPlan(load=cpus, server=cpus)
    n_load = min(load_procs, len(cpus) - 1)
    return CpuPlan(load=cpus[:n_load], server=cpus[n_load:][:server_workers])


def _pin(cpus: list[int]) -> Any:
    """A preexec_fn pinning the process to ``cpus`` (from `plan_cpus`): server and load generator then do not
    take turns on one core, which would measure the scheduler of the OS, not the server.

    The cores come from the plan, made before this process pinned itself, never from the forked child's own
    affinity: a server forked by a load generator already pinned to core 0 inherits {0}, and checking the
    wanted cores against that would leave it on core 0.  `main` checks where the servers really run.
    """

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


def serve(target: str, *, env: dict[str, str], workers: int, cpus: list[int]) -> tuple[subprocess.Popen[str], str]:
    """Start ``uvicorn --factory target --workers N`` on a free loopback port; return it and its base URL once
    every one of its processes has started (a process still starting would get no connections)."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "--factory", target, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(workers), "--log-level", "info", "--no-access-log"]
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_pin(cpus))
    all_started = threading.Event()

    def watch_log() -> None:
        """Count start-ups; pass on anything but uvicorn's info lines (drained to the end: a full pipe blocks)."""
        started = 0
        assert proc.stderr is not None
        for line in proc.stderr:
            started += STARTED in line
            if started == workers:
                all_started.set()
            if not line.startswith("INFO:"):
                sys.stderr.write(line)

    threading.Thread(target=watch_log, daemon=True).start()
    if not all_started.wait(START_TIMEOUT_S) or proc.poll() is not None:
        proc.kill()
        raise RuntimeError(f"{target} did not start {workers} process(es) within {START_TIMEOUT_S:g} s")
    return proc, f"http://127.0.0.1:{port}"


def server_processes(proc: subprocess.Popen[str], *, workers: int) -> list[int]:
    """The pids that serve requests: uvicorn itself, or with several workers the processes it spawned."""
    if workers == 1:
        return [proc.pid]
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == proc.pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    return sorted(pids)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(kw_only=True, slots=True)
class LoadPart:
    """What one load-generator process saw."""

    latencies: list[float] = field(default_factory=list)
    """Seconds per request that finished after the warm-up, answered 200."""
    errors: int = 0
    wrong: int = 0
    """Answers 200 whose body ``check`` refused (`closed_loop`)."""
    cpu_s: float = 0.0
    """CPU time the process used while its clients ran."""
    wall_s: float = 0.0


async def closed_loop(
    url: str,
    *,
    queries: list[dict[str, Any]],
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    barrier: Any = None,
    check: Callable[[int, bytes], bool] | None = None,
) -> LoadPart:
    """Closed-loop load for warmup + duration; statistics over the requests that finished after the warm-up.

    Each client is one keep-alive HTTP/1.1 connection driven by a few lines of asyncio: a general-purpose
    async HTTP client costs more CPU per request than the bare endpoint itself, and would measure itself.
    Client i asks for ``queries[i], queries[i + 1], ...`` in turn.
    Connections are opened (and answered once) one at a time, then ``barrier`` (several load processes) lines
    the processes up, and the clock starts.  ``check(i, body)``: whether the body of an answer to
    ``queries[i]`` is right (every answer's, warm-up included); a 200 it refuses counts as ``wrong``.
    """
    base = httpx.URL(url)
    requests = [
        (
            f"GET {httpx.URL(url, params=q).raw_path.decode()} HTTP/1.1\r\nHost: {base.host}:{base.port}\r\n"
            "Connection: keep-alive\r\n\r\n"
        ).encode()
        for q in queries
    ]
    part = LoadPart()

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: int) -> bytes:
        writer.write(requests[request])
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        body = await reader.readexactly(length)
        if check is not None and head.startswith(b"HTTP/1.1 200") and not check(request, body):
            part.wrong += 1
        return head

    connections = []
    for i in range(concurrency):
        reader, writer = await asyncio.open_connection(base.host, base.port)
        await exchange(reader, writer, i % len(requests))
        connections.append((reader, writer))
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    cpu_start = time.process_time()
    measure_from = start + warmup_s
    end = measure_from + duration_s

    async def one_client(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        turn = itertools.count(index)
        try:
            while (sent := time.perf_counter()) < end:
                head = await exchange(reader, writer, next(turn) % len(requests))
                done = time.perf_counter()
                if sent >= measure_from:
                    if head.startswith(b"HTTP/1.1 200"):
                        part.latencies.append(done - sent)
                    else:
                        part.errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_client(i, r, w) for i, (r, w) in enumerate(connections)))
    part.cpu_s = time.process_time() - cpu_start
    part.wall_s = time.perf_counter() - start
    return part


def _load_process(cpu: int, barrier: Any, results: Any, url: str, options: dict[str, Any]) -> None:
    """One load-generator process of several: pinned to ``cpu``, its part of the clients, its part back."""
    _pin([cpu])()
    results.put(asyncio.run(closed_loop(url, barrier=barrier, **options)))


def load(url: str, *, procs: int, cpus: list[int], **options: Any) -> tuple[dict[str, Any], list[float]]:
    """Closed-loop load from ``procs`` processes sharing ``options["concurrency"]`` clients: the statistics,
    and how busy each load process was (CPU seconds per second)."""
    if procs == 1:
        parts = [asyncio.run(closed_loop(url, **options))]
    else:
        context = multiprocessing.get_context("spawn")
        barrier, results = context.Barrier(procs), context.Queue()
        shares = [options["concurrency"] // procs + (i < options["concurrency"] % procs) for i in range(procs)]
        workers = [
            context.Process(
                target=_load_process,
                args=(cpus[i % len(cpus)], barrier, results, url, options | {"concurrency": shares[i]}),
            )
            for i in range(procs)
        ]
        for worker in workers:
            worker.start()
        timeout = START_TIMEOUT_S + options["warmup_s"] + options["duration_s"]
        parts = [results.get(timeout=timeout) for _ in workers]  # before join: a full pipe would block the child
        for worker in workers:
            worker.join()
    latencies = sorted(x for part in parts for x in part.latencies)
    ms = [1000 * x for x in latencies]
    stats = {
        "requests": len(ms),
        "errors": sum(part.errors for part in parts),
        "rps": round(len(ms) / options["duration_s"], 1),
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[int(0.90 * (len(ms) - 1))], 2),
        "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
        "max_ms": round(ms[-1], 2),
    }
    return stats, [round(part.cpu_s / part.wall_s, 3) for part in parts]


def machine(load_average: Sequence[float], plan: CpuPlan, packages: Sequence[str]) -> dict[str, Any]:
    """What a load figure depends on besides the code: cores, how busy they were, the pinning, the versions."""
    return {
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_average],
        "pinning": {"server": plan.server, "load": plan.load},
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{name: _version(name) for name in packages},
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=15.0, help="Measured seconds per endpoint")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument(
        "--server-workers", type=int, default=1, help="uvicorn processes per server (the same for both servers)"
    )
    parser.add_argument("--load-procs", type=int, default=1, help="Load-generator processes sharing the clients")
    parser.add_argument("--shapes", type=int, default=128, help="Distinct shapes asked for, in turn")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name in ("concurrency", "server_workers", "load_procs", "shapes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.load_procs > args.concurrency:
        parser.error(f"--load-procs must not exceed --concurrency ({args.concurrency}) (got {args.load_procs})")
    try:
        asked = shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    queries = [query(s) for s in asked]
    plan = plan_cpus(server_workers=args.server_workers, load_procs=args.load_procs)
    load_average = os.getloadavg()
    _pin(plan.load[:1])()

    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        seed_best_configs(db_url, asked)
        env = {**os.environ, "AUTOTUNE_DB_URL": db_url, "AUTOTUNE_TOKEN": TOKEN, "XDG_DATA_HOME": tmp}
        results, cpu_use = {}, {}
        for name, target, path, extra_env in (
            ("bare", "bench.service_load:bare_app", "/bare", {}),
            ("best", "api.main:app_from_env", "/v1/best", {}),
            ("best_uncached", "api.main:app_from_env", "/v1/best", {"AUTOTUNE_BEST_CACHE_S": "0"}),
        ):
            proc, url = serve(target, env=env | extra_env, workers=args.server_workers, cpus=plan.server)
            try:
                for params in (queries[0], queries[-1]):
                    answer = httpx.get(f"{url}{path}", params=params).json()
                    if name != "bare" and not answer.get("measured"):
                        raise RuntimeError(f"/v1/best did not find the seeded configs of {params}: {answer}")
                pids = server_processes(proc, workers=args.server_workers)
                pinned = {cpu for pid in pids for cpu in os.sched_getaffinity(pid)}
                if pinned != set(plan.server):
                    raise RuntimeError(f"server processes run on cores {sorted(pinned)}, not {plan.server}")
                before, started = [cpu_seconds(pid) for pid in pids], time.perf_counter()
                stats, load_busy = load(
                    f"{url}{path}",
                    procs=args.load_procs,
                    cpus=plan.load,
                    queries=queries,
                    concurrency=args.concurrency,
                    duration_s=args.duration,
                    warmup_s=args.warmup,
                )
                wall = time.perf_counter() - started
                server_busy = [round((cpu_seconds(pid) - b) / wall, 3) for pid, b in zip(pids, before, strict=True)]
            finally:
                proc.terminate()
                proc.wait()
            results[name] = stats
            cpu_use[name] = {"load_busy": load_busy, "server_busy": server_busy}
            print(f"{name:>5}: {stats} {cpu_use[name]}", file=sys.stderr)

    ratio = results["best"]["rps"] / results["bare"]["rps"]
    report = {
        "benchmark": "GET /v1/best over many shapes, cached and uncached, vs a bare FastAPI endpoint, closed loop on loopback",
        "source": source(),
        "machine": machine(load_average, plan, ("fastapi", "uvicorn", "uvloop", "httptools", "sqlalchemy")),
        "config": {
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "server_workers": args.server_workers,
            "load_procs": args.load_procs,
            "shapes": len(queries),
            "queries": [queries[0], queries[-1]],
            "slots": 10,
        },
        "bare": results["bare"],
        "best": results["best"],
        "best_uncached": results["best_uncached"],
        "best_note": f"the default controller: each of the {len(queries)} shapes' answers cached 1 s",
        "best_uncached_note": "AUTOTUNE_BEST_CACHE_S=0: every request reads the ten rows of its shape",
        "cpu_use": cpu_use,
        "cpu_use_note": "CPU seconds per second while the load ran: each load-generator process, each server process",
        "ratio_of_bare_rps": round(ratio, 3),
        "uncached_ratio_of_bare_rps": round(results["best_uncached"]["rps"] / results["bare"]["rps"], 3),
        "targets": {"ratio_of_bare_rps": TARGET_RATIO, "p99_ms": TARGET_P99_MS},
        "meets_targets": ratio >= TARGET_RATIO and results["best"]["p99_ms"] <= TARGET_P99_MS,
    }
    text = json.dumps(report, indent=2) + "\n"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
