"""The README's result sections, generated from the committed results so that no figure is typed by hand.

    python bench/readme_tables.py           # rewrite the generated sections of README.md
    python bench/readme_tables.py --check   # exit 1 when they are out of date

Each section sits between ``<!-- readme_tables: NAME -->`` and ``<!-- /readme_tables: NAME -->`` and is
written here from files under ``bench/results`` (`SECTIONS`).  Every figure in it is a `Claim`: the text
printed, the file and the JSON pointer (RFC 6901) of the value it prints, or for a transcript the pattern
it is read with; whole files shown verbatim (the tune transcript, the preset) are claims too.
``tests/test_readme.py`` re-reads every number of every generated section from the README, outside code
spans and quoted files, and checks each against the value its claim points to in the committed file.

Each section also says how old its results are against the code they describe (`age`): the commit a result
records (``environment.commit`` and the like, `bench.environment`; a ``commit=HASH`` line in a transcript),
or for an older file that records none the commit that last wrote it, and the first later commit that
changed that code.  The tune transcript stands for its preset too: one run wrote both.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = "bench/results"
RUNTIME = ("overlap_runtime/",)
KERNELS = (
    "overlap_runtime/gemm.py",
    "overlap_runtime/ring_gemm.py",
    "overlap_runtime/ring_gluon.py",
    "overlap_runtime/flag_kernels.py",
)
"""What the GEMM and ring benchmarks time: the rest of the runtime (process groups, methods) never runs in them."""
TUNER = ("overlap_runtime/", "search_spaces/", "autotune/")
SEARCH = ("autotune/", "search_spaces/", "bench/search_efficiency.py", "bench/cost_model.py", "bench/landscapes/")
SERVICE = ("api/", "storage/", "bench/service_load.py")
START, END = "<!-- readme_tables: {} -->", "<!-- /readme_tables: {} -->"
TRANSCRIPT_COMMIT = re.compile(r"^commit=([0-9a-f]{7,40})$", re.M)
WIDTH = 110
NBSP = "\u00a0"


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """One figure of a generated section and where it comes from."""

    text: str
    """As printed: a number (``0.723``, ``92.9%``, ``1.10x``), a version or a whole quoted file."""
    file: str
    """Repository path of the committed result."""
    pointer: str = ""
    """JSON pointer to the value; for a text file, a regex whose group 1 is the value; "" for the whole file."""
    kind: str = "value"
    """"value" (a number, printed at the precision shown), "count" (the length of a list), "text" (a string
    that contains the printed text), "match" (the regex's group in a text file), "file" (verbatim)."""


@dataclass(kw_only=True)
class Writer:
    """Builds one section's text and its claims together, so that no number goes in without its source."""

    parts: list[str] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)

    def text(self, *pieces: str) -> Writer:
        self.parts.extend(pieces)
        return self

    def para(self, *pieces: str) -> Writer:
        """A paragraph of prose, wrapped like the rest of the README (code spans are never split)."""
        text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", NBSP), "".join(pieces).strip())
        wrapped = textwrap.fill(text, width=WIDTH, break_long_words=False, break_on_hyphens=False)
        return self.text(wrapped.replace(NBSP, " ") + "\n")

    def value(self, file: str, pointer: str, fmt: str = "", *, kind: str = "value") -> str:
        """The value at ``pointer`` in ``file``, printed: ``fmt`` (`render`) for a number, its length for a
        ``kind`` "count", itself for a "text"."""
        value = resolve(load(file), pointer)
        if kind == "count":
            shown = str(len(value))
        elif kind == "text":
            shown = str(value)
        else:
            shown = render(value, fmt)
        self.claims.append(Claim(text=shown, file=file, pointer=pointer, kind=kind))
        return shown

    def match(self, file: str, pattern: str) -> str:
        found = re.search(pattern, (REPO / file).read_text(encoding="utf-8"))
        if found is None:
            raise ValueError(f"{file} holds nothing matching {pattern!r}")
        self.claims.append(Claim(text=found.group(1), file=file, pointer=pattern, kind="match"))
        return found.group(1)

    def verbatim(self, file: str, language: str) -> Writer:
        content = (REPO / file).read_text(encoding="utf-8")
        self.claims.append(Claim(text=content, file=file, kind="file"))
        return self.text(f"```{language}\n{content}{'' if content.endswith(chr(10)) else chr(10)}```\n")

    def done(self) -> tuple[str, list[Claim]]:
        return "".join(self.parts), self.claims


def render(value: float, fmt: str) -> str:
    """``fmt`` is digits then "f" (ms), "%" (a fraction shown as a percentage) or "x" (a ratio)."""
    digits, style = int(fmt[:-1]), fmt[-1]
    if style == "%":
        return f"{100 * value:.{digits}f}%"
    return f"{value:.{digits}f}" + ("x" if style == "x" else "")


@cache
def load(file: str) -> Any:
    """A committed result, read once per process (the sections quote some files a hundred times)."""
    return json.loads((REPO / file).read_text(encoding="utf-8"))


def resolve(data: Any, pointer: str) -> Any:
    """The value at a JSON pointer (``/records/3/best/overlap_ms``)."""
    for token in pointer.split("/")[1:]:
        key = token.replace("~1", "/").replace("~0", "~")
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


# --- how old a result is ------------------------------------------------------------------------------------


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


def recorded_commit(file: str) -> str | None:
    """The commit a result says produced it: `bench.environment`'s field of a JSON result (wherever the
    benchmark keeps it), a line ``commit=HASH`` in a transcript."""
    if not file.endswith(".json"):
        found = TRANSCRIPT_COMMIT.search((REPO / file).read_text(encoding="utf-8"))
        return found.group(1) if found else None
    data = load(file)
    for key in ("environment", "env", "source"):
        commit = data.get(key, {}).get("commit") if isinstance(data.get(key), dict) else None
        if commit:
            return str(commit)
    return None


def age(file: str, code: Sequence[str]) -> str:
    """One sentence: the commit ``file`` is from and whether ``code`` changed after it."""
    paths = ", ".join(f"`{p}`" for p in code)
    since = recorded_commit(file)
    if since is None:
        since = git("log", "-1", "--format=%H", "--", file)
        start = f"Undated: `{Path(file).name}` records no commit; last written in `{since[:7]}`"
    else:
        start = f"Measured at commit `{since[:7]}`"
        try:
            git("cat-file", "-e", f"{since}^{{commit}}")
        except subprocess.CalledProcessError:
            return f"{start}, which is not in this repository's history."
    # By content, not by commits: a change that was reverted leaves the code as it was measured.
    if not git("diff", "--name-only", since, "HEAD", "--", *code).split():
        return f"{start}; {paths} have not changed since."
    return f"{start}, before later changes to {paths} (from `{first_lasting_change(since, code)[:7]}` on)."


def first_lasting_change(since: str, code: Sequence[str]) -> str:
    """The first commit after ``since`` from which ``code`` differs from ``since``'s all the way to HEAD: a change
    and its revert before it do not count."""
    first = ""
    for commit in git("rev-list", "--reverse", "--topo-order", f"{since}..HEAD", "--", *code).split():
        differs = bool(git("diff", "--name-only", since, commit, "--", *code).split())
        first = (first or commit) if differs else ""
    return first


# --- the sections ---------------------------------------------------------------------------------------------

OVERLAP = f"{RESULTS}/overlap_h200_tp2.json"
GEMM = f"{RESULTS}/gemm_h200.json"
GEMM_FP8 = f"{RESULTS}/gemm_fp8_h200.json"
RING = f"{RESULTS}/ring_h200.json"
GLUON = f"{RESULTS}/gluon_ring_h100.json"
TUNE = f"{RESULTS}/tune_h200_h8192_s8192_tp2.txt"
PRESET = f"{RESULTS}/presets/ub_cfg_h200_bf16_h8192_tp2_mbs1_seqlen8192.yaml"
SEARCH_RESULT = f"{RESULTS}/search_efficiency.json"
SERVICE_RESULT = f"{RESULTS}/service_load.json"
TABLE_SHAPE = "h8192_s8192"
TUNE_WALL_S = r"tune_wall_s=(\d+)"


def tuned() -> tuple[str, list[Claim]]:
    w = Writer()
    w.para(
        "`autotune tune --hidden 8192 --tp 2 --seq 8192 --ffn-hidden 28672 --backend cuda` tuned all ten slots on ",
        f"the H200 pair in {w.match(TUNE, TUNE_WALL_S)} s (default budget, early stopping, interleaved ",
        f'finalists), printing (`{TUNE}`; "vs TE" is the gain over TE\'s default config measured in the same run, ',
        "i.e. TE's default knobs run by our runtime, not TE itself; \"hidden\" the share of NCCL's comm time ",
        f"hidden). {age(TUNE, TUNER)}",
    ).text("\n")
    w.verbatim(TUNE, "text").text("\n").para(f"and writing `{PRESET}`:").text("\n")
    return w.verbatim(PRESET, "yaml").done()


def measured() -> tuple[str, list[Claim]]:
    data, w = load(OVERLAP), Writer()
    env = "/environment"
    w.para(
        f"`bash bench/gpu_session.sh OUT` on the lent H200 pair (driver {w.value(OVERLAP, f'{env}/driver', kind='text')}, ",
        f"torch {w.value(OVERLAP, f'{env}/torch', kind='text')}, NCCL {w.value(OVERLAP, f'{env}/nccl', kind='text')}, ",
        f"Triton {w.value(OVERLAP, f'{env}/triton', kind='text')}); full data in `{OVERLAP}`. {age(OVERLAP, RUNTIME)} ",
        "Best config of a small grid per slot at `h8192_tp2_mbs1_seqlen8192`, ms:",
    )
    w.text(
        "\n| slot | gemm | comm | serial | PyTorch fused async-TP | ours | comm hidden |\n",
        "|---|---|---|---|---|---|---|\n",
    )
    for i, record in enumerate(data["records"]):
        if record["shape"] != TABLE_SHAPE:
            continue
        at = f"/records/{i}"
        cells = [w.value(OVERLAP, f"{at}/{key}", "3f") for key in ("gemm_ms", "comm_ms", "serial_ms")]
        cells.append(w.value(OVERLAP, f"{at}/torch_fused/ms", "3f") if "torch_fused" in record else "—")
        cells += [w.value(OVERLAP, f"{at}/best/overlap_ms", "3f"), w.value(OVERLAP, f"{at}/best/hidden_frac", "0%")]
        w.text(f"| {record['slot']} | {' | '.join(cells)} |\n")
    s = "/summary"
    worst = min(range(len(data["records"])), key=lambda i: _hidden(data["records"][i]))
    slowest, config = _slowest_vs_serial(data["records"])
    slower = data["summary"]["slower_than_serial"]
    w.text("\n").para(
        f"Over all {w.value(OVERLAP, f'{s}/slots', '0f')} slots of the five anchor shapes the grid's best hides ",
        f"{w.value(OVERLAP, f'{s}/hidden_median', '1%')} of the communication at the median and ",
        f"{w.value(OVERLAP, f'{s}/hidden_worst', '0%')} at the worst (`{data['records'][worst]['shape']} ",
        f"{data['records'][worst]['slot']}`: a {w.value(OVERLAP, f'/records/{worst}/gemm_ms', '3f')} ms GEMM beside ",
        f"{w.value(OVERLAP, f'/records/{worst}/comm_ms', '3f')} ms of communication), ",
        "is never slower than serial, " if not slower else f"is slower than serial on {len(slower)} of them, ",
        f"is {w.value(OVERLAP, f'{s}/speedup_vs_torch_fused_median', '2x')} faster than PyTorch's fused ops at the ",
        "median (with a GEMM as fast as cuBLAS at most ",
        f"{w.value(OVERLAP, f'{s}/speedup_vs_torch_fused_ceiling_median', '2x')} is possible: PyTorch's fused time ",
        "over the GEMM alone), and re-measures the same config within ",
        f"{w.value(OVERLAP, f'{s}/repeat_diff_median', '2%')} at the median. The slowest valid grid config takes ",
        f"{w.value(OVERLAP, f'{slowest}/overlap_ms', '3f')} ms where serial takes ",
        f"{w.value(OVERLAP, slowest.rsplit('/configs', 1)[0] + '/serial_ms', '3f')} ms (`{json.dumps(config)}`). ",
        "The GEMM and collective baselines behind `hidden` are timed once per problem, beside the first config of ",
        "the grid rather than beside the winner, so their drift between runs moves `hidden` by several points.",
    )
    above = [r for r in data["records"] if r["best"]["hidden_frac"] > 1]
    if above and not any("gemm_ours" in (r["best"].get("baselines") or {}) for r in data["records"]):
        ours = all(r["best"]["config"].get("gemm") == "triton" for r in above)
        w.para(
            "These shares are scored against cuBLAS alone: the file predates `gemm_ms` as the faster of cuBLAS and ",
            'our GEMM (docs/measurement.md, "The share hidden and its interval"). The shares above all of the ',
            "communication (" + ("every one a winner on our GEMM" if ours else "some of them winners on our GEMM"),
            ") count our GEMM's speed over cuBLAS as communication hidden, and other winners on our GEMM may too.",
        )
    _kernels(w.text("\n"))
    return w.done()


KERNEL_TARGETS = (
    ("our GEMM, median speed", "ours_vs_library_median", "\u2265"),
    ("our GEMM, worst layer shape", "ours_vs_library_min", "\u2265"),
    ("fused ring, median time", "fused_vs_library_median", "\u2264"),
    ("fused ring, worst case", "fused_vs_library_max", "\u2264"),
)
"""Rows of the kernels' table: label, key of `gemm_bench.summarize`'s summary, how the target compares."""


def _kernels(w: Writer) -> None:
    """Our GEMM and the fused ring kernels on one H200 against issue 33's targets, at BF16 and FP8, and what
    the fused kernels cost beside our GEMM (`RING`)."""
    files = {"BF16 (cuBLAS)": GEMM, "FP8 (`torch._scaled_mm`)": GEMM_FP8}
    w.para(
        "Our Triton GEMM and the fused ring kernels on one H200 (`bash bench/gpu_single.sh OUT`: ",
        f"`python bench/gemm_bench.py [--dtype fp8]`, `{GEMM}`, `{GEMM_FP8}`), over the ",
        f"{w.value(GEMM, '/shapes', kind='count')} distinct layer GEMMs (one square among them, left out of the ",
        "figures) of the five anchor shapes and three small models at `tp=2`, and their ",
        f"{w.value(GEMM, '/ring/rows', kind='count')} coupled slots. Speed is the library's time over ours; the ",
        "fused rings run with every flag already set, as dispatched (the kernel, or the plain ring where ",
        f"`ring_gemm.fused_pays` says the kernel loses). {age(GEMM, KERNELS)}",
    )
    w.text("\n| | " + " | ".join(files) + " | target |\n|---|---|---|---|\n")
    for label, key, sign in KERNEL_TARGETS:
        cells = []
        for file in files.values():
            summary = load(file)["summary"]
            cell = w.value(file, f"/summary/{key}", "3f")
            if key == "ours_vs_library_min":
                worst = min(
                    (r for r in load(file)["shapes"] if r["ratio"] and r["labels"] != ["square 8192^3"]),
                    key=lambda r: r["ratio"],
                )
                cell += f" (`{worst['labels'][0]}`)"
            elif key == "fused_vs_library_max":
                cell += f" (`{load(file)['ring']['summary']['fused_worst_case'].replace('/', ' ')}`)"
            cells.append(cell + ("" if summary["targets_met"][key] else " **missed**"))
        target = w.value(GEMM, f"/summary/targets/{key}", "2f")
        w.text(f"| {label} | {' | '.join(cells)} | {sign} {target} |\n")
    rows = load(RING)["rows"]
    rs = sorted((i for i, r in enumerate(rows) if r["slot"] == "proj_fprop"), key=lambda i: rows[i]["kernel_vs_matmul"])
    w.text("\n").para(
        "Missed: our GEMM's worst shapes are those whose 128x256 or 128x128 tiles leave SMs idle in a part-empty ",
        "last round (at h5120 s2048 proj_dgrad, a second round that keeps most SMs idle), where cuBLAS has tilings that Triton's ",
        "power-of-two blocks cannot express; BF16 is just under parity at the median. The fused ring's worst cases ",
        "are the reduce-scatters of proj_fprop, whose short K loop (K = hidden / TP) leaves the epilogue exposed: ",
        "staging our partials for the copy engine and adding the ones received. Alone with every flag set, the ",
        f"kernels take {w.value(RING, '/summary/kernel_vs_matmul_median', '3x')} our GEMM's time at the median ",
        f"and {w.value(RING, f'/rows/{rs[0]}/kernel_vs_matmul', '2x')}-",
        f"{w.value(RING, f'/rows/{rs[-1]}/kernel_vs_matmul', '2x')} on proj_fprop at BF16 ",
        f"(`python bench/ring_bench.py`, `{RING}`). {age(RING, KERNELS)}",
    )
    _gluon(w)


def _gluon(w: Writer) -> None:
    """The Gluon scatter kernel beside the Triton one on the fused ring's worst case (`GLUON`)."""
    rows = load(GLUON)["timings"]
    at = {r["dtype"]: i for i, r in enumerate(rows) if (r["shape"], r["slot"]) == ("h2048_s8192", "proj_fprop")}
    cells = {
        dtype: (w.value(GLUON, f"/timings/{i}/vs_library/gluon", "3x"), w.value(GLUON, f"/timings/{i}/vs_library/triton", "3x"))
        for dtype, i in at.items()
    }  # fmt: skip
    w.text("\n").para(
        "On Hopper, the reduce-scatters with a short K loop now run a Gluon port of the scatter kernel ",
        "(`overlap_runtime/ring_gluon.py`, dispatched by `ring_gemm.gluon_plan`), which reads the received partials ",
        "under the MMAs; the H200 figures above predate it. On one H100 with every flag set (`python ",
        f"bench/gluon_ring_check.py`, `{GLUON}`), it took `h2048_s8192 proj_fprop` to {cells['bf16'][0]} the ",
        f"library's time where the Triton kernel took {cells['bf16'][1]} at BF16, and to {cells['fp8'][0]} where it ",
        f"took {cells['fp8'][1]} at FP8; all {w.value(GLUON, '/checks', kind='count')} of its GPU checks passed, ",
        f"late flags included. {age(GLUON, KERNELS)}",
    )


def _hidden(record: Mapping[str, Any]) -> float:
    """The benchmark's own score (`bench.overlap_bench.summarize`): the record's baselines, not the config's."""
    return 1 - (record["best"]["overlap_ms"] - record["gemm_ms"]) / record["comm_ms"]


def _slowest_vs_serial(records: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The pointer to the valid grid config with the largest overlap / serial time, and its config."""
    found = [
        (row["overlap_ms"] / r["serial_ms"], f"/records/{i}/configs/{j}", row["config"])
        for i, r in enumerate(records)
        for j, row in enumerate(r["configs"])
        if row.get("valid")
    ]
    _, pointer, config = max(found, key=lambda f: f[0])
    return pointer, config


STRATEGY_NAMES = {
    "tuner": "tuner",
    "random": "random search",
    "random_baselines": "random search after the tuner's baselines",
}


def search() -> tuple[str, list[Claim]]:
    data, w = load(SEARCH_RESULT), Writer()
    f = SEARCH_RESULT
    out = data["cost_model_fit"]["leave_one_out"]
    rhos = sorted(range(len(out)), key=lambda i: out[i]["spearman"])
    errs = sorted(range(len(out)), key=lambda i: out[i]["median_rel_err"])
    held = sorted({row["shape"] for row in data["sets"]["held_out"]["landscapes"]})
    w.para(
        f"Replaying landscapes on the CPU (`python bench/search_efficiency.py`, `{f}`), {w.value(f, '/seeds', '0f')} ",
        f"seeds per landscape. {age(f, SEARCH)} The tuning set is the ",
        f"{w.value(f, '/sets/tuning/landscapes', kind='count')} landscapes recorded on the H200 pair (every legal ",
        "config of qkv_fprop and proj_fprop at three shapes): the tuner's heuristics were chosen on them, so its ",
        "scores there are in-sample. The held-out set is ",
        f"{w.value(f, '/sets/held_out/landscapes', kind='count')} synthetic landscapes (`bench/cost_model.py`), ",
        f"every slot of the anchor shapes no tuning landscape has (`{', '.join(held)}`), scored by the ",
        "tuner as frozen before any held-out score was seen (`bench/results/tuner_frozen.json`, a hash of ",
        "`autotune/tuner/`; the benchmark refuses to score them with any other). They come from the cost model ",
        "fitted to the six recordings: a model, not a measurement. Fitted without one recording, it ranks that ",
        f"recording's configs with Spearman's rho {w.value(f, f'/cost_model_fit/leave_one_out/{rhos[0]}/spearman', '2f')}-",
        f"{w.value(f, f'/cost_model_fit/leave_one_out/{rhos[-1]}/spearman', '2f')} and is off by a median ",
        f"{w.value(f, f'/cost_model_fit/leave_one_out/{errs[0]}/median_rel_err', '0%')}-",
        f"{w.value(f, f'/cost_model_fit/leave_one_out/{errs[-1]}/median_rel_err', '0%')} of each config's time ",
        "(leave one landscape out). Random search is Optuna's RandomSampler ",
        "walking the space define-by-run (each method as likely as any other, then each knob), and gets the ",
        "tuner's budget on every seed: as many configs as the tuner measured (its finalist batch re-measures its ",
        f"{w.value(f, '/tuner_finalist_overlaps', '0f')} fastest besides). Arrival: configs measured until one within ",
        f"{w.value(f, '/target_gap', '0%')} of the optimum; a miss: a final pick more than ",
        f"{w.value(f, '/miss_gaps/0', '1%')} or {w.value(f, '/miss_gaps/1', '0%')} off the optimum.",
    )
    w.text(
        "\n| set | strategy | median arrival | worst landscape (its median arrival) | misses over ",
        f"{w.value(f, '/miss_gaps/0', '1%')} | over {w.value(f, '/miss_gaps/1', '0%')} | worst pick |\n",
        "|---|---|---|---|---|---|---|\n",
    )
    for name in data["sets"]:
        for strategy, label in STRATEGY_NAMES.items():
            at = f"/sets/{name}/summary/{strategy}"
            total = resolve(data, at)
            worst = total["worst_landscape_arrival"]
            arrival = _arrival(w, f, f"{at}/median_arrival", total["median_arrival"])
            worst_arrival = _arrival(w, f, f"{at}/worst_landscape_arrival/median_arrival", worst["median_arrival"])
            w.text(
                f"| {name.replace('_', '-')} | {label} | {arrival} | `{_short(worst['landscape'])}` ({worst_arrival}) | ",
                f"{w.value(f, f'{at}/miss_rate_0.5pct', '1%')} | {w.value(f, f'{at}/miss_rate_2pct', '1%')} | ",
                f"{w.value(f, f'{at}/worst_pick_gap/pick_gap', '1%')} |\n",
            )
    w.text("\n")
    for name, found in data["sets"].items():
        targets = found["summary"]["targets"]
        missed = [f"`{t}`" for t, met in targets.items() if not met]
        met = [f"`{t}`" for t, ok in targets.items() if ok]
        worse = found["summary"].get("tuner_worse_than_random_baselines", [])
        cells = [
            f"`{_short(row['landscape'])}` (arrival "
            + _arrival(
                w,
                f,
                f"/sets/{name}/summary/tuner_worse_than_random_baselines/{i}/tuner_median_arrival",
                row["tuner_median_arrival"],
            )
            + " against "
            + _arrival(
                w,
                f,
                f"/sets/{name}/summary/tuner_worse_than_random_baselines/{i}/random_baselines_median_arrival",
                row["random_baselines_median_arrival"],
            )
            + ", pick "
            + w.value(f, f"/sets/{name}/summary/tuner_worse_than_random_baselines/{i}/tuner_median_pick_gap", "1%")
            + " against "
            + w.value(
                f, f"/sets/{name}/summary/tuner_worse_than_random_baselines/{i}/random_baselines_median_pick_gap", "1%"
            )
            + " off)"
            for i, row in enumerate(worse)
        ]
        if cells:
            worse_text = (
                "At the median the tuner is worse than random search after its baselines (a later arrival or a "
                f"pick further off) on {', '.join(cells)}."
            )
        else:
            worse_text = (
                "At the median the tuner is at least as good as random search after its baselines on every "
                "landscape (arrival and pick)."
            )
        w.para(
            f"{name.replace('_', '-').capitalize()} set: targets met: {', '.join(met) or 'none'}; ",
            f"**missed**: {', '.join(missed)}. " if missed else "none missed. ",
            worse_text,
        )
    return w.done()


def _arrival(w: Writer, file: str, pointer: str, value: float | None) -> str:
    return "never" if value is None else w.value(file, pointer, "0f")


def _short(landscape: str) -> str:
    """``bench/landscapes/h5120_s2048_tp2_proj_fprop_cuda.json`` -> ``h5120_s2048 proj_fprop``."""
    name = Path(landscape).name.removesuffix("_cuda.json").removeprefix("synthetic ")
    return re.sub(r"_tp\d+_", " ", name)


def service() -> tuple[str, list[Claim]]:
    f, w = SERVICE_RESULT, Writer()
    w.para(
        f"Service load (`python bench/service_load.py`, `{f}`). {age(f, SERVICE)} On a ",
        f"{w.value(f, '/machine/cpus', '0f')}-core machine shared with other work (load average ",
        f"{w.value(f, '/machine/load_average_before/0', '1f')} before the run), ",
        f"{w.value(f, '/config/concurrency', '0f')} clients asking for {w.value(f, '/config/shapes', '0f')} shapes in ",
        f"turn get {w.value(f, '/best/rps', '0f')} answers/s from `GET /v1/best` with its answer cache ",
        f"({w.value(f, '/ratio_of_bare_rps', '0%')} of a bare FastAPI endpoint's {w.value(f, '/bare/rps', '0f')}, p99 ",
        f"{w.value(f, '/best/p99_ms', '0f')} ms), and {w.value(f, '/best_uncached/rps', '0f')} answers/s without it ",
        f"({w.value(f, '/uncached_ratio_of_bare_rps', '0%')}, p99 {w.value(f, '/best_uncached/p99_ms', '0f')} ms), ",
        "when every request reads its shape's rows.",
    )
    return w.done()


SECTIONS: dict[str, Callable[[], tuple[str, list[Claim]]]] = {
    "tuned": tuned,
    "measured": measured,
    "search": search,
    "service": service,
}


def sections() -> dict[str, tuple[str, list[Claim]]]:
    return {name: make() for name, make in SECTIONS.items()}


def split(readme: str, name: str) -> tuple[str, str, str]:
    """(before, body, after) of section ``name``; ValueError naming the marker when one is missing."""
    start, end = START.format(name), END.format(name)
    if readme.count(start) != 1 or readme.count(end) != 1:
        raise ValueError(f"README.md must hold {start} and {end} once each")
    before, rest = readme.split(start)
    body, after = rest.split(end)
    return before + start + "\n", body.removeprefix("\n"), end + after


def rewrite(readme: str, made: Mapping[str, tuple[str, list[Claim]]]) -> str:
    for name, (text, _) in made.items():
        before, _, after = split(readme, name)
        readme = before + text + after
    return readme


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is out of date")
    args = parser.parse_args(argv)
    current = README.read_text(encoding="utf-8")
    wanted = rewrite(current, sections())
    if args.check:
        if wanted != current:
            print("README.md is out of date: run python bench/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted, encoding="utf-8")
    print(f"-> {README.relative_to(REPO)} ({', '.join(SECTIONS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
