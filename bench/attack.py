"""The attack of issue 29, re-run against one controller: huge and slow bodies with and without a token, the
impossible shape, the lying results, and a revocation, while ``/healthz`` is sampled from a process of its own.

    python bench/attack.py --out bench/results/attack_cpu.json
    python bench/attack.py --db postgresql+psycopg://postgres@127.0.0.1:5432/test --duration 10

The controller is ``uvicorn --factory api.main:app_from_env`` (one process, its scheduler on) with a clients'
token, a worker token and an admin token, on a fresh SQLite file (or ``--db``).  First ``/healthz`` is
sampled for ``--quiet`` seconds with nothing else running (the reference), then for ``--duration`` seconds
while ``--senders`` threads post 12 MB bodies (with the clients' token, without one, and chunked at a
crawl), and the main thread sends, once each: the 11.9 MB body of 1,000,000 unknown keys, a 20,000-key
body under the limit, the impossible shape, a shape within the caps that no GPU holds, each lying result,
a genuine result, and a revocation of the lying worker.  Each answer's status, size and time are recorded.
Targets: every huge body a 413, every bad input a 422 naming its field, ``/healthz`` p99 under 1 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment
from bench.service_load import TOKEN, serve
from bench.stream_load import sample_health
from overlap_runtime.measurement import Baselines, BaselineSource, Measurement
from overlap_runtime.shape import Collective
from overlap_runtime.uncertainty import Series

WORKER_TOKEN = "bench-worker"
ADMIN_TOKEN = "bench-admin"
HUGE = b'{"shape": {"hidden": 64, "tp": 2, "seq": 32}, "pad": "' + b"x" * (12 << 20) + b'"}'
TARGET_HEALTH_P99_MS = 1000.0
SHAPE = {"hidden": 64, "tp": 2, "seq": 32}
IMPOSSIBLE = {"hidden": 1048576, "tp": 1024, "seq": 16777216, "mbs": 65536}
TOO_BIG = {"hidden": 131072, "tp": 2, "seq": 4194304}


def measured(overlap: list[float], gemm: list[float], comm: list[float], serial: list[float]) -> dict[str, Any]:
    """What a worker sends for these repeats (`Measurement.measured`, as `to_dict` writes it)."""
    series = [Series(samples=s) for s in (gemm, comm, serial)]
    baselines = Baselines(
        source=BaselineSource.CACHED, collective=Collective.ALL_GATHER, gemm=series[0], comm=series[1], serial=series[2]
    )
    return Measurement.measured(
        overlap=Series(samples=overlap), baselines=baselines, rel_err=0.001, valid=True
    ).to_dict()


GENUINE = measured([0.2801, 0.2794, 0.2787], [0.2676, 0.2671, 0.2680], [0.0924, 0.0930, 0.0921], [0.36, 0.361, 0.359])


def lies() -> dict[str, dict[str, Any]]:
    """Each lie of issue 29 that was stored as complete."""
    gemm = GENUINE["baselines"]["gemm"]
    return {
        "cv 1000": {**GENUINE, "cv": 1000.0},
        "baseline samples -100": {
            **GENUINE,
            "baselines": {**GENUINE["baselines"], "gemm": {**gemm, "samples": [-100.0, 0.2671, 0.268]}},
        },
        "baseline samples 1e-9": {
            **GENUINE,
            "baselines": {**GENUINE["baselines"], "gemm": {**gemm, "samples": [1e-9] * 3}},
        },
        "serial_ms below gemm_ms": {**GENUINE, "serial_ms": 0.1},
        "rel_err 1e9 with valid true": {**GENUINE, "rel_err": 1e9},
        "samples 1000x below overlap_ms": {**GENUINE, "samples": [x / 1000 for x in GENUINE["samples"]]},
        "hidden_ci [5, 9]": {**GENUINE, "hidden_ci": [5.0, 9.0]},
        "repeats 0": {**GENUINE, "repeats": 0},
        "overlap 0.001 ms against a 2 ms GEMM": measured([0.001] * 3, [2.0] * 3, [0.5] * 3, [2.5] * 3),
    }


def crawl(size: int) -> Iterator[bytes]:
    """A chunked body of ``size`` bytes, 64 KiB at a time with a pause: a slow sender."""
    for _ in range(size // (1 << 16)):
        yield b" " * (1 << 16)
        time.sleep(0.01)


def flood(url: str, stop: threading.Event, answers: list[int]) -> None:
    """12 MB bodies, with the clients' token, without, and chunked at a crawl, until ``stop``."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            for headers in ({"Authorization": f"Bearer {TOKEN}"}, {}):
                answers.append(client.post("/v1/jobs", content=HUGE, headers=headers).status_code)
            answers.append(client.post("/v1/jobs", content=crawl(2 << 20)).status_code)


def timed(call: Any) -> dict[str, Any]:
    began = time.perf_counter()
    response: httpx.Response = call()
    record: dict[str, Any] = {
        "status": response.status_code,
        "ms": round((time.perf_counter() - began) * 1000, 1),
        "bytes": len(response.content),
    }
    if response.is_error:
        detail = response.json()["detail"]
        record["fields"] = sorted({item["field"] for item in detail})[:8]
        record["first_rule"] = detail[0]["rule"][:160]
    return record


def attack(url: str) -> dict[str, Any]:
    """Every request of the attack once, each answer's status, time and size."""
    out: dict[str, Any] = {}
    clients = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        keys = b"{" + b",".join(b'"k%d":0' % i for i in range(1_000_000)) + b"}"
        out["million_keys_11.9MB"] = timed(
            lambda: http.post("/v1/jobs", content=keys, headers={**clients, "Content-Type": "application/json"})
        )
        many = {f"k{i}": 0 for i in range(20_000)}
        out["20k_keys_under_limit"] = timed(lambda: http.post("/v1/jobs", json=many, headers=clients))
        out["impossible_shape"] = timed(lambda: http.post("/v1/jobs", json={"shape": IMPOSSIBLE}, headers=clients))
        out["shape_no_gpu_holds"] = timed(lambda: http.post("/v1/jobs", json={"shape": TOO_BIG}, headers=clients))

        registration = {"name": "liar", "host": "bench", "backend": "cpu"}
        worker = http.post("/v1/workers", json=registration, headers={"Authorization": f"Bearer {WORKER_TOKEN}"})
        worker.raise_for_status()
        liar = worker.json()
        mine = {"Authorization": f"Bearer {liar['secret']}"}
        job = {"shape": SHAPE, "layers": ["qkv_fprop"], "n_trials": 2, "backend": "cpu"}
        http.post("/v1/jobs", json=job, headers=clients).raise_for_status()
        claim = None
        deadline = time.monotonic() + 60
        while claim is None and time.monotonic() < deadline:
            got = http.post(f"/v1/workers/{liar['id']}/claim", headers=mine)
            claim = got.json() if got.status_code == 200 else None
            time.sleep(0.2)
        if claim is None:
            raise RuntimeError("the lying worker got no trial within 60 s")
        n = len(claim["proposal"]["configs"])
        result = f"/v1/workers/{liar['id']}/trials/{claim['trial_id']}/result"
        lease = {**mine, "X-Lease-Nonce": claim["lease_nonce"]}
        out["lies"] = {
            name: timed(lambda lie=lie: http.post(result, json={"measurements": [lie] * n}, headers=lease))
            for name, lie in lies().items()
        }
        out["genuine_result"] = timed(lambda: http.post(result, json={"measurements": [GENUINE] * n}, headers=lease))
        revoke = f"/v1/workers/{liar['id']}"
        out["revoke_with_clients_token"] = timed(lambda: http.delete(revoke, headers=clients))
        out["revoke_with_admin_token"] = timed(
            lambda: http.delete(revoke, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        )
        out["revoked_heartbeat"] = timed(lambda: http.post(f"/v1/workers/{liar['id']}/heartbeat", headers=mine))
    return out


def health(url: str, cpus: list[int], duration_s: float, during: Any = None) -> dict[str, Any]:
    """``/healthz`` sampled from a process of its own for ``duration_s`` while ``during()`` runs here."""
    context = multiprocessing.get_context("spawn")
    begin, results = context.Event(), context.Queue()
    sampler = context.Process(target=sample_health, args=(url, cpus, duration_s, begin, results))
    sampler.start()
    begin.set()
    extra = during() if during is not None else None
    latencies, failures = results.get(timeout=duration_s + 120)
    sampler.join()
    ordered = sorted(latencies)
    summary = {
        "samples": len(ordered),
        "failures": failures,
        "median_ms": round(statistics.median(ordered), 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "max_ms": round(ordered[-1], 1),
    }
    return {"healthz": summary, **({"requests": extra} if extra is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--quiet", type=float, default=5.0, help="seconds of /healthz with nothing else running")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of /healthz under attack")
    parser.add_argument("--senders", type=int, default=3, help="threads posting 12 MB bodies")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "AUTOTUNE_DB_URL": args.db or f"sqlite:///{Path(tmp) / 'attack.db'}",
            "AUTOTUNE_TOKEN": TOKEN,
            "AUTOTUNE_WORKER_TOKEN": WORKER_TOKEN,
            "AUTOTUNE_ADMIN_TOKEN": ADMIN_TOKEN,
            "AUTOTUNE_DEFAULT_BACKEND": "cpu",
            "XDG_DATA_HOME": tmp,
        }
        proc, url = serve("api.main:app_from_env", env=env, workers=1, cpus=cpus)
        try:
            quiet = health(url, cpus, args.quiet)
            stop, answers = threading.Event(), list[int]()
            senders = [threading.Thread(target=flood, args=(url, stop, answers)) for _ in range(args.senders)]

            def under_attack() -> dict[str, Any]:
                for sender in senders:
                    sender.start()
                return attack(url)

            loud = health(url, cpus, args.duration, during=under_attack)
            stop.set()
            for sender in senders:
                sender.join()
        finally:
            proc.terminate()
            proc.wait(30)
    huge = {str(code): answers.count(code) for code in sorted(set(answers))}
    requests = loud.pop("requests")
    lies_refused = all(r["status"] == 422 for r in requests["lies"].values())
    report = {
        "benchmark": "attack",
        "database": "postgresql" if args.db else "sqlite",
        "quiet": quiet,
        "under_attack": {**loud, "senders": args.senders, "huge_bodies": huge},
        "requests": requests,
        "passed": {
            "huge_bodies_all_413": set(huge) == {"413"},
            "bad_input_all_422": lies_refused
            and all(
                requests[k]["status"] == 422 for k in ("20k_keys_under_limit", "impossible_shape", "shape_no_gpu_holds")
            ),
            "genuine_result_lands": requests["genuine_result"]["status"] == 200,
            "revoked": requests["revoke_with_admin_token"]["status"] == 200
            and requests["revoked_heartbeat"]["status"] == 401,
            f"healthz_p99_under_{TARGET_HEALTH_P99_MS:g}_ms": loud["healthz"]["p99_ms"] <= TARGET_HEALTH_P99_MS,
        },
        "machine": {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before]},
        "environment": environment(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
