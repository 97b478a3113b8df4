"""The bodies every resource shares: strict input, names, shapes, overlap configs, TE entries, proposals.

Every number and string that reaches the database has a bound here, so bad input stops at validation with a
422 naming the field and the rule, and never reaches a driver as an integer overflow or a NUL byte (a 5xx).
The shape's models are made from `ModelShape`'s fields, so a field added there is in the request and the
query at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from types import NoneType
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from autotune.tuner.proposal import Proposal, Purpose
from overlap_runtime.config import DEFAULTS, OverlapConfig
from overlap_runtime.knobs import BY_NAME, KNOBS, Backend, Knob, Origin
from overlap_runtime.shape import ModelShape, ShapeField, shape_fields

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._()/:+-]*$"
"""GPU models, host and worker names: what NVML and hostnames produce, nothing that breaks a log line."""

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]
BackendField = Annotated[Backend, Field(strict=False)]
"""A backend's name in a body (JSON carries the name: the enum is not strict here)."""
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    """Unknown keys are an error (a typo such as ``n_trial`` must not be ignored silently), and no type is
    coerced (``false`` is not 0, ``"4"`` is not 4): what the schema says is what the API takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """Every string in a body is valid Unicode: JSON may carry a lone surrogate (``"\\ud800"``), which no
        database driver can encode, so it is a 422 here rather than a 500 at the driver."""
        if _has_lone_surrogate(value):
            raise ValueError("must be valid Unicode text (no lone surrogates such as \\ud800)")
        return value


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(map(_has_lone_surrogate, value))
    return False


def _shape_fields(base: type[BaseModel], *, lookup: bool) -> type[BaseModel]:
    """``base`` with one field per `ModelShape` field (as a ``lookup`` takes them), bounded by its `FieldFacts`."""
    fields: dict[str, Any] = {}
    for f in shape_fields(lookup=lookup):
        value = _value_type(f)
        default = ... if f.default is MISSING else f.default
        fields[f.name] = (value if default is not None else value | None, Field(default, description=f.facts.help))
    return create_model(f"{base.__name__}Shape", __base__=base, **fields)


def _value_type(f: ShapeField) -> Any:
    """The field's type without None, with the API's bounds: a positive int up to ``most``, a str of ``choices``."""
    (value,) = [t for t in get_args(f.type) or (f.type,) if t is not NoneType]
    if f.facts.choices:
        return Literal[f.facts.choices]
    if value is int:
        return Annotated[int, Field(ge=1, le=f.facts.most)]
    return value


class ShapeCreate(_shape_fields(Strict, lookup=False)):  # type: ignore[misc]
    """A transformer layer shape under tensor + sequence parallelism (`overlap_runtime.shape.ModelShape`)."""

    def to_shape(self) -> ModelShape:
        """The validated shape; `ShapeError` (a 422) when the sizes do not divide as TE needs."""
        return ModelShape(**self.model_dump())


class ShapeLookup(_shape_fields(BaseModel, lookup=True)):  # type: ignore[misc]
    """The query of ``GET /v1/best`` and ``GET /v1/presets``: hidden, tp, seq (and mbs) name the dimensions;
    each filter field given narrows the answer to the shapes that agree with it.  Unknown parameters are
    ignored, as FastAPI ignores them elsewhere (``format`` of /v1/presets is one)."""

    gpu: Name | None = Field(None, description="GPU model, as NVML names it (NVIDIA H200) or short (h200)")


class ConfigBody(Strict):
    """One overlap config (`overlap_runtime.config.OverlapConfig`), as `to_dict` writes it: method first,
    then only the knobs set to something other than unset."""

    def to_config(self) -> OverlapConfig:
        return OverlapConfig.from_dict(self.model_dump())


def _knob_type(knob: Knob) -> Any:
    """The type of a set value of ``knob``: its kind and range from the table."""
    annotation: Any = Literal[knob.choices] if knob.choices else knob.value_type
    if knob.bounds is not None:
        annotation = Annotated[annotation, Field(ge=knob.bounds[0], le=knob.bounds[1])]
    return annotation


def _knob_field(knob: Knob) -> tuple[Any, Any]:
    """(annotation, pydantic field) of ``knob``: its kind, range and help from the table; a knob at its unset
    value is left out of the JSON, as `OverlapConfig.to_dict` leaves it out."""
    annotation = _knob_type(knob)
    if knob.name not in DEFAULTS:
        return annotation, Field(description=knob.help)
    unset = DEFAULTS[knob.name]
    if unset is None:
        annotation = annotation | None
    return annotation, Field(unset, description=knob.help, exclude_if=lambda value: value == unset)


if TYPE_CHECKING:
    OverlapConfigBody = ConfigBody
else:
    OverlapConfigBody = create_model(
        "OverlapConfigBody",
        __base__=ConfigBody,
        __doc__=ConfigBody.__doc__,
        # In the fields' order, which `to_dict` writes: the JSON stays as the service always served it.
        **{f.name: _knob_field(BY_NAME[f.name]) for f in dataclasses.fields(OverlapConfig)},
    )


def _te_key_field(knob: Knob) -> tuple[Any, Any]:
    """(annotation, pydantic field) of a TE key: method always, any other key where the entry gives it."""
    if knob.name == "method":
        return _knob_type(knob), Field(description=knob.help)
    return _knob_type(knob) | None, Field(None, description=knob.help, exclude_if=lambda value: value is None)


class TeEntry(Strict):
    """One TE ``ub_cfgs`` entry as `search_spaces.te_dict.te_entry` writes it: every key the method reads,
    TE's defaults included, in the order NVIDIA's files write them (no ``is_reduce_scatter``)."""


if TYPE_CHECKING:
    TeEntryBody = TeEntry
else:
    TeEntryBody = create_model(
        "TeEntryBody",
        __base__=TeEntry,
        __doc__=TeEntry.__doc__,
        **{knob.name: _te_key_field(knob) for knob in KNOBS if knob.origin == Origin.TE and knob.field},
    )


class ProposalBody(BaseModel):
    """`autotune.tuner.proposal.Proposal.to_dict()`: configs to measure together on one slot, and how often."""

    number: int
    """The Optuna trial it tells into."""
    configs: list[OverlapConfigBody]
    purpose: Purpose
    repeats: int
    rounds: int
    labels: list[str] = []
    """A baseline's reasons (``none``, ``te_default``, ``preset``, ``measure_first``, ``warm_start``); empty otherwise."""

    def to_proposal(self) -> Proposal:
        return Proposal.from_dict(self.model_dump())
