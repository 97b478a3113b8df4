"""Command options made from a dataclass's fields, so a command names the object it needs, not every option.

Typer reads a command's options from its signature.  `takes` puts one option per `FieldOption` in place of
one parameter of the command (a wrapper with its own ``__signature__``), and calls the command with what
``build`` makes of their values.  The options keep the fields' names, types and defaults; the flag is the
name in kebab case, and a bool option is a switch (``--gated``) or, when it may be left unset, a pair
(``--gated/--not-gated``: ``--no-gated`` would read as "no gated filter"), unless the option declares its
own flags (``--use-ce/--no-ce``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, cast

import typer

REQUIRED = inspect.Parameter.empty
KEYWORD = inspect.Parameter.KEYWORD_ONLY

Command = TypeVar("Command", bound=Callable[..., object])


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldOption:
    """One command option standing for one field."""

    name: str
    type: Any
    """``int``, ``int | None``, ``bool``, ...: what typer parses the value as."""
    help: str
    default: Any = REQUIRED
    flags: str | None = None
    """The option's declaration (typer's terms) where it is not the one made from the name and type."""
    bounds: tuple[int, int] | None = None
    """(min, max) of an int option."""

    def parameter(self) -> inspect.Parameter:
        flag = f"--{self.name.replace('_', '-')}"
        if self.flags is not None:
            decls: tuple[str, ...] = (self.flags,)
        elif self.type is bool:
            decls = (flag,)
        elif self.type == bool | None:
            decls = (f"{flag}/--not-{flag[2:]}",)
        else:
            decls = ()
        low, high = self.bounds or (None, None)
        option = typer.Option(*decls, help=self.help, min=low, max=high)
        return inspect.Parameter(self.name, KEYWORD, default=self.default, annotation=Annotated[self.type, option])


def takes(parameter: str, options: Sequence[FieldOption], build: Callable[..., Any]) -> Callable[[Command], Command]:
    """A decorator: the command's ``parameter`` becomes ``options``, and the command gets ``build(**values)``."""

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        names = [o.name for o in options]
        if parameter not in signature.parameters:
            raise TypeError(f"{command.__name__} has no parameter {parameter} to replace")
        if clash := sorted(set(names) & set(signature.parameters)):
            raise TypeError(f"{command.__name__} already has the parameters {', '.join(clash)}")
        params = list(signature.parameters.values())
        at = list(signature.parameters).index(parameter)
        params[at : at + 1] = [o.parameter() for o in options]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return command(**kwargs, **{parameter: build(**values)})

        # Keyword-only, since a required option may now follow one with a default; typer passes keywords anyway.
        wrapper.__signature__ = signature.replace(parameters=[p.replace(kind=KEYWORD) for p in params])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return cast(Command, wrapper)

    return decorate
