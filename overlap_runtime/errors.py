"""The root of the project's one exception tree, and the errors that cross layers.

Every error this project raises derives from `AutotuneError`, so a caller can tell ours from a library's.
`InputError` is everything a user can get wrong (shape, config, preset, request): it names the field, the
rule and the offending value.  `TrialFailure` is a config that ran and broke the TP group (hang, crash): the
tuner records it as a failed trial with its reason.  `LeaseLost` tells a worker to drop its result: storage
raises it when the trial is no longer the worker's, the API answers it with 409, and the REST client raises
it again from that answer.  Storage's and the client's own errors derive from `AutotuneError` in their
packages.  HTTP statuses are assigned in `api/errors.py`, CLI exit codes in `autotune/cli/app.py`
(docs/rest.md and docs/cli.md).

Each class pickles with its own arguments: errors are raised inside rank processes and re-raised in the
parent.
"""

from __future__ import annotations

from typing import Any


class AutotuneError(Exception):
    """The root of every exception this project raises."""


class InputError(AutotuneError, ValueError):
    """Bad input: ``<field>: <rule> (got <value>)``."""

    def __init__(self, field: str, rule: str, value: Any = None) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        got = "" if value is None else f" (got {value!r})"
        super().__init__(f"{field}: {rule}{got}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.field, self.rule, self.value))


class ShapeError(InputError):
    """A model shape that TE could not run (sizes that do not divide, non-positive sizes)."""


class ConfigError(InputError):
    """An overlap config that the method, the slot or the backend cannot honour."""


class TrialFailure(AutotuneError, RuntimeError):
    """A config that hung or crashed the TP group; ``reason`` says which and how."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)

    def __reduce__(self) -> tuple:
        return (type(self), (self.reason,))


class LeaseLost(AutotuneError):
    """The worker no longer holds the trial: its lease expired or the trial went to someone else."""
