"""What can be tuned and the formats users already have: layer catalog, legal spaces, TE defaults, presets.

Pure Python + yaml (no torch): the service and the API use it on machines without GPUs.
"""

from overlap_runtime.shape import ModelShape, Slot
from search_spaces.bridge import bridge_file_name, parse_bridge, read_bridge, write_bridge
from search_spaces.catalog import CATALOG, SlotInfo, off_switch, search_methods, slot_info, tunable_slots
from search_spaces.consumers import Consumer
from search_spaces.defaults import as_runnable, te_default
from search_spaces.export import SlotResult, preset_from_results
from search_spaces.formats import (
    FORMATS,
    Exported,
    FormatName,
    PresetFormat,
    parse_te_json,
    presets_in,
    read_file,
    read_preset,
)
from search_spaces.nemo_yaml import parse_file_name, parse_nemo, preset_file_name, read_nemo, te_file_name, write_nemo
from search_spaces.ours import OursPreset, OursSlot, load_ours, ours_file_name, write_ours
from search_spaces.presets import Preset, PresetError, PresetWarning
from search_spaces.registry import PresetRegistry, distance, nearest, nvidia_presets
from search_spaces.space import Param, SlotSpace, slot_space
from search_spaces.te_dict import TE_KEYS, preset_json, te_config, to_te_dict

__all__ = [
    "CATALOG",
    "FORMATS",
    "TE_KEYS",
    "Consumer",
    "Exported",
    "FormatName",
    "ModelShape",
    "OursPreset",
    "OursSlot",
    "Param",
    "Preset",
    "PresetError",
    "PresetFormat",
    "PresetRegistry",
    "PresetWarning",
    "Slot",
    "SlotInfo",
    "SlotResult",
    "SlotSpace",
    "as_runnable",
    "bridge_file_name",
    "distance",
    "load_ours",
    "nearest",
    "nvidia_presets",
    "off_switch",
    "ours_file_name",
    "parse_bridge",
    "parse_file_name",
    "parse_nemo",
    "parse_te_json",
    "preset_file_name",
    "preset_from_results",
    "preset_json",
    "presets_in",
    "read_bridge",
    "read_file",
    "read_nemo",
    "read_preset",
    "search_methods",
    "slot_info",
    "slot_space",
    "te_config",
    "te_default",
    "te_file_name",
    "to_te_dict",
    "tunable_slots",
    "write_bridge",
    "write_nemo",
    "write_ours",
]
