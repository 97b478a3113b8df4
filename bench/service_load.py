"""Load on ``GET /v1/best``: requests per second and latency at 64 concurrent clients, beside a bare FastAPI
endpoint served the same way in the same run, so the ratio says what our stack costs on this machine.

    python bench/service_load.py --out bench/results/service_load.json
    python bench/service_load.py --duration 5 --concurrency 16      # a quick look

Both servers are uvicorn processes on loopback (one worker each, access log off, pinned to one core and the
load generator to another where there are two); the controller runs with its scheduler and a SQLite
database holding the best configs of all ten slots for the queried shape.  The load generator is one
asyncio process with ``--concurrency`` clients, each sending its next request as soon as the last returned
(closed loop).  ``best`` is the default controller (answers cached 1 s, `api.cache`); ``best_uncached`` reads
the database on every request.  Targets (issue 5): at least 50% of the bare endpoint's rate, p99 at most 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import storage
from autotune.outcome import SlotOutcome
from overlap_runtime.config import Method, OverlapConfig
from overlap_runtime.measurement import Measurement
from overlap_runtime.shape import ModelShape
from search_spaces import tunable_slots

SHAPE = ModelShape(hidden=8192, tp=2, mbs=1, seq=8192)
QUERY = {"hidden": 8192, "tp": 2, "mbs": 1, "seq": 8192}
GPU = "NVIDIA H200"
TOKEN = "bench"
TARGET_RATIO = 0.5
TARGET_P99_MS = 50.0
START_TIMEOUT_S = 60.0
SERVER_CPUS = {1}
LOAD_CPUS = {0}


def bare_app() -> Any:
    """The reference: FastAPI with one GET route that returns a small constant (``--factory`` for uvicorn)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/bare")
    def bare() -> dict[str, bool]:
        return {"ok": True}

    return app


def seed_best_configs(db_url: str) -> None:
    """Winners for all ten slots of `SHAPE` on `GPU`, shaped like the scheduler writes them."""
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
        for slot in tunable_slots(SHAPE):
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
                shape=SHAPE,
                slot=slot.value,
                config=config.to_dict(),
                measurement=m.to_dict(),
                spread={"outcome": outcome.to_dict(), "trial_id": None},
            )
    engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cpus: set[int]) -> Any:
    """A preexec_fn pinning the child to ``cpus`` (where this machine has them): server and load generator
    then do not take turns on one core, which would measure the scheduler of the OS, not the server."""

    def pin() -> None:
        usable = cpus & os.sched_getaffinity(0)
        if usable and len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, usable)

    return pin


def serve(target: str, *, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``uvicorn --factory target`` on a free loopback port; return it and its base URL once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "--factory", target, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning", "--no-access-log"]
    proc = subprocess.Popen(command, env=env, preexec_fn=_pin(SERVER_CPUS))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/openapi.json", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{target} did not start within {START_TIMEOUT_S:g} s")


async def load(
    url: str, *, params: dict[str, Any], concurrency: int, duration_s: float, warmup_s: float
) -> dict[str, Any]:
    """Closed-loop load for warmup + duration; statistics over the requests that finished after the warm-up.

    Each client is one keep-alive HTTP/1.1 connection driven by a few lines of asyncio: a general-purpose
    async HTTP client costs more CPU per request than the bare endpoint itself, and would measure itself.
    """
    target = httpx.URL(url, params=params)
    request = (
        f"GET {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
        "Connection: keep-alive\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    end = measure_from + duration_s

    async def one_client() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            while (sent := time.perf_counter()) < end:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                done = time.perf_counter()
                if sent >= measure_from:
                    if head.startswith(b"HTTP/1.1 200"):
                        latencies.append(done - sent)
                    else:
                        errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    latencies.sort()
    ms = [1000 * x for x in latencies]
    return {
        "requests": len(ms),
        "errors": errors,
        "rps": round(len(ms) / duration_s, 1),
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[int(0.90 * (len(ms) - 1))], 2),
        "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
        "max_ms": round(ms[-1], 2),
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    _pin(LOAD_CPUS)()

    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        seed_best_configs(db_url)
        env = {**os.environ, "AUTOTUNE_DB_URL": db_url, "AUTOTUNE_TOKEN": TOKEN, "XDG_DATA_HOME": tmp}
        results = {}
        for name, target, path, params, extra_env in (
            ("bare", "bench.service_load:bare_app", "/bare", {}, {}),
            ("best", "api.main:app_from_env", "/v1/best", QUERY, {}),
            ("best_uncached", "api.main:app_from_env", "/v1/best", QUERY, {"AUTOTUNE_BEST_CACHE_S": "0"}),
        ):
            proc, url = serve(target, env=env | extra_env)
            try:
                answer = httpx.get(f"{url}{path}", params=params).json()
                if name != "bare" and not answer.get("measured"):
                    raise RuntimeError(f"/v1/best did not find the seeded configs: {answer}")
                stats = asyncio.run(
                    load(
                        f"{url}{path}",
                        params=params,
                        concurrency=args.concurrency,
                        duration_s=args.duration,
                        warmup_s=args.warmup,
                    )
                )
            finally:
                proc.terminate()
                proc.wait()
            results[name] = stats
            print(f"{name:>5}: {stats}", file=sys.stderr)

    ratio = results["best"]["rps"] / results["bare"]["rps"]
    report = {
        "benchmark": "GET /v1/best vs a bare FastAPI endpoint, closed loop on loopback",
        "machine": {
            "cpus": os.cpu_count(),
            "pinning": {"server": sorted(SERVER_CPUS), "load": sorted(LOAD_CPUS)},
            "python": platform.python_version(),
            "platform": platform.platform(),
            **{name: _version(name) for name in ("fastapi", "uvicorn", "uvloop", "httptools", "sqlalchemy")},
        },
        "config": {
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "query": QUERY,
            "slots": 10,
        },
        "bare": results["bare"],
        "best": results["best"],
        "best_uncached": results["best_uncached"],
        "best_uncached_note": "AUTOTUNE_BEST_CACHE_S=0: every request reads the ten rows (the default caches answers 1 s)",
        "ratio_of_bare_rps": round(ratio, 3),
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
