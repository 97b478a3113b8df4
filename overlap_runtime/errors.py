"""One exception tree for the whole project.

`InputError` is everything a user can get wrong (shape, config, preset, request): it names the field, the
rule and the offending value, and callers map it to HTTP 4xx or CLI exit code 2.  `TrialFailure` is a config
that ran and broke the TP group (hang, crash): the tuner records it as a failed trial with its reason.
"""

from __future__ import annotations

from typing import Any


class InputError(ValueError):
    """Bad input: ``<field>: <rule> (got <value>)``."""

    def __init__(self, field: str, rule: str, value: Any = None) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        got = "" if value is None else f" (got {value!r})"
        super().__init__(f"{field}: {rule}{got}")

    def __reduce__(self) -> tuple:
        # Raised inside rank processes and re-raised in the parent: must survive pickling.
        return (type(self), (self.field, self.rule, self.value))


class ShapeError(InputError):
    """A model shape that TE could not run (sizes that do not divide, non-positive sizes)."""


class ConfigError(InputError):
    """An overlap config that the method, the slot or the backend cannot honour."""


class TrialFailure(RuntimeError):
    """A config that hung or crashed the TP group; ``reason`` says which and how."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)

    def __reduce__(self) -> tuple:
        return (type(self), (self.reason,))
