"""Local moves: the configs one knob away from a config, for polishing the best one TPE found.

TPE models each knob's good values but, in small discrete spaces, keeps proposing what it already measured
once it believes it knows the answer; the knob next to the best (one more split, the next SM count, the
other GEMM) is then the cheapest way to find the few percent left (Kernel Tuner's greedy local searches
do well on such spaces for the same reason).  Ordered knobs (counts) move one step along their choice
list; flags and names take each other value.  A knob that changes which knobs the tree asks next gets
those knobs from the original config where it has them, else their first choice.
"""

from __future__ import annotations

from typing import Any

from overlap_runtime.config import Method, OverlapConfig, sm_driven_comm
from search_spaces.space import SlotSpace


def family(config: OverlapConfig) -> tuple[Method, bool, bool]:
    """How a config runs, as opposed to how it is tuned: its method, whether the ring is fused into our
    GEMM, and whether the comm runs as SM kernels (NCCL) or on the copy engine.  Configs of one family share
    one timeline and differ in its knobs; configs of two families can be 10-30% apart whatever their knobs."""
    return config.method, config.fused, sm_driven_comm(config)


def neighbours(space: SlotSpace, config: OverlapConfig) -> list[OverlapConfig]:
    """Every config of ``space`` with the same method and one asked knob changed, in knob order."""
    chosen = space.choices_of(config)
    if chosen is None:
        return []
    found: dict[OverlapConfig, None] = {}
    for name, value in chosen.items():
        for other in _moves(space.params[name].choices, value):
            found[_walk(space, config, {**chosen, name: other})] = None
    found.pop(config, None)
    return list(found)


def _moves(choices: tuple, value: object) -> list[object]:
    """The adjacent values of an ordered count, or every other value of a flag or name."""
    index = next(i for i, c in enumerate(choices) if type(c) is type(value) and c == value)
    if all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
        return [choices[i] for i in (index - 1, index + 1) if 0 <= i < len(choices)]
    return [c for i, c in enumerate(choices) if i != index]


def _walk(space: SlotSpace, config: OverlapConfig, wanted: dict[str, Any]) -> OverlapConfig:
    """Walk the tree taking the ``wanted`` value of each knob it asks for (``config``'s, or the first choice)."""
    chosen: dict[str, Any] = {}
    while (param := space.next_param(config.method, chosen)) is not None:
        value = wanted.get(param.name, getattr(config, param.name))
        legal = any(type(value) is type(c) and value == c for c in param.choices)
        chosen[param.name] = value if legal else param.choices[0]
    return space.config(config.method, chosen)
