"""A followed job's progress on stderr: a live bar on a terminal, plain lines anywhere else.

Into a pipe, a file or a CI log a bar would show nothing until the job ends, so there `JobProgress` prints
one line at once and then one whenever the progress changes, at most every `LINE_EVERY_S` unless the
status changes.  Progress is the trials run against the job's budget, and a slot that stops early says so
once.  In both modes a job that waits because no registered worker can run it says why, once each
time the reason changes (the job view's ``waiting_reason``; a controller too old to send one sends none).
"""

from __future__ import annotations

import math
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn

from api.schemas import JobPublic, SlotPublic

LINE_EVERY_S = 5.0
"""Off a terminal, at most one progress line per this many seconds while the status stays the same."""


def waiting_reason(job: JobPublic) -> str | None:
    """Why the job makes no progress, as the controller says; None when it does not say."""
    return getattr(job, "waiting_reason", None)


def trials_run(job: JobPublic) -> str:
    """Trials run against the job's budget (its trials per slot times its slots): a number that only grows,
    where the controller's ``progress.total`` shrinks as slots stop early."""
    run = sum(slot.n_complete + slot.n_failed for slot in job.slots)
    return f"{run}/{job.n_trials * len(job.layers)} trials"


def is_stopped_early(job: JobPublic, slot: SlotPublic) -> bool:
    """Whether ``slot`` finished before its budget: its search stopped, as it does once nothing gains."""
    return slot.status == "succeeded" and slot.n_complete + slot.n_failed < job.n_trials


def stopped_early(job: JobPublic) -> list[str]:
    """A line for each slot that stopped early."""
    return [
        f"{slot.slot} stopped early after {slot.n_complete + slot.n_failed} of {job.n_trials} trials"
        for slot in job.slots
        if is_stopped_early(job, slot)
    ]


class JobProgress:
    """Shows each state of one job passed to `show`; a context manager (it owns the bar while one shows)."""

    def __init__(self, job_id: str) -> None:
        self._console = Console(stderr=True)
        self._label = f"job {job_id[:8]}"
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._reason: str | None = None
        self._stopped: set[str] = set()
        self._line: tuple[str, str] | None = None  # (text, status) of the last line printed
        self._line_at = -math.inf

    def __enter__(self) -> JobProgress:
        if self._console.is_terminal:
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[done]}"),
                TimeElapsedColumn(),
            )
            self._bar = Progress(*columns, console=self._console)
            self._bar.start()
            self._task = self._bar.add_task(self._label, total=1.0, done="")
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def show(self, job: JobPublic) -> None:
        text = f"{trials_run(job)}, {job.status}"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=job.progress.fraction, done=text)
        else:
            self._line_for(job, text)
        for line in stopped_early(job):
            if line not in self._stopped:
                self._print(f"{self._label}: {line}")
                self._stopped.add(line)
        reason = waiting_reason(job)
        if reason is not None and reason != self._reason:
            self._print(f"{self._label} waits: {reason}")  # above the bar, where there is one
        self._reason = reason

    def _line_for(self, job: JobPublic, text: str) -> None:
        now = time.monotonic()
        status_changed = self._line is None or self._line[1] != job.status
        if (text, job.status) != self._line and (status_changed or now - self._line_at >= LINE_EVERY_S):
            self._print(f"{self._label}: {text} ({job.progress.fraction:.0%})")
            self._line, self._line_at = (text, job.status), now

    def _print(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False, soft_wrap=True)
