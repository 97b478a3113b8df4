"""The longest test files run first.

`make test` hands whole files to four pytest processes (``--dist loadfile``), in the order collected here
(``--no-loadscope-reorder``). A long file handed out last is left running alone on a machine that has nothing
else to do, so files go out longest first, by the seconds each took last time it was measured
(`DURATIONS`); a file with no measurement yet goes last, in its usual order.

``pytest --store-durations`` (with or without ``-n``) writes the seconds of the files this run measured into
`DURATIONS`, keeping the other files' (so a run of one file updates that file's only).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
"""Test file (relative to the repository) -> seconds its setup, calls and teardowns took in one run."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write each test file's seconds to {DURATIONS.name}, which orders the files of later runs",
    )


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seconds = _known()
    items.sort(key=lambda item: -seconds.get(_file(item.nodeid), 0.0))  # stable: a file's tests keep their order


class _Recorder:
    """Sums the durations of every report by file (in the process that sees every report: the xdist
    controller, or the only process)."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_file(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.OK:  # a run cut short measures only part of its files
            known = _known()
            known |= {name: round(s, 1) for name, s in self.seconds.items()}
            DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(), "store-durations")
