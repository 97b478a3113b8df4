"""Megatron-Bridge / NeMo 2 presets: a Python module of TP-overlap dataclasses, written and read back.

Megatron-Bridge (``megatron/bridge/training/comm_overlap.py``) and NeMo 2
(``nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py``) define a preset as a
``TransformerLayerTPOverlapCfg`` of ``RingExchangeOverlapCfg``, ``PipelineOverlapCfg`` and ``BulkOverlapCfg``,
named ``userbuffers_{bf16|fp8}_{gpu}_h{H}_tp{N}[_cp2]_mbs{M}_seqlen{S}``.  Bridge turns it into TE's
``ub_cfgs`` with ``dataclasses.asdict`` and drops the slots set to None, so every field of an entry's class,
defaults included, reaches TE.  Two traps follow (docs/export.md, Megatron-Bridge modules):

- ``PipelineOverlapCfg.fp8_buf`` defaults to the tuple ``(False,)``, which is truthy: a pipeline entry that
  leaves fp8_buf out gets an FP8 buffer under FP8.  We always write fp8_buf, and read the default as TE does.
- the classes have no field for ``use_ce``, the stream priorities or ``pipeline_rs_overlap_first_gemm``, nor
  slots for the external wgrads.  A preset that needs one gets a dataclass subclass defined in the module
  (``asdict`` takes any dataclass), so nothing is dropped.

Reading parses the module with `ast` and never runs it: only class definitions and literal keyword
arguments count, and each entry then goes through the same strict reader as a YAML entry
(`te_dict.parse_entry`).  Notes become comments; they are not read back.  A preset made for a consumer says
its switches in the docstring (read back) and, for Bridge, as a ``..._model_config`` dict of the model
config's fields.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from overlap_runtime.config import OverlapConfig
from overlap_runtime.knobs import BY_NAME
from overlap_runtime.methods import TE_METHODS, method_spec
from overlap_runtime.shape import Slot
from search_spaces.catalog import SLOT_ORDER
from search_spaces.consumers import Consumer, defaults, parse_switch_record
from search_spaces.methods import SEARCH_SPECS, search_spec
from search_spaces.methods.spec import ENTRY, CfgClass
from search_spaces.nemo_yaml import consumer_header, note_comment, read_text, shape_from_name
from search_spaces.presets import Preset, PresetError, PresetWarning, to_slot
from search_spaces.te_dict import parse_entry, te_defaults, used_keys

BRIDGE_MODULE = "megatron.bridge.training.comm_overlap"
NEMO_MODULE = "nemo.collections.llm.recipes.tp_overlap_configs.userbuffers"
"""Where the classes live: Megatron-Bridge first, NeMo 2's copy of the same classes as the fallback."""

NAME = re.compile(
    r"userbuffers_(?:(?P<dtype>bf16|fp8)_)?(?:(?P<gpu>[a-z][a-z0-9]*)_)?"
    r"h(?P<hidden>\d+)_tp(?P<tp>\d+)(?:_cp(?P<cp>\d+))?_mbs(?P<mbs>\d+)_seqlen(?P<seq>\d+)(?:_lora)?"
)
"""Bridge's preset names (``userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora``); dtype and gpu optional
here, because our presets may not know them."""
UNNAMED = "userbuffers_preset"
"""The variable of a preset whose shape is unknown (its name then says nothing, as it reads back)."""


LAYER = "TransformerLayerTPOverlapCfg"
_LAYER_SLOTS = tuple(slot for slot in SLOT_ORDER if slot not in (Slot.PROJ_WGRAD, Slot.FC2_WGRAD))
_SLOT_NAMES = frozenset(slot.value for slot in Slot)

BRIDGE_CLASSES: Mapping[str, CfgClass] = MappingProxyType(
    {
        c.name: c
        for c in (
            CfgClass(name=ENTRY, base=None, fields={}),
            *(spec.bridge for spec in SEARCH_SPECS.values() if spec.bridge is not None and spec.bridge_defines),
            CfgClass(name=LAYER, base=None, fields=dict.fromkeys((s.value for s in _LAYER_SLOTS), MISSING)),
        )
    }
)
"""Bridge's classes as `comm_overlap.py` defines them (NeMo 2 defines the same)."""

EXTERNAL_LAYER = CfgClass(
    name="TransformerLayerTPOverlapCfgWithExternal",
    base=LAYER,
    fields={Slot.PROJ_WGRAD.value: None, Slot.FC2_WGRAD.value: None},
    doc=f"{LAYER} with the external wgrad slots it lacks (None: left out).",
)
"""Ours, for the external wgrad slots that `TransformerLayerTPOverlapCfg` lacks (None: left out)."""


def all_fields(name: str, classes: Mapping[str, CfgClass]) -> dict[str, Any]:
    """Every field of class ``name``, inherited ones first, as a dataclass orders them."""
    cls = classes[name]
    inherited = {} if cls.base is None else all_fields(cls.base, classes)
    return inherited | dict(cls.fields)


def derives_from(name: str, root: str, classes: Mapping[str, CfgClass]) -> bool:
    cls = classes.get(name)
    return cls is not None and (name == root or (cls.base is not None and derives_from(cls.base, root, classes)))


# -- writing ----------------------------------------------------------------------------------------------


def bridge_name(preset: Preset) -> str:
    """``userbuffers_{dtype}_{gpu}_h{H}_tp{N}[_cp{C}]_mbs{M}_seqlen{S}``, dtype and gpu where known."""
    if preset.shape is None:
        return UNNAMED
    return "_".join(["userbuffers", *(p for p in (preset.dtype, preset.gpu) if p), preset.shape.label()])


def bridge_file_name(preset: Preset) -> str:
    return f"{bridge_name(preset)}.py"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Entry:
    cls: CfgClass
    """The class the entry is written with: Bridge's, or a subclass of it that carries `extras`."""
    values: dict[str, Any]
    """Every field but method, explicitly: defaults differ between Bridge versions, and fp8_buf's is a trap."""


def _entry(slot: Slot, config: OverlapConfig) -> _Entry:
    base = search_spec(config.method).bridge
    assert base is not None, f"{config.method.value} has no Bridge class (a preset holds TE's methods only)"
    fields = all_fields(base.name, {**BRIDGE_CLASSES, base.name: base})
    values: dict[str, Any] = {}
    for name, default in fields.items():
        if name == "method":
            continue
        value = getattr(config, name)
        if value is None and default is MISSING:
            raise PresetError(f"{slot.value}.{name}", f"is required by {base.name} but the preset has no value")
        values[name] = default if value is None else value
    defaults = te_defaults(slot, config.method)
    extras = {
        key: getattr(config, key)
        for key in used_keys(slot, config.method)
        if key not in fields and getattr(config, key) is not None and getattr(config, key) != defaults.get(key)
    }
    if not extras:
        return _Entry(cls=base, values=values)
    name = base.name + "With" + "".join(part.title() for key in extras for part in key.split("_"))
    doc = f"{base.name} with TE ub_cfgs keys it lacks: asdict() passes them to TE like the others."
    cls = CfgClass(name=name, base=base.name, fields=dict.fromkeys(extras, MISSING), doc=doc)
    return _Entry(cls=cls, values=values | extras)


def write_bridge(preset: Preset) -> str:
    """A Python module defining ``preset`` with Megatron-Bridge's (or NeMo 2's) dataclasses; notes as comments."""
    entries = {slot: _entry(slot, config) for slot, config in preset.configs.items()}
    external = any(slot not in _LAYER_SLOTS for slot in entries)
    layer = EXTERNAL_LAYER if external else BRIDGE_CLASSES[LAYER]
    methods = {config.method for config in preset.configs.values()}
    # bases before the subclasses of them: the methods' classes that Bridge lacks first
    ours = [s.bridge for m, s in SEARCH_SPECS.items() if m in methods and s.bridge and not s.bridge_defines]
    ours += [entry.cls for entry in entries.values()] + [layer]
    defined = {cls.name: cls for cls in ours if cls.name not in BRIDGE_CLASSES}
    bases = (cls.base for cls in defined.values() if cls.base is not None)
    used = {LAYER, *bases, *(entry.cls.name for entry in entries.values())}
    imported = sorted(used & BRIDGE_CLASSES.keys())
    name = bridge_name(preset)
    lines = [
        '"""TP comm-GEMM overlap preset for Megatron-Bridge or NeMo 2, written by overlap-autotune.',
        "",
        f"Use: CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg={name}).",
        "Bridge hands dataclasses.asdict() of it to TE's initialize_ub(ub_cfgs=...), so every field reaches TE.",
        *(["", *consumer_header(preset)] if preset.consumer is not None else []),
        '"""',
        "",
    ]
    if defined:
        lines += ["from dataclasses import dataclass", ""]
    names = "".join(f"        {n},\n" for n in imported)
    lines += [
        "try:",
        f"    from {BRIDGE_MODULE} import (\n{names}    )",
        "except ImportError:  # NeMo 2 defines the same classes",
        f"    from {NEMO_MODULE} import (\n{names}    )",
    ]
    for cls in defined.values():
        lines += ["", "", *_class_lines(cls)]
    lines += ["", ""]
    lines += [note_comment(slot, note) for slot, note in preset.notes.items() if slot not in entries]
    lines.append(f"{name} = {layer.name}(")
    for slot in (*_LAYER_SLOTS, Slot.PROJ_WGRAD, Slot.FC2_WGRAD):
        if slot not in entries:
            if slot in _LAYER_SLOTS:  # a required field: None is how Bridge leaves a slot out (LoRA presets)
                lines.append(f"    {slot.value}=None,")
            continue
        if slot in preset.notes:
            lines.append(f"    {note_comment(slot, preset.notes[slot])}")
        entry = entries[slot]
        args = ", ".join(f"{key}={value!r}" for key, value in entry.values.items())
        lines.append(f"    {slot.value}={entry.cls.name}({args}),")
    lines.append(")")
    if preset.consumer in (Consumer.BRIDGE, Consumer.MEGATRON):
        fields = {"tp_comm_overlap": True} | {
            k: v for k, v in preset.setting.items() if v != defaults(preset.consumer)[k]
        }
        lines += [
            "",
            "# The model config's TP-overlap fields this preset was measured with (Bridge leaves them to the model",
            f"# config): for name, value in {name}_model_config.items(): setattr(model_config, name, value)",
            f"{name}_model_config = {fields!r}",
        ]
    return "\n".join(lines) + "\n"


def _class_lines(cls: CfgClass) -> list[str]:
    """A dataclass definition; new required fields after the base's defaulted ones need kw_only."""
    required = any(default is MISSING for default in cls.fields.values())
    lines = [
        "@dataclass(kw_only=True)" if required else "@dataclass",
        f"class {cls.name}({cls.base}):",
        f'    """{cls.doc}"""',
        "",
    ]
    for field, default in cls.fields.items():
        kind = f"{ENTRY} | None" if field in _SLOT_NAMES else BY_NAME[field].value_type.__name__
        lines.append(f"    {field}: {kind}" + ("" if default is MISSING else f" = {default!r}"))
    return lines


# -- reading ----------------------------------------------------------------------------------------------


def read_bridge(path: str | Path, *, name: str | None = None) -> Preset:
    """The preset a Bridge/NeMo 2 module defines (the one called ``name`` when it defines several)."""
    path = Path(path)
    return parse_bridge(read_text(path), name=name, source=path.name)


def parse_bridge(text: str, *, name: str | None = None, source: str | None = None) -> Preset:
    """The preset in module source ``text``, read from its syntax tree: nothing of it runs."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise PresetError("file", f"is not valid Python: {e.msg} (line {e.lineno})") from None
    classes = dict(BRIDGE_CLASSES)
    presets: dict[str, ast.Call] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            _add_class(node, classes)
        elif (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and (target := _assigned(node)) is not None
            and isinstance(call := node.value, ast.Call)
            and isinstance(call.func, ast.Name)
            and derives_from(call.func.id, LAYER, classes)
        ):
            presets[target] = call
    var = _pick(presets, name)
    shape, gpu, dtype = shape_from_name(NAME.fullmatch(var), var)
    configs = _layer(presets[var], classes)
    docstring = ast.get_docstring(tree) or ""
    made_for = next(filter(None, map(parse_switch_record, docstring.splitlines())), None)
    consumer, setting = made_for if made_for is not None else (None, {})
    return Preset(
        configs=configs,
        shape=shape,
        gpu=gpu,
        dtype=dtype,
        source=f"{source}:{var}" if source else var,
        consumer=consumer,
        setting=setting,
    )


def _assigned(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return node.target.id
    return None


def _pick(presets: Mapping[str, ast.Call], name: str | None) -> str:
    if name is not None:
        if name not in presets:
            raise PresetError(
                "preset", f"is not defined in the module; it defines {', '.join(presets) or 'none'}", name
            )
        return name
    if len(presets) != 1:
        if not presets:
            raise PresetError("file", f"defines no {LAYER} preset (a module-level NAME = {LAYER}(...))")
        raise PresetError("preset", f"the module defines several presets; name one of: {', '.join(presets)}")
    return next(iter(presets))


def _add_class(node: ast.ClassDef, classes: dict[str, CfgClass]) -> None:
    """A class of the module that derives from a known one (Bridge's own definitions, or a subclass)."""
    bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
    if len(node.bases) > 1 or (bases and bases[0] not in classes):
        return  # not an overlap class (Bridge's module also defines its CommOverlapConfig)
    if not any(_is_dataclass(d) for d in node.decorator_list):
        if bases:
            raise PresetError(
                node.name, "must be a @dataclass: dataclasses.asdict() drops the fields of a plain subclass"
            )
        return
    if not bases and node.name not in classes:
        return  # an unrelated dataclass
    fields: dict[str, Any] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            where = f"{node.name}.{stmt.target.id}"
            fields[stmt.target.id] = MISSING if stmt.value is None else _literal(where, stmt.value)
    classes[node.name] = CfgClass(name=node.name, base=bases[0] if bases else classes[node.name].base, fields=fields)


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


def _literal(where: str, node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise PresetError(where, "must be a literal (the module is read, never run)", ast.unparse(node)) from None


def _kwargs(where: str, call: ast.Call, fields: Mapping[str, Any], cls: str) -> dict[str, ast.expr]:
    if call.args or any(k.arg is None for k in call.keywords):
        raise PresetError(where, f"give {cls}'s fields as keyword arguments")
    given = {k.arg: k.value for k in call.keywords if k.arg is not None}
    for key in given:
        if key not in fields:
            raise PresetError(f"{where}.{key}", f"is not a field of {cls} (Python raises TypeError)")
    for key, default in fields.items():
        if default is MISSING and key not in given:
            raise PresetError(f"{where}.{key}", f"is required by {cls} (Python raises TypeError)")
    return given


def _layer(call: ast.Call, classes: Mapping[str, CfgClass]) -> dict[Slot, OverlapConfig]:
    cls = call.func.id  # type: ignore[attr-defined]
    given = _kwargs(cls, call, all_fields(cls, classes), cls)
    configs: dict[Slot, OverlapConfig] = {}
    for key, value in given.items():
        slot = to_slot(key)
        if isinstance(value, ast.Constant) and value.value is None:
            continue  # Bridge drops None slots before TE sees them
        if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
            raise PresetError(slot.value, "must be an overlap config such as RingExchangeOverlapCfg(...) or None")
        if not derives_from(value.func.id, ENTRY, classes):
            raise PresetError(slot.value, f"must be a {ENTRY} dataclass", value.func.id)
        configs[slot] = _slot_entry(slot, value, classes)
    return configs


def _slot_entry(slot: Slot, call: ast.Call, classes: Mapping[str, CfgClass]) -> OverlapConfig:
    """The ub_cfgs entry asdict() hands TE, minus the defaults TE ignores for the slot, read strictly."""
    cls = call.func.id  # type: ignore[attr-defined]
    fields = all_fields(cls, classes)
    given = {k: _literal(f"{slot.value}.{k}", v) for k, v in _kwargs(slot.value, call, fields, cls).items()}
    method = given.get("method", fields.get("method", MISSING))
    if method is MISSING:
        raise PresetError(f"{slot.value}.method", f"{cls} has no method field (TE needs one)")
    entry = dict(given) | {"method": method}
    for key, default in fields.items():
        if key not in entry and _te_reads(slot, method, key):
            entry[key] = default  # asdict passes defaults too: TE runs them over its own
    fp8 = entry.get("fp8_buf")  # a tuple only by Bridge's default (or a copy of it)
    if isinstance(fp8, tuple):
        warnings.warn(
            f"{slot.value}.fp8_buf: {fp8!r} is truthy (PipelineOverlapCfg's default is the tuple (False,)), "
            "so TE gives this entry an FP8 buffer under FP8; write fp8_buf=False or True",
            PresetWarning,
            stacklevel=3,
        )
        entry["fp8_buf"] = bool(fp8)
    return parse_entry(slot, entry)


def _te_reads(slot: Slot, method: object, key: str) -> bool:
    """Whether a field left at its class default changes what TE runs: a key the method reads (fp8_buf only
    for the methods that take it, pipeline: TE sets it itself for the others).  asdict passes the rest too,
    and TE ignores them."""
    if not isinstance(method, str) or method not in TE_METHODS:
        return False  # parse_entry names the bad method
    if key == "fp8_buf":
        return key in method_spec(method).takes
    return key in used_keys(slot, method_spec(method).method)
