"""Event-stream flood: 200 open ``/v1/jobs/{id}/events`` streams over 50 jobs plus 64 clients reading
``GET /v1/best`` for 200 shapes against one controller, while ``/healthz`` is sampled and synthetic workers
drive the followed jobs.

    python bench/stream_load.py --out bench/results/stream_load.json
    python bench/stream_load.py --streams 50 --clients 16 --duration 5     # a quick look

The controller is ``uvicorn --factory api.main:app_from_env`` (one process, its scheduler on, pinned to a
core of its own) on a SQLite file seeded with the best configs of ``--shapes`` shapes
(`bench.service_load.seed_best_configs`).  The load process, pinned to the other cores: ``--jobs`` cpu
jobs, each followed by ``--streams / --jobs`` event streams opened at once; ``--clients`` closed-loop
clients asking ``/v1/best`` for the shapes in turn (`bench.service_load.closed_loop`, raw keep-alive
connections cheap enough that the controller, not the load generator, is what saturates: ``cpu_use``
says so); and ``--workers`` synthetic workers speaking the real worker protocol (register, claim, report
with the lease nonce) with plausible measurements, so the jobs make progress without measuring anything on
this machine's cores.  ``/healthz`` is asked every ``HEALTH_EVERY_S`` by a process of its own
(`sample_health`), so its latency is the controller's and not a wait for the busy load process.
A stream passes when it saw its job's progress change (at least two ``progress`` events with a growing
``done``) and, if its job finished in the run, the ``done`` event.  Errors: any answer that is not 200
(204 for an empty claim), any stream that ended early or broke, any ``/v1/best`` answer that is not the
measured winners of every slot of the shape asked (`right_answer`).  ``--best-cache-s`` is the controller's
answer cache (0, the default here, turns it off: every answer reads the database); the share of answers
served from it is counted by the controller (``autotune_best_answers_total``) and recorded.
Targets (issue 21): ``/healthz`` p99 at most 100 ms, no errors, every stream heard its job's progress.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment
from bench.service_load import (
    TOKEN,
    LoadPart,
    closed_loop,
    cpu_seconds,
    machine,
    plan_cpus,
    query,
    seed_best_configs,
    serve,
    shapes,
)
from overlap_runtime.shape import ModelShape
from overlap_runtime.uncertainty import Series
from search_spaces import tunable_slots

HEALTH_EVERY_S = 0.1
TARGET_HEALTH_P99_MS = 100.0
SHAPE = {"hidden": 64, "tp": 2, "mbs": 1}
"""The jobs' shape; job i tunes seq = 32 (i + 1), so each has a study of its own (jobs on one study wait)."""


@dataclass(kw_only=True)
class Tally:
    """What the load process saw: the `/v1/best` clients' part, errors by what failed, each stream's events."""

    best: LoadPart = field(default_factory=LoadPart)
    """The `/v1/best` clients; its ``cpu_s`` is the whole load process's (streams and workers too)."""
    server_cpu_s: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    streams: list[dict[str, Any]] = field(default_factory=list)
    reports: int = 0
    served: dict[str, float] = field(default_factory=dict)
    """``/v1/best`` answers during the run by where they came from (`best_answers`)."""

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


def measurement(rng: random.Random) -> dict[str, Any]:
    """A plausible result (it passes the controller's physics check): the overlapped op a little slower
    than its GEMM, hiding part of a shorter collective."""
    gemm, comm = 1.0, 0.5
    typical = gemm + comm * rng.uniform(0.1, 0.9)
    repeats = Series(samples=[typical * rng.uniform(0.99, 1.01) for _ in range(5)])
    samples, overlap = list(repeats.samples), repeats.median  # the controller recomputes both from the samples
    return {
        "gemm_ms": gemm,
        "comm_ms": comm,
        "serial_ms": gemm + comm,
        "overlap_ms": overlap,
        "rel_err": 1e-3,
        "cv": repeats.cv,
        "repeats": len(samples),
        "valid": True,
        "samples": samples,
        "exposed_ms": overlap - gemm,
        "hidden_frac": 1 - (overlap - gemm) / comm,
    }


async def synthetic_worker(client: httpx.AsyncClient, index: int, stop: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(index)
    body = {"name": f"synthetic{index}", "host": "bench", "backend": "cpu"}
    worker = (await client.post("/v1/workers", json=body, headers={"Authorization": f"Bearer {TOKEN}"})).json()
    mine = {"Authorization": f"Bearer {worker['secret']}"}
    while not stop.is_set():
        claimed = await client.post(f"/v1/workers/{worker['id']}/claim", headers=mine)
        if claimed.status_code == 204:
            await asyncio.sleep(0.2)
            continue
        if claimed.status_code != 200:
            tally.error(f"claim {claimed.status_code}")
            await asyncio.sleep(0.2)
            continue
        claim = claimed.json()
        await asyncio.sleep(0.3)  # "measuring"
        result = {"measurements": [measurement(rng) for _ in claim["proposal"]["configs"]]}
        path = f"/v1/workers/{worker['id']}/trials/{claim['trial_id']}/result"
        reported = await client.post(path, json=result, headers={**mine, "X-Lease-Nonce": claim["lease_nonce"]})
        if reported.status_code == 200:
            tally.reports += 1
        else:
            tally.error(f"result {reported.status_code}")


async def follow(client: httpx.AsyncClient, job_id: str, tally: Tally) -> None:
    seen: list[int] = []
    finished, broken = False, None
    try:
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            if response.status_code != 200:
                broken = f"HTTP {response.status_code}"
            else:
                event = None
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                        finished = finished or event == "done"
                    elif line.startswith("data:") and event == "progress":
                        seen.append(json.loads(line[5:])["progress"]["done"])
                    elif line.startswith("data:") and event == "error":
                        broken = line[5:].strip()
    except (httpx.HTTPError, asyncio.CancelledError) as e:
        if not isinstance(e, asyncio.CancelledError):
            broken = f"{type(e).__name__}: {e}"
    tally.streams.append({"job": job_id, "progress_done": seen, "finished": finished, "broken": broken})


def sample_health(url: str, cpus: list[int], duration_s: float, begin: Any, results: Any) -> None:
    """Ask ``/healthz`` every `HEALTH_EVERY_S` for ``duration_s`` once ``begin`` is set; put the latencies (ms)
    and the count of failures on ``results``.

    A process of its own: inside the load generator's event loop, busy with hundreds of connections, a
    probe's time would include its wait for that loop, the load generator's delay and not the controller's
    (the first version of this benchmark measured exactly that).
    """
    os.sched_setaffinity(0, cpus)
    latencies, failures = [], 0
    with httpx.Client(base_url=url, timeout=10) as client:
        client.get("/healthz")  # connect before the clock runs
        begin.wait()
        end = time.perf_counter() + duration_s
        while (began := time.perf_counter()) < end:
            try:
                ok = client.get("/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append((time.perf_counter() - began) * 1000)
            failures += not ok
            time.sleep(HEALTH_EVERY_S)
    results.put((latencies, failures))


async def run(
    url: str,
    *,
    args: argparse.Namespace,
    queries: list[dict[str, int]],
    check: Callable[[int, bytes], bool],
    begin: Any,
    server_pid: int,
) -> Tally:
    """Open the streams, then set ``begin`` (the health sampler starts) and run the `/v1/best` clients and
    the synthetic workers for ``args.duration``; ``server_pid``'s CPU time is counted over that window."""
    tally, stop = Tally(), asyncio.Event()
    limits = httpx.Limits(max_connections=args.streams + args.workers + 16)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        jobs = []
        for i in range(args.jobs):
            shape = {**SHAPE, "seq": 32 * (i + 1)}
            body = {"shape": shape, "backend": "cpu", "layers": ["qkv_fprop"], "n_trials": args.trials}
            jobs.append((await client.post("/v1/jobs", json=body, headers=auth)).json()["id"])
        streams = [asyncio.create_task(follow(client, jobs[i % len(jobs)], tally)) for i in range(args.streams)]
        await asyncio.sleep(1.0)  # every stream open and waiting before the rest starts
        begin.set()
        workers = [asyncio.create_task(synthetic_worker(client, i, stop, tally)) for i in range(args.workers)]
        # service_load's raw keep-alive clients: httpx would spend more CPU per request than the controller,
        # and the load generator, not the controller, would be what saturates.
        server_cpu = cpu_seconds(server_pid)
        served = best_answers(url)
        # The path too: given the bare controller URL, the clients asked for the dashboard's page (until the
        # answers were checked for content, the benchmark's "/v1/best" figures were the dashboard's).
        tally.best = await closed_loop(
            f"{url}/v1/best",
            queries=queries,
            concurrency=args.clients,
            duration_s=args.duration,
            warmup_s=0.0,
            check=check,
        )
        tally.server_cpu_s = cpu_seconds(server_pid) - server_cpu
        after = best_answers(url)
        tally.served = {source: after.get(source, 0.0) - served.get(source, 0.0) for source in after}
        stop.set()
        await asyncio.gather(*workers)
        await asyncio.wait(streams, timeout=5)  # streams whose job finished have ended; close the rest
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return tally


def right_answer(asked: list[ModelShape]) -> Callable[[int, bytes], bool]:
    """``check`` for `closed_loop`: the answer to query i holds the measured winners of every tunable slot of
    ``asked[i]``, for that shape."""

    def check(i: int, body: bytes) -> bool:
        shape, answer = asked[i], json.loads(body)
        groups = answer.get("results") or []
        fields = ("hidden", "tp", "mbs", "seq")
        return (
            answer.get("measured") is True
            and len(groups) == 1
            and all(groups[0]["shape"].get(k) == getattr(shape, k) for k in fields)
            and {layer["slot"] for layer in groups[0]["layers"]} == {s.value for s in tunable_slots(shape)}
        )

    return check


def best_answers(url: str) -> dict[str, float]:
    """The controller's count of ``/v1/best`` answers by where they came from (``/metrics``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    prefix = "autotune_best_answers_total{source="
    return {
        line[len(prefix) + 1 : line.index('"}')]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def percentiles(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "n": len(ordered),
        "p50_ms": at(0.5),
        "p99_ms": at(0.99),
        "max_ms": round(ordered[-1], 2),
        "mean_ms": round(statistics.fmean(ordered), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--clients", type=int, default=64, help="Closed-loop clients reading /v1/best")
    parser.add_argument("--jobs", type=int, default=50, help="Jobs the streams follow (streams spread evenly)")
    parser.add_argument("--trials", type=int, default=8, help="Trials per job (one slot)")
    parser.add_argument("--workers", type=int, default=8, help="Synthetic workers driving the jobs")
    parser.add_argument("--shapes", type=int, default=200, help="Shapes seeded for /v1/best")
    parser.add_argument("--best-cache-s", type=float, default=0.0, help="The controller's /v1/best cache (0: off)")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.best_cache_s < 0:
        parser.error(f"--best-cache-s must be at least 0 (got {args.best_cache_s})")
    for name in ("streams", "clients", "jobs", "trials", "workers", "shapes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    asked = shapes(args.shapes)
    queries = [query(s) for s in asked]
    load_average = os.getloadavg()
    plan = plan_cpus(server_workers=1, load_procs=1)
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{Path(tmp) / 'bench.db'}"
        seed_best_configs(db_url, asked)
        env = {
            **os.environ,
            "AUTOTUNE_DB_URL": db_url,
            "AUTOTUNE_TOKEN": TOKEN,
            "XDG_DATA_HOME": tmp,
            "AUTOTUNE_DEFAULT_BACKEND": "cpu",
            "AUTOTUNE_BEST_CACHE_S": str(args.best_cache_s),
        }
        proc, url = serve("api.main:app_from_env", env=env, workers=1, cpus=plan.server)
        context = multiprocessing.get_context("spawn")
        begin, results = context.Event(), context.Queue()
        sampler = context.Process(target=sample_health, args=(url, plan.load, args.duration, begin, results))
        try:
            sampler.start()
            os.sched_setaffinity(0, plan.load)
            check = right_answer(asked)
            tally = asyncio.run(run(url, args=args, queries=queries, check=check, begin=begin, server_pid=proc.pid))
            health_ms, health_failures = results.get(timeout=args.duration + 60)  # before join: a full pipe blocks
            sampler.join()
        finally:
            sampler.kill()
            proc.terminate()
            proc.wait()

    health = percentiles(health_ms)
    best = percentiles([1000 * x for x in tally.best.latencies])
    elapsed = tally.best.wall_s
    heard = [s for s in tally.streams if len(set(s["progress_done"])) >= 2 and not s["broken"]]
    broken = [s for s in tally.streams if s["broken"]]
    errors = sum(tally.errors.values()) + len(broken) + health_failures + tally.best.errors + tally.best.wrong
    answered = sum(tally.served.values())
    report = {
        "benchmark": "event-stream flood: open /v1/jobs/{id}/events streams plus closed-loop /v1/best clients, /healthz sampled, one controller on loopback",
        "environment": environment(),
        "machine": machine(load_average, plan, ("fastapi", "uvicorn", "sqlalchemy")),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"health_every_s": HEALTH_EVERY_S},
        "elapsed_s": round(elapsed, 2),
        "healthz": health,
        "best": best
        | {
            "rps": round(best["n"] / elapsed, 1),
            "wrong_answers": tally.best.wrong,
            "served": tally.served,
            "cache_hit_fraction": round((answered - tally.served.get("computed", 0.0)) / answered, 4)
            if answered
            else None,
        },
        "jobs_followed": len({s["job"] for s in tally.streams}),
        "streams": {
            "opened": args.streams,
            "heard_progress": len(heard),
            "saw_done": sum(s["finished"] for s in tally.streams),
            "broken": len(broken),
            "broken_examples": [s["broken"] for s in broken[:5]],
        },
        "worker_reports": tally.reports,
        "cpu_use": {
            "server_busy": round(tally.server_cpu_s / elapsed, 3),
            "load_busy": round(tally.best.cpu_s / elapsed, 3),
        },
        "cpu_use_note": "CPU seconds per second during the run: the controller (near 1.0: it is the limit), "
        "the load process (streams, workers and /v1/best clients; the health sampler is a process apart)",
        "errors": tally.errors
        | ({"streams": len(broken)} if broken else {})
        | ({"healthz": health_failures} if health_failures else {})
        | ({"best": tally.best.errors} if tally.best.errors else {})
        | ({"best_wrong_answers": tally.best.wrong} if tally.best.wrong else {}),
        "targets": {"healthz_p99_ms": TARGET_HEALTH_P99_MS, "errors": 0, "streams_heard_progress": args.streams},
        "meets_targets": health.get("p99_ms", float("inf")) <= TARGET_HEALTH_P99_MS
        and errors == 0
        and len(heard) == args.streams,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
