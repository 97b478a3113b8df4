"""The table `autotune tune` prints: per slot the winner, what it leaves exposed, and what it gains.

Gains are shares of time saved (+12% = the winner takes 12% less time than TE's default / than running the
collective and the GEMM back to back); negative means slower.  The TE default and the winner come from the
same interleaved finalist batch, so that gain is not an artefact of measuring them minutes apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from autotune.tuner.gpu import CPU
from autotune.tuner.outcome import SlotOutcome
from search_spaces.consumers import ConsumerChoice, describe, switch_lines
from search_spaces.export import ALTERNATIVES_SHOWN

if TYPE_CHECKING:  # the tuning run (Optuna, SQLAlchemy) is not loaded by the commands that only print a report
    from autotune.cli.local_tuning import TuneReport

COLUMNS = (
    "slot",
    "method",
    "knobs",
    "overlap ms",
    "exposed ms",
    "hidden",
    "vs TE",
    "vs serial",
    "spread",
    "trials",
    "TE-exact ms",
)
""""vs TE": gain over TE's default config; "trials": configs measured (failed ones in brackets); "TE-exact ms":
the slot's TE-exact winner (what the NeMo YAML and TE dict carry), "=" when it is the winner itself."""


CPU_NOTE = (
    "note: measured on the CPU backend (gloo between CPU processes): these times show that the service works, "
    "not what a GPU gains, so the share hidden is not shown (n/a); tune on GPUs for numbers to use"
)
"""Beside every table of CPU-backend results (`tune`, `best`; the dashboard says the same)."""


def hidden_text(hidden_frac: float | None, *, on_cpu: bool) -> str:
    """The share hidden as the tables show it: n/a on the CPU backend (`CPU_NOTE`) or where none was measured."""
    return "n/a" if on_cpu or hidden_frac is None else f"{100 * hidden_frac:.0f}%"


def outcome_table(report: TuneReport) -> Table:
    table = Table(title=f"{report.shape.label()} {report.shape.dtype} on {report.gpu}")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("slot", "method", "knobs") else "right")
    for slot, outcome in report.outcomes.items():
        if outcome is None:
            table.add_row(slot.value, "[red]failed[/red]", report.reasons[slot], *[""] * (len(COLUMNS) - 3))
        else:
            table.add_row(slot.value, *_cells(outcome, on_cpu=report.gpu == CPU))
    return table


def _cells(outcome: SlotOutcome, *, on_cpu: bool) -> list[str]:
    m = outcome.best_measurement
    knobs = {k: v for k, v in outcome.best.to_dict().items() if k != "method"}
    return [
        outcome.best.method.value,
        " ".join(f"{k}={v}" for k, v in knobs.items()) or "-",
        f"{m.overlap_ms:.4g}",
        f"{m.exposed_ms:.4g}",
        hidden_text(m.hidden_frac, on_cpu=on_cpu),
        _gain(outcome.gain_vs_te_default),
        _gain(outcome.gain_vs_serial),
        f"{100 * outcome.spread:.1f}%",
        f"{outcome.n_trials} ({outcome.n_failed})",
        _te_exact(outcome),
    ]


def _te_exact(outcome: SlotOutcome) -> str:
    if outcome.te_exact is None or outcome.te_exact_measurement is None:
        return "none"
    return "=" if outcome.te_exact == outcome.best else f"{outcome.te_exact_measurement.overlap_ms:.4g}"


def _gain(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:+.1f}%"


def choice_lines(choice: ConsumerChoice) -> list[str]:
    """A consumer's joint choice as the lines `autotune tune` prints under its table: the switches, then the
    settings compared with their summed times."""
    lines = [f"for {choice.consumer.value}, run with:"]
    lines += [f"  {line}" for line in switch_lines(choice.consumer, choice.chosen.setting)]
    coupled = ", ".join(slot.value for slot in choice.coupled)
    lines.append(f"settings compared (summed ms of {coupled}; the chosen one first):")
    lines += [f"  {line}" for line in describe(choice.alternatives[:ALTERNATIVES_SHOWN], choice.coupled)]
    return lines
