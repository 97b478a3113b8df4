"""The local run behind `autotune tune`: every slot of one shape, tuned on this machine's TP group.

One `Runtime` measures for all slots (its process group starts once); each slot has its `SlotStudy` in the
same Optuna storage the service uses (the storage package's SQLite file by default), so a tune that was
interrupted resumes where it stopped when run again with the same arguments: the studies have the same
names, completed trials are read back instead of measured, and proposals that were out when the process
died are measured first.  The winners go to the service's best-config table, the NeMo YAML and the TE dict.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import optuna as optuna_lib
from rich.console import Console
from rich.progress import Progress, TaskID
from sqlalchemy import Engine

from autotune.tuner.drive import DEFAULT_TRIALS, drive
from autotune.tuner.gpu import device_gpu_name, preset_gpu_name, results_gpu
from autotune.tuner.outcome import SlotOutcome
from autotune.tuner.proposal import Proposal, Purpose
from autotune.tuner.studies import SlotStudy, study_name
from overlap_runtime.config import NO_OVERLAP, check_backend_size
from overlap_runtime.errors import InputError
from overlap_runtime.knobs import Backend
from overlap_runtime.runtime import open_runtime
from overlap_runtime.shape import ModelShape, Slot
from overlap_runtime.te_backend import require_te
from search_spaces.catalog import tunable_slots
from search_spaces.consumers import Consumer, ConsumerChoice
from search_spaces.export import SlotResult, consumer_choice, preset_from_results
from search_spaces.formats import FORMATS, TUNE_FORMATS, Exported
from search_spaces.ours import OursPreset, OursSlot
from storage import create_engine_for, open_study, optuna_storage, record_winner, session_factory, upgrade


@dataclass(frozen=True, kw_only=True)
class TuneRequest:
    shape: ModelShape
    out: Path
    """Folder for the NeMo YAML and the TE dict (created if missing)."""
    layers: Sequence[str] | None = None
    """Slot names; None for every tunable slot."""
    n_trials: int = DEFAULT_TRIALS
    backend: str = "cpu"
    db: str | None = None
    """Database URL shared with the service; None for the storage package's default SQLite file."""
    gpu: str | None = None
    """GPU model name results are keyed by; None: NVML's name of GPU 0, or "cpu"."""
    seed: int | None = None
    consumer: Consumer | None = None
    """Who runs the presets; None: each format's own (`search_spaces.formats.PresetFormat.consumer`)."""
    fresh: bool = False
    """Delete the slots' studies of an earlier run (finished or not) first, so every slot is measured anew."""


@dataclass(frozen=True, kw_only=True)
class TuneReport:
    shape: ModelShape
    gpu: str
    outcomes: dict[Slot, SlotOutcome | None]
    """None for a slot where no config ran correctly."""
    reasons: dict[Slot, str]
    """Each study's last word: why it stopped or how it decided."""
    files: tuple[Path, ...]
    choice: ConsumerChoice | None = None
    """The joint choice of the consumer asked for (else of the NeMo YAML's, megatron); None with no winner."""
    reused: tuple[Slot, ...] = ()
    """Slots whose study an earlier run had finished: their results are read back, nothing is measured."""

    @property
    def ok(self) -> bool:
        return all(o is not None for o in self.outcomes.values())


def tune(request: TuneRequest, *, console: Console) -> TuneReport:
    """Tune every requested slot; bad input (shape, layers, backend) raises `InputError` before anything runs."""
    shape = request.shape
    slots = tunable_slots(shape, request.layers)
    check_backend_size(shape, request.backend)
    if request.backend == Backend.TE:
        require_te()  # what to install, before the database file is created
    engine = create_engine_for(url=request.db)  # a --db in a missing folder is an InputError before anything runs
    _make_out(request.out)
    with open_runtime(tp=shape.tp, backend=request.backend) as runtime:
        for slot in slots:  # the runtime's shape rules (tp, dtype) as an InputError now, not as failed trials
            runtime.check(shape, slot, NO_OVERLAP)
        gpu = results_gpu(request.gpu or device_gpu_name(backend=request.backend), request.backend)
        upgrade(engine=engine)
        optuna = optuna_storage(engine)
        if request.fresh:
            for slot in slots:
                with suppress(KeyError):  # no earlier study
                    optuna_lib.delete_study(study_name=study_name(gpu=gpu, shape=shape, slot=slot), storage=optuna)
        with session_factory(engine=engine)() as session:
            studies = {
                slot: open_study(
                    session=session,
                    storage=optuna,
                    gpu=gpu,
                    shape=shape,
                    slot=slot,
                    backend=request.backend,
                    limits=runtime.limits,
                    n_trials=request.n_trials,
                    seed=request.seed,
                )
                for slot in slots
            }
        reused = tuple(slot for slot, study in studies.items() if study.progress().phase == "finished")
        with _progress(console) as bars:
            for slot, study in studies.items():
                task = bars.add_task(slot.value, total=request.n_trials + 1)
                drive(study, measurer=runtime, on_told=partial(_advance, bars, task, study))
                bars.update(task, completed=request.n_trials + 1)
    outcomes = {slot: study.outcome() for slot, study in studies.items()}
    reasons = {slot: study.progress().note or "" for slot, study in studies.items()}
    decided = {slot: o for slot, o in outcomes.items() if o is not None}
    files: tuple[Path, ...] = ()
    choice = None
    if decided:
        results = {slot: outcome.slot_result() for slot, outcome in decided.items()}
        ours = OursPreset(
            shape=shape, gpu=gpu, slots={s: OursSlot.of(o.best, o.best_measurement) for s, o in decided.items()}
        )
        files = _write_presets(shape, results, ours, request, gpu=gpu)
        choice = consumer_choice(results, request.consumer or Consumer.MEGATRON)
        _record_best(engine=engine, gpu=gpu, shape=shape, outcomes=decided)
    engine.dispose()
    return TuneReport(
        shape=shape, gpu=gpu, outcomes=outcomes, reasons=reasons, files=files, choice=choice, reused=reused
    )


def _make_out(out: Path) -> None:
    """Create ``out`` (the presets' folder) now, and check it takes files: a tune of minutes must not end
    in a folder it cannot write."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError("out", f"cannot be made a folder: {e.strerror or e}", str(out)) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise InputError("out", "is a folder this user cannot write", str(out))


@contextmanager
def _progress(console: Console) -> Iterator[Progress]:
    """One bar per slot, only on a terminal (pipes and CI logs get the table alone)."""
    with Progress(console=console, disable=not console.is_terminal) as bars:
        yield bars


def _advance(bars: Progress, task: TaskID, study: SlotStudy, proposal: Proposal) -> None:
    progress = study.progress()
    done = progress.measured + (proposal.purpose == Purpose.FINALIST)
    bars.update(task, completed=done, description=f"{study.slot.value} ({progress.phase})")


def _write_presets(
    shape: ModelShape, results: Mapping[Slot, SlotResult], ours: OursPreset, request: TuneRequest, *, gpu: str
) -> tuple[Path, ...]:
    """Each of `TUNE_FORMATS` into ``request.out``: the TE formats with the TE-exact winners chosen for the
    consumer asked for (else the format's own), ours with the overall winners."""
    written = []
    for name in TUNE_FORMATS:
        fmt = FORMATS[name]
        made_for = None if fmt.consumer is None else request.consumer or fmt.consumer
        preset = preset_from_results(shape, results, gpu=preset_gpu_name(gpu), consumer=made_for)
        exported = Exported(preset=preset, ours=ours)
        path = request.out / fmt.file_name(exported)
        path.write_text(fmt.write(exported), encoding="utf-8")
        written.append(path)
    return tuple(written)


def _record_best(*, engine: Engine, gpu: str, shape: ModelShape, outcomes: dict[Slot, SlotOutcome]) -> None:
    with session_factory(engine=engine)() as session:
        for outcome in outcomes.values():
            record_winner(session=session, gpu=gpu, shape=shape, outcome=outcome)
