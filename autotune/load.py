"""`load_ub_cfgs`: the TE ``ub_cfgs`` of the best tuned preset for a shape, for a training script.

    from autotune import load_ub_cfgs
    ub_cfgs = load_ub_cfgs(shape={"hidden": 8192, "tp": 2, "seq": 8192}, source="presets/")
    te.module.base.initialize_ub(shape=[seq * mbs, hidden], tp_size=tp, ub_cfgs=ub_cfgs, ...)

The source is where the tuned results are:

- a preset file or a folder of them (NeMo YAML, Megatron-Bridge module, TE JSON: `search_spaces.formats`),
  such as the folder `autotune tune --out` writes;
- a database URL (``sqlite:///...``, ``postgresql+psycopg://...``): the winners `autotune tune` or the service
  stored, turned into a preset under the export rule exactly as ``GET /v1/presets`` does (`api.lookup`);
- a controller URL (``http://`` or ``https://``): ``GET /v1/presets?format=te`` through the typed client.

Only a tuned result is ever returned.  When none matches, `NoTunedPreset` says so and names the nearest
tuned shape; a training script never silently gets NVIDIA's nearest preset in place of a measurement.

A training script that reads a preset file loads no database driver, HTTP client, server or Optuna: those are
imported only when the source is a database or a controller (tests/test_layers.py holds this).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from autotune.tuner.gpu import preset_gpu_name
from overlap_runtime.errors import InputError
from overlap_runtime.shape import ModelShape, shape_fields
from search_spaces import Preset, parse_te_json, presets_in, read_preset, to_te_dict
from search_spaces.catalog import suggest
from search_spaces.consumers import Consumer, check, parse_consumer, rendered, why
from search_spaces.registry import shape_distance
from search_spaces.shape_query import query_for

CONTROLLER_SCHEMES = ("http", "https")
REQUIRED = tuple(f.name for f in dataclasses.fields(ModelShape) if f.init and f.default is dataclasses.MISSING)
"""The shape fields without a default (hidden, tp, seq)."""
FILE_FIELDS = ("hidden", "tp", "mbs", "seq", "cp", "dtype")
"""What a preset file's name records (NVIDIA's and Bridge's naming), so all a file is matched on."""


class NoTunedPreset(InputError):
    """No tuned result in the source matches the shape; the message names the nearest tuned shape."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ConsumerPreset:
    """What `load_ub_cfgs` returns for a consumer: the ``ub_cfgs`` and the switches that make the consumer run
    them as measured (`search_spaces.consumers.rendered`: Megatron flags and config fields, Bridge's model
    config fields, te.TransformerLayer's or each module's arguments)."""

    consumer: Consumer
    ub_cfgs: dict[str, dict[str, Any]]
    switches: dict[str, object]


@overload
def load_ub_cfgs(
    *,
    shape: ModelShape | Mapping[str, object],
    source: str | os.PathLike[str],
    gpu: str | None = None,
    token: str | None = None,
    consumer: None = None,
) -> dict[str, dict[str, Any]]: ...


@overload
def load_ub_cfgs(
    *,
    shape: ModelShape | Mapping[str, object],
    source: str | os.PathLike[str],
    gpu: str | None = None,
    token: str | None = None,
    consumer: Consumer | str,
) -> ConsumerPreset: ...


def load_ub_cfgs(
    *,
    shape: ModelShape | Mapping[str, object],
    source: str | os.PathLike[str],
    gpu: str | None = None,
    token: str | None = None,
    consumer: Consumer | str | None = None,
) -> dict[str, dict[str, Any]] | ConsumerPreset:
    """The ``ub_cfgs`` argument of TE's ``initialize_ub`` for the best tuned preset of ``shape`` in ``source``.

    ``shape``: a `ModelShape`, matched on every field it sets (ffn_hidden counts as 4 x hidden when unset), or
    a dict of shape fields (``hidden``, ``tp``, ``seq`` at least), matched on the fields it names, as the
    REST lookup is.  ``gpu``: the GPU model (NVML's name or NVIDIA's short one), needed when the source holds
    results of several.  ``token``: sent as the bearer token (the controller's reads need none; a proxy in
    front of it may).

    ``consumer`` (megatron, bridge, te-layer, te-modules): who runs the preset; then a `ConsumerPreset` comes
    back, with the switches it needs: the winners chosen for that consumer from a database or a controller,
    or a file's entries with the switches its header records for that consumer (else those that run it as
    written, `InputError` naming the slots and the rule when none does).

    Raises `NoTunedPreset` (an `InputError`) when nothing tuned matches, naming the nearest tuned shape;
    `InputError` for a bad shape or an ambiguous source; the storage and client errors of their sources.
    """
    given = _given(shape)
    made_for = None if consumer is None else parse_consumer(str(consumer))
    text = os.fspath(source)
    scheme = text.split("://", 1)[0] if "://" in text else None
    if scheme in CONTROLLER_SCHEMES:
        preset = _from_controller(text, given, gpu=gpu, token=token, consumer=made_for)
    elif scheme is not None:
        preset = _from_database(text, given, gpu=gpu, consumer=made_for)
    else:
        preset = _from_files(Path(text), given, gpu=gpu)
    if made_for is None:
        return to_te_dict(preset)
    return ConsumerPreset(consumer=made_for, ub_cfgs=to_te_dict(preset), switches=_switches(preset, made_for))


def _switches(preset: Preset, consumer: Consumer) -> dict[str, object]:
    """The switches that make ``consumer`` run ``preset`` as written: those it was made with, else the ones
    `consumers.check` finds (InputError naming the slots and the rule when none runs it as written)."""
    recorded = dict(preset.setting) if preset.consumer == consumer else {}
    result = check(consumer, preset.configs, fixed=recorded)
    if not result.ok:
        rules = "; ".join(why(run, consumer, preset.configs) for run in result.not_as_written)
        raise InputError(", ".join(run.slot.value for run in result.not_as_written), rules)
    return rendered(consumer, result.setting)


def _given(shape: ModelShape | Mapping[str, object]) -> dict[str, object]:
    """The shape fields to match on, validated as a shape (a ShapeError names the field and rule)."""
    if isinstance(shape, ModelShape):
        return {k: v for k, v in shape.to_dict().items() if v is not None}
    names = [f.name for f in shape_fields()]
    for key in shape:
        if key not in names:
            raise InputError(f"shape.{key}", f"is not a shape field{suggest(key, names)}")
    for key in REQUIRED:
        if key not in shape:
            raise InputError(f"shape.{key}", "is required")
    given = dict(shape)
    query_for(given)  # a shape TE cannot run is an error here, before any source is read
    return given


def _no_match(
    source: str, given: Mapping[str, object], gpu: str | None, tuned: list[tuple[ModelShape, str]]
) -> NoTunedPreset:
    """The error for a lookup that found nothing, naming the nearest of the ``tuned`` (shape, where) pairs."""
    asked = " ".join(f"{k}={v}" for k, v in {**given, "gpu": gpu}.items() if v is not None)
    if not tuned:
        return NoTunedPreset("shape", f"no tuned preset matches; {source} holds none", asked)
    target = query_for(given).shape
    near, where = min(tuned, key=lambda pair: shape_distance(target, pair[0]))
    rule = (
        f"no tuned preset in {source} matches; the nearest tuned shape is {near.key} "
        f"({shape_distance(target, near):.3g} doublings away, {where})"
    )
    return NoTunedPreset("shape", rule, asked)


def _from_controller(
    url: str, given: Mapping[str, object], *, gpu: str | None, token: str | None, consumer: Consumer | None
) -> Preset:
    """``GET /v1/presets?format=te``; a nearest (unmeasured) answer is refused, naming the finished jobs' shapes."""
    from autotune.cli.rest_client import Client  # an HTTP client only for a controller source

    with Client(url, token=token) as client:
        answer = client.preset(given, gpu=gpu, format="te", consumer=None if consumer is None else consumer.value)
        if answer.measured:
            return parse_te_json(answer.text)
        jobs = client.jobs(status="succeeded")
    tuned = {job.shape_key: (ModelShape(**job.shape), f"job {job.id}") for job in jobs}
    raise _no_match(url, given, gpu, list(tuned.values()))


def _from_database(url: str, given: Mapping[str, object], *, gpu: str | None, consumer: Consumer | None) -> Preset:
    from sqlalchemy.engine import make_url  # a database driver only for a database source

    import storage
    from api.lookup import measured_groups, measured_preset, one_group

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not (parsed.database and Path(parsed.database).is_file()):
        raise InputError("source", "names no SQLite database file", url)  # never create an empty one
    engine = storage.create_engine_for(url=url)
    try:
        with storage.session_factory(engine=engine)() as session:
            groups = measured_groups(session=session, query=query_for(given, gpu=gpu))
            if groups:
                return measured_preset(one_group(groups), consumer=consumer)
            tuned = [(shape, "stored winners") for shape in storage.tuned_shapes(session=session)]
    finally:
        engine.dispose()
    raise _no_match(parsed.render_as_string(hide_password=True), given, gpu, tuned)


def _from_files(path: Path, given: Mapping[str, object], *, gpu: str | None) -> Preset:
    if not path.exists():
        raise InputError("source", "is neither a preset file or folder, nor a database or controller URL", str(path))
    presets = presets_in(path) if path.is_dir() else [read_preset(path)]
    tuned = [p for p in presets if p.configs and p.shape is not None]
    matching = [p for p in tuned if _file_matches(p, given, gpu)]
    distinct = {json.dumps(to_te_dict(p), sort_keys=True): p for p in matching}  # tune's YAML and JSON agree
    if len(distinct) > 1:
        names = ", ".join(p.source or "?" for p in matching)
        raise InputError("source", f"several different presets match the shape: {names}; pass gpu= or one file")
    if distinct:
        return next(iter(distinct.values()))
    raise _no_match(str(path), given, gpu, [(p.shape, p.source or "?") for p in tuned if p.shape is not None])


def _file_matches(preset: Preset, given: Mapping[str, object], gpu: str | None) -> bool:
    """Whether a file's preset is for the shape: each field its name records that ``given`` names agrees (a
    dtype or GPU the name leaves out agrees with any)."""
    shape = dataclasses.asdict(preset.shape) if preset.shape is not None else {}
    recorded = {k: shape.get(k) for k in FILE_FIELDS} | {"dtype": preset.dtype}
    wanted = {k: v for k, v in ({"mbs": 1} | dict(given)).items() if k in FILE_FIELDS}
    if any(recorded[k] is not None and recorded[k] != v for k, v in wanted.items()):
        return False
    return gpu is None or preset.gpu is None or preset.gpu == (preset_gpu_name(gpu) or gpu.lower())
