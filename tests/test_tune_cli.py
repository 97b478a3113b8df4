"""`autotune tune` end to end on the CPU backend, as a user runs it (subprocesses, a tiny shape): presets
written and loadable, winners valid and stored, bad input refused, and a killed tune resumed without
measuring a completed trial again."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.tuner.studies import study_name
from overlap_runtime.config import OverlapConfig
from overlap_runtime.shape import ModelShape, Slot
from search_spaces import load_ours
from search_spaces.catalog import tunable_slots
from storage import create_engine_for, get_best, session_factory

pytestmark = pytest.mark.slow
AUTOTUNE = str(Path(sys.executable).parent / "autotune")
TINY = ["--hidden", "64", "--tp", "2", "--seq", "32", "--backend", "cpu", "--seed", "0"]
SHAPE = ModelShape(hidden=64, tp=2, seq=32)
PRESET = "ub_cfg_cpu_bf16_h64_tp2_mbs1_seqlen32"
TE_LAYER = ("--trials", "8", "--for", "te-layer")
"""Every slot of the tiny shape, for te-layer: the module's one tune of them all (`te_layer_tune`)."""


def command(*args: str, tmp_path: Path) -> list[str]:
    """`autotune tune` on the tiny shape with its database and output folder under ``tmp_path``."""
    paths = ["--db", f"sqlite:///{tmp_path / 'autotune.db'}", "--out", str(tmp_path / "out")]
    return [AUTOTUNE, "tune", *TINY, *paths, *args]


def tune(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(*args, tmp_path=tmp_path), capture_output=True, text=True, timeout=240, check=False)


@dataclass(frozen=True)
class Tuned:
    """A finished `tune` run and the folder it ran in."""

    result: subprocess.CompletedProcess[str]
    tmp_path: Path
    """Where its database and presets are: read them only (copy the database to change it)."""


@pytest.fixture(scope="module")
def te_layer_tune(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    """`TE_LAYER`, tuned once for the tests that read it: a tune of every slot is the costliest run here."""
    tmp_path = tmp_path_factory.mktemp("te_layer")
    return Tuned(result=tune(*TE_LAYER, tmp_path=tmp_path), tmp_path=tmp_path)


def test_tune_writes_a_preset_with_every_slot_and_stores_valid_winners(te_layer_tune: Tuned) -> None:
    result, tmp_path = te_layer_tune.result, te_layer_tune.tmp_path
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / f"{PRESET}.yaml").read_text()
    preset = yaml.safe_load(text)
    te_dict = json.loads((tmp_path / "out" / f"{PRESET}.json").read_text())
    assert te_dict.keys() == preset.keys()  # both made for te-layer: the same joint choice
    assert "# autotune-switches (te-layer): " in text and "for te-layer, run with:" in result.stdout
    assert "settings compared (summed ms of " in result.stdout
    slots = [slot.value for slot in tunable_slots(SHAPE)]
    for slot in slots:  # a wgrad slot is left out (with a note) when its dgrad slot reduce-scatters
        assert slot in preset or f"# {slot}: left out" in text, slot
        assert slot in result.stdout
    with session_factory(engine=create_engine_for(url=f"sqlite:///{tmp_path / 'autotune.db'}"))() as session:
        best = get_best(session=session, shape=SHAPE, gpu="cpu")
    assert sorted(row.slot for row in best) == sorted(slots)
    assert all(row.measurement["valid"] for row in best)
    # The TE files carry the TE-exact winners (no caveat), our own format the overall ones.
    assert "measured with" not in text and all(row.te_exact_config is not None for row in best)
    ours = load_ours((tmp_path / "out" / "ours_cpu_h64_tp2_mbs1_seq32_f256_q192_bf16_cp1.yaml").read_text())
    assert {slot.value: entry.config.to_dict() for slot, entry in ours.slots.items()} == {
        row.slot: row.config for row in best
    }
    for row in best:  # decided by the finalist batch: scored against baselines timed in its three rounds
        baselines = row.measurement["baselines"]
        assert baselines["source"] == "same_rounds", row.slot
        for r in (1, 2):
            assert baselines["comm"]["positions"][r - 1] < row.measurement["positions"][r]
            assert row.measurement["positions"][r - 1] < baselines["comm"]["positions"][r]


def test_tune_stores_a_gated_context_parallel_shape_as_given(tmp_path: Path) -> None:
    result = tune("--gated", "--cp", "2", "--layers", "fc1_fprop", "--trials", "2", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    with session_factory(engine=create_engine_for(url=f"sqlite:///{tmp_path / 'autotune.db'}"))() as session:
        (row,) = get_best(session=session, shape=SHAPE, gpu="cpu")
    assert row.slot == "fc1_fprop"
    assert ModelShape(**row.shape) == ModelShape(hidden=64, tp=2, seq=32, gated=True, cp=2)


def test_tune_an_fp8_shape_writes_an_fp8_preset_as_nvidia_names_it(tmp_path: Path) -> None:
    """dtype fp8 end to end: E4M3 GEMMs measured on the CPU backend, winners stored under the fp8 key, the
    preset named and headed as NVIDIA's FP8 files are, and its pipeline free to pick an FP8 buffer."""
    result = tune("--dtype", "fp8", "--layers", "qkv_fprop,proj_fprop", "--trials", "6", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / "ub_cfg_cpu_fp8_h64_tp2_mbs1_seqlen32.yaml").read_text()
    assert text.startswith("# UB communicator configurations\n# Model configs: CPU/h64/TP2/MBS1/SeqLen32/FP8\n")
    assert {"qkv_fprop", "proj_fprop"} <= yaml.safe_load(text).keys()
    fp8 = ModelShape(hidden=64, tp=2, seq=32, dtype="fp8")
    with session_factory(engine=create_engine_for(url=f"sqlite:///{tmp_path / 'autotune.db'}"))() as session:
        best = get_best(session=session, shape=fp8, gpu="cpu", dtype="fp8")
        assert get_best(session=session, shape=SHAPE, gpu="cpu", dtype="bf16") == []
    assert sorted(row.slot for row in best) == ["proj_fprop", "qkv_fprop"]
    assert all(row.measurement["valid"] and ModelShape(**row.shape) == fp8 for row in best)


def test_bad_input_exits_2_and_names_the_field(tmp_path: Path) -> None:
    result = tune("--layers", "qkv_fprop,qkv_fprup", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "error: layers: unknown slot; did you mean qkv_fprop?" in result.stderr


def test_a_killed_tune_resumes_without_measuring_a_completed_trial_again(tmp_path: Path) -> None:
    # 6 configs a slot: the kill, at 4 completed trials, still comes in the middle of the first slot's search.
    args = ["--layers", "qkv_dgrad,proj_fprop", "--trials", "6"]
    running = subprocess.Popen(
        command(*args, tmp_path=tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_completed_trials(tmp_path / "autotune.db", at_least=4, process=running)
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=60) == 130, running.communicate()[1]
    before = _completed(tmp_path / "autotune.db")
    assert len(before) >= 4

    result = tune(*args, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    after = _completed(tmp_path / "autotune.db")
    assert {key: after[key] for key in before} == before  # completed trials were read back, not measured again
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'autotune.db'}")
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
        measured = Counter(
            OverlapConfig.from_dict(t.user_attrs["config"])
            for t in trials
            if "measurement" in t.user_attrs
            and t.user_attrs.get("purpose") != "finalist"
            and "duplicate_of" not in t.user_attrs
        )
        assert measured and max(measured.values()) == 1, summary.study_name
        assert "decision" in summary.user_attrs


def _completed(db: Path) -> dict[tuple[int, int], str]:
    """(study id, trial number) -> completion time of every COMPLETE trial, read with plain SQL."""
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT study_id, number, datetime_complete FROM trials WHERE state = 'COMPLETE'")
        return {(study, number): done for study, number, done in rows}


def _wait_for_completed_trials(db: Path, *, at_least: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if db.exists() and len(_completed(db)) >= at_least:
                return
        except sqlite3.OperationalError:  # Optuna's tables do not exist yet
            pass
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"the tune completed fewer than {at_least} trials in 120 s")


def test_a_tune_of_a_finished_shape_says_it_reuses_it_and_fresh_measures_again(
    te_layer_tune: Tuned, tmp_path: Path
) -> None:
    first = te_layer_tune.result
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith("note: measured on the CPU backend")  # and nothing re-used
    (row,) = [line.split("│") for line in first.stdout.splitlines() if line.startswith("│ qkv_fprop ")]
    assert row[6].strip() == "n/a"  # the share hidden means nothing on the CPU backend
    database = tmp_path / "autotune.db"  # a copy: this test changes it
    with (
        closing(sqlite3.connect(te_layer_tune.tmp_path / "autotune.db")) as source,
        closing(sqlite3.connect(database)) as copy,
    ):
        source.backup(copy)
    again = tune(*TE_LAYER, tmp_path=tmp_path)
    assert again.returncode == 0, again.stderr
    names = ", ".join(slot.value for slot in tunable_slots(SHAPE))
    assert again.stderr.startswith(f"note: {names}: finished by an earlier run in this database, so re-used as they")
    assert "--fresh tunes them anew\n" in again.stderr
    url = f"sqlite:///{database}"
    before = _summary(url, Slot.QKV_FPROP)
    fresh = tune("--layers", "qkv_fprop", "--trials", "3", "--fresh", tmp_path=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "re-used" not in fresh.stderr
    after = _summary(url, Slot.QKV_FPROP)
    assert after.n_trials > 0 and after.datetime_start is not None and before.datetime_start is not None
    assert after.datetime_start > before.datetime_start  # made anew, and measured again


def _summary(url: str, slot: Slot) -> optuna.study.StudySummary:
    """The summary of ``slot``'s study of the tiny shape."""
    name = study_name(gpu="cpu", shape=SHAPE, slot=slot)
    (found,) = [s for s in optuna.get_all_study_summaries(storage=url) if s.study_name == name]
    return found
