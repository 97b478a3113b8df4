"""Record a slot's landscape: every legal config of its search space, measured on the GPUs, with repeats.

    python bench/record_landscape.py --shape h8192_s8192 --slot qkv_fprop --out bench/landscapes/
    python bench/record_landscape.py --shape h4096_s4096 --slot proj_fprop --backend cpu --hidden-scale 64  # tiny, CPU

One JSON file per (shape, slot): the environment, the shape, the slot, the device limits and, per config,
its measurement with every repeat's time (``samples``) or the failure that it caused.  The replay backend
answers trials from these files, so search strategies are compared on the CPU against real GPU data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment
from bench.overlap_bench import ANCHORS
from overlap_runtime.errors import TrialFailure
from overlap_runtime.measurement import BaselineSource
from overlap_runtime.runtime import Runtime
from overlap_runtime.shape import ModelShape, Slot
from search_spaces.space import slot_space


def record(rt: Runtime, shape: ModelShape, slot: Slot, *, repeats: int) -> dict:
    space = slot_space(shape, slot, backend=rt.backend, limits=rt.limits)
    rows = []
    for config in space.configs():
        try:
            # Scored as search trials are (the tuner replays these as its trials): against cached baselines.
            m = rt.measure(shape, slot, config, repeats=repeats, warmup=3, baselines=BaselineSource.CACHED)
            rows.append({"config": config.to_dict(), "measurement": m.to_dict()})
        except TrialFailure as e:
            rows.append({"config": config.to_dict(), "error": e.reason})
    limits = rt.limits
    return {
        "environment": environment(),
        "shape": shape.to_dict(),
        "slot": slot.value,
        "backend": rt.backend,
        "limits": None if limits is None else {"sm_count": limits.sm_count, "priority_range": limits.priority_range},
        "repeats": repeats,
        "configs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", required=True, choices=sorted(ANCHORS))
    parser.add_argument("--slot", action="append", required=True, choices=[s.value for s in Slot])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hidden-scale", type=int, default=1, help="divide hidden, ffn and seq (CPU dry runs)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench/landscapes"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with Runtime(tp=args.tp, backend=args.backend, trial_timeout_s=60) as rt:
        for name in args.shape:
            dims = {k: v // args.hidden_scale for k, v in ANCHORS[name].items()}
            shape = ModelShape(tp=args.tp, mbs=1, **dims)
            for slot in args.slot:
                started = time.time()
                landscape = record(rt, shape, Slot(slot), repeats=args.repeats)
                path = args.out / f"{name}_tp{args.tp}_{slot}_{args.backend}.json"
                path.write_text(json.dumps(landscape))
                valid = [r for r in landscape["configs"] if r.get("measurement", {}).get("valid")]
                best = min(valid, key=lambda r: r["measurement"]["overlap_ms"])
                print(
                    f"{name} {slot}: {len(landscape['configs'])} configs in {time.time() - started:.0f} s, "
                    f"best {best['measurement']['overlap_ms']:.3f} ms {best['config']} -> {path}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
