"""The ``te`` backend: a slot measured through TransformerEngine itself, under the same contract.

Where our runtime (`harness`) runs TE's methods itself, this backend runs TE: per config it calls
``initialize_ub`` with the config's ``ub_cfgs`` entry, then the slot's ``te.Linear`` (column-parallel for qkv
and fc1, row-parallel for proj and fc2, sequence parallel, the slot's userbuffers flag; `te_args` has the whole
translation), forward for the fprop slots, backward for the dgrad and wgrad slots.  Per config and round it
times, interleaved as the harness does (A B C gemm comm serial ...):

- ``overlap_ms``: the module with userbuffers (method none: without, i.e. the serial path);
- ``gemm_ms``: the one GPU's ``te.Linear`` of the same per-rank GEMMs, every token, no tensor parallelism
  (`te_args.local_linear`): TE's GEMMs alone, with the module's own overhead, as the overlapped call has it;
- ``comm_ms``: the slot's NCCL all-gather or reduce-scatter of the [T, H] buffer alone;
- ``serial_ms``: the same TP module without userbuffers: TE's NCCL collectives and GEMMs back to back.

The output (forward: y; backward: dX and dW) is checked against the module without userbuffers on the same
weights and inputs.  Only one set of userbuffers exists per process, so a batch of configs re-initializes
them whenever the config changes (``destroy_ub`` then ``initialize_ub``); a config measured again with the
same entry reuses them, and method none and the baselines run on whatever is initialized (their modules read
no userbuffers).  The time spent is each measurement's ``ub_init_ms``.

Ranks run in the project's TP group (`group.TPGroup`, NCCL) with `te_args.TE_ENV` set before torch loads:
``UB_SKIPMC=1`` (never multicast), ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (TE's ordering on Hopper),
``NCCL_NVLS_ENABLE=0``.  Torch and TE are imported inside the ranks only; without TE, `require_te` fails at
once with what to install.

`te_layer_step_ms` times a whole ``te.TransformerLayer`` step (forward and backward) for ``autotune validate``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from overlap_runtime.config import OverlapConfig, check_config, problem
from overlap_runtime.errors import InputError
from overlap_runtime.group import RankContext, TPGroup
from overlap_runtime.knobs import TE
from overlap_runtime.measurement import REL_ERR_LIMIT, Baselines, BaselineSource, Measurement
from overlap_runtime.methods import BASELINE
from overlap_runtime.runtime import Runtime
from overlap_runtime.shape import Collective, ModelShape, Slot, SlotGemm
from overlap_runtime.te_args import (
    TE_ENV,
    LinearCall,
    Pass,
    layer_input_shape,
    layer_kwargs,
    local_linear,
    te_linear,
    ub_cfgs,
    ub_init,
)

INSTALL_HINT = (
    "the te backend needs TransformerEngine for PyTorch: pip install --no-build-isolation "
    "'transformer-engine[pytorch]' (it builds against this host's torch), or run in an NGC PyTorch container "
    "(nvcr.io/nvidia/pytorch), which ships it; a GPU host without network: bench/te_install.sh"
)
_DISTRIBUTIONS = ("transformer-engine", "transformer-engine-torch", "transformer_engine")
"""Where TE's version is recorded, first found wins (pip's meta package, the extension, a source build)."""
CHECK_CALLS = 2
"""Calls the numerical check compares (on different inputs)."""
MIN_SETS = 2
MAX_SETS = 8
ROTATE_BYTES = 128 << 20
"""Inputs rotate as in the harness: at least two sets, enough to cover twice an H200's L2 where they fit."""


def te_version() -> str | None:
    """The installed TE's version, None without TE; looks the package up without importing it (no CUDA).
    Its PyTorch extension is not looked for: some installs load it from inside the package (older recipes
    copied it into ``transformer_engine/wheel_lib``), so a broken one shows when the ranks import
    ``transformer_engine.pytorch``: a failed trial naming the error (`bench/te_check.py` checks the import)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def require_te() -> str:
    """TE's version; `InputError` saying what to install when TE is missing."""
    version = te_version()
    if version is None:
        raise InputError("backend", INSTALL_HINT, TE)
    return version


class TeRuntime(Runtime):
    """`Runtime`'s interface on the te backend: one TP group of GPUs, a config measured through TE."""

    backends = (TE,)

    def __init__(self, *, tp: int, trial_timeout_s: float = 180.0) -> None:
        self.te_version = require_te()
        super().__init__(tp=tp, backend=TE, trial_timeout_s=trial_timeout_s)

    def _group(self) -> TPGroup:
        return te_group(self.tp)

    def _measure_task(self) -> Callable[..., list[Measurement]]:
        return te_measure_task


def te_group(tp: int) -> TPGroup:
    """A TP group of ``tp`` GPUs whose ranks run under `te_args.TE_ENV`."""
    return TPGroup(tp=tp, backend="cuda", env=TE_ENV)


# --- inside the ranks -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Userbuffers:
    """This process's userbuffers: which ``ub_cfgs`` they were initialized with (None: none yet)."""

    current: dict[str, Any] | None = None

    def ensure(self, shape: ModelShape, cfgs: dict[str, Any] | None) -> float:
        """Initialize userbuffers for ``cfgs`` unless they are; the milliseconds spent (0 when reused).
        ``cfgs`` None (method none, the baselines) needs none and keeps what is there."""
        if cfgs is None or cfgs == self.current:
            return 0.0
        import torch
        from transformer_engine.pytorch.module import base

        torch.cuda.synchronize()
        start = time.perf_counter()
        if self.current is not None:
            base.destroy_ub()
        self.current = None
        kwargs = ub_init(shape, cfgs).kwargs()
        base.initialize_ub(**kwargs | {"dtype": getattr(torch, kwargs["dtype"])})
        torch.cuda.synchronize()
        self.current = cfgs
        return (time.perf_counter() - start) * 1e3


def _userbuffers(ctx: RankContext) -> _Userbuffers:
    return ctx.state.setdefault("te_userbuffers", _Userbuffers())


@dataclass(kw_only=True)
class Calls:
    """One ``te.Linear`` called on rotating inputs: `before` hands it the next ones (and, for a backward
    slot, runs the forward), `run` is the timed call, `outputs` what the check compares."""

    module: Any
    call: LinearCall
    sets: list[tuple[Any, Any]]
    turn: int = 0
    x: Any = None
    y: Any = None
    dy: Any = None

    def before(self) -> None:
        x, self.dy = self.sets[self.turn % len(self.sets)]
        self.turn += 1
        if self.call.pass_ == Pass.FORWARD:
            self.x = x
            return
        self.x = x.detach().requires_grad_()
        self.module.weight.grad = None
        self.y = self.module(self.x)

    def run(self) -> None:
        if self.call.pass_ == Pass.FORWARD:
            import torch

            with torch.no_grad():
                self.y = self.module(self.x)
        else:
            self.y.backward(self.dy)

    def outputs(self) -> list[Any]:
        if self.call.pass_ == Pass.FORWARD:
            return [self.y]
        return [self.x.grad, self.module.weight.grad]


@dataclass(kw_only=True)
class _Collective:
    """The slot's collective alone on rotating [T, H] buffers: `comm_ms`."""

    collective: Collective
    sets: list[tuple[Any, Any]]
    """(input, output) pairs."""
    turn: int = 0

    def before(self) -> None:
        self.turn += 1

    def run(self) -> None:
        import torch.distributed as dist

        inp, out = self.sets[self.turn % len(self.sets)]
        if self.collective == Collective.ALL_GATHER:
            dist.all_gather_into_tensor(out, inp)
        else:
            dist.reduce_scatter_tensor(out, inp)


def _n_sets(*shapes: tuple[int, ...]) -> int:
    set_bytes = sum(math.prod(s) for s in shapes) * 2
    return max(MIN_SETS, min(MAX_SETS, math.ceil(ROTATE_BYTES / set_bytes)))


def _rand(gen: Any, shape: tuple[int, ...], device: Any) -> Any:
    import torch

    # Scaled so the products stay O(1) whatever the inner size.
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / math.sqrt(shape[-1])).to(
        torch.bfloat16
    )


@dataclass(kw_only=True)
class _Slot:
    """One slot's modules on this rank, built once per process and shape: they share one weight shard."""

    shape: ModelShape
    slot: Slot
    seed: int
    weight: Any
    calls: dict[LinearCall, Calls] = field(default_factory=dict)

    def calls_of(self, ctx: RankContext, call: LinearCall) -> Calls:
        """The module of ``call``, built on first use; modules whose inputs have the same shapes (the slot's
        TP modules, with userbuffers and without) share one list of them, so the check compares like with like."""
        if call not in self.calls:
            shapes = (call.input_shape, call.grad_shape)
            sets = next(
                (c.sets for c in self.calls.values() if (c.call.input_shape, c.call.grad_shape) == shapes), None
            )
            seed = self.seed * 1000 + ctx.rank + 1
            self.calls[call] = linear_calls(call, self.weight, device=ctx.device, seed=seed, sets=sets)
        return self.calls[call]


def linear_calls(call: LinearCall, weight: Any, *, device: Any, seed: int, sets: list | None = None) -> Calls:
    """``call``'s ``te.Linear`` holding ``weight`` (this rank's shard), on ``sets`` of (input, grad) or on
    rotating random ones seeded by ``seed``; a module with ``tp_size`` above 1 runs on the default process group."""
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te

    group = dist.group.WORLD if call.tp_size > 1 else None
    module = te.Linear(**call.kwargs(), tp_group=group, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        module.weight.copy_(weight)
    if sets is None:
        gen = torch.Generator(device=device).manual_seed(seed)
        n = _n_sets(call.input_shape, call.grad_shape)
        sets = [(_rand(gen, call.input_shape, device), _rand(gen, call.grad_shape, device)) for _ in range(n)]
    return Calls(module=module, call=call, sets=sets)


def random_weight(call: LinearCall, *, device: Any, seed: int) -> Any:
    """A random bf16 weight of ``call``'s one-GPU module (`te_args.local_linear`): the per-rank shard that
    the TP modules of the slot hold too."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return _rand(gen, (call.out_features, call.in_features), device)


def _slot_modules(ctx: RankContext, shape: ModelShape, slot: Slot, seed: int) -> _Slot:
    """The slot's modules, the latest slot's only (a new slot frees the last one's weights and inputs)."""
    held = ctx.state.get("te_slot")
    if held is None or (held.shape, held.slot, held.seed) != (shape, slot, seed):
        weight = random_weight(local_linear(shape, slot), device=ctx.device, seed=seed * 1000 + ctx.rank)
        held = _Slot(shape=shape, slot=slot, seed=seed, weight=weight)
        ctx.state["te_slot"] = held
    return held


@dataclass(kw_only=True)
class _Problem:
    """One problem's baselines (`harness`'s order: gemm, comm, serial)."""

    gemm: Calls
    comm: _Collective
    serial: Calls
    timed: dict[str, Any]

    def time(self, ctx: RankContext, dev: Any, **timing: int) -> None:
        for name in ("gemm", "comm", "serial"):
            calls = getattr(self, name)
            self.timed[name].time_calls(ctx, dev, calls.before, calls.run, **timing)

    def baselines(self, collective: Collective, source: BaselineSource) -> Baselines:
        return Baselines(source=source, collective=collective, **{n: t.series() for n, t in self.timed.items()})


def _problem(ctx: RankContext, held: _Slot, gemm: SlotGemm) -> _Problem:
    import torch

    from overlap_runtime.harness import Timed

    t, h, p = gemm.tokens, gemm.hidden, gemm.tp
    gen = torch.Generator(device=ctx.device).manual_seed(held.seed * 1000 + ctx.rank + 7)
    full, shard = (t, h), (t // p, h)
    ins, outs = (shard, full) if gemm.collective == Collective.ALL_GATHER else (full, shard)
    sets = [
        (_rand(gen, ins, ctx.device), torch.empty(outs, device=ctx.device, dtype=torch.bfloat16))
        for _ in range(_n_sets(ins, outs))
    ]
    return _Problem(
        gemm=held.calls_of(ctx, local_linear(held.shape, held.slot)),
        comm=_Collective(collective=gemm.collective, sets=sets),
        serial=held.calls_of(ctx, te_linear(held.shape, held.slot, BASELINE)),
        timed={name: Timed() for name in ("gemm", "comm", "serial")},
    )


@dataclass(kw_only=True)
class _Candidate:
    config: OverlapConfig
    gemm: SlotGemm
    calls: Calls
    cfgs: dict[str, Any] | None
    timed: Any
    ub_ms: float = 0.0
    rel_err: float = math.nan


def te_measure_task(
    ctx: RankContext,
    shape: ModelShape,
    slot: Slot,
    configs: list[OverlapConfig],
    *,
    repeats: int = 20,
    warmup: int = 5,
    rounds: int = 1,
    seed: int = 0,
    baselines: BaselineSource = BaselineSource.SAME_ROUNDS,
) -> list[Measurement]:
    """`harness.measure_task`'s contract, through TE (module docstring); every rank returns the list (each
    takes part in `_slowest`'s collective), and the caller reads rank 0's."""
    from overlap_runtime.harness import Timed, device_of, limits_task

    dev = device_of(ctx)
    limits = limits_task(ctx)
    ub = _userbuffers(ctx)
    held = _slot_modules(ctx, shape, Slot(slot), seed)
    candidates = []
    for config in configs:
        gemm = problem(shape, Slot(slot), config.method)
        check_config(config, gemm, backend=TE, limits=limits)
        calls = held.calls_of(ctx, te_linear(shape, Slot(slot), config.method))
        candidates.append(
            _Candidate(config=config, gemm=gemm, calls=calls, cfgs=ub_cfgs(Slot(slot), config), timed=Timed())
        )
    reference = held.calls_of(ctx, te_linear(shape, Slot(slot), BASELINE))
    for c in candidates:
        c.ub_ms += ub.ensure(shape, c.cfgs)
        c.rel_err = _check_numerics(dev, c.calls, reference)
    problems: dict[SlotGemm, _Problem] = {}
    for c in candidates:
        if c.gemm not in problems:
            problems[c.gemm] = _problem(ctx, held, c.gemm)
    timing = {"repeats": repeats, "warmup": warmup}
    same_rounds = baselines == BaselineSource.SAME_ROUNDS
    for _ in range(rounds):
        for c in candidates:
            c.ub_ms += ub.ensure(shape, c.cfgs)
            c.timed.time_calls(ctx, dev, c.calls.before, c.calls.run, **timing)
        for p in problems.values() if same_rounds else ():
            p.time(ctx, dev, **timing)
    scored = {}
    for gemm, p in problems.items():
        if same_rounds:
            scored[gemm] = p.baselines(gemm.collective, BaselineSource.SAME_ROUNDS)
        else:
            scored[gemm] = _cached(ctx, dev, p, gemm, seed, timing)
    limit = REL_ERR_LIMIT["bf16"]
    return [
        replace(
            Measurement.measured(
                overlap=c.timed.series(),
                baselines=scored[c.gemm],
                rel_err=c.rel_err,
                valid=math.isfinite(c.rel_err) and c.rel_err <= limit,
            ),
            ub_init_ms=_slowest(dev, c.ub_ms),
        )
        for c in candidates
    ]


def _check_numerics(dev: Any, calls: Calls, reference: Calls) -> float:
    """Worst-rank relative error of ``calls`` against the module without userbuffers, on the same inputs."""
    from overlap_runtime.harness import relative_error

    got, want = [], []
    for _ in range(CHECK_CALLS):
        turn = calls.turn
        for which, into in ((reference, want), (calls, got)):
            which.turn = turn  # both on the same input set
            which.before()
            which.run()
            into += [t.detach().clone() for t in which.outputs()]
    dev.synchronize()
    return relative_error(dev, got, want)


def _cached(ctx: RankContext, dev: Any, p: _Problem, gemm: SlotGemm, seed: int, timing: dict) -> Baselines:
    """The problem's baselines timed once per process (search trials), as `harness` caches its own."""
    cache = ctx.state.setdefault("te_baselines", {})
    key = (gemm, seed)
    if key not in cache:
        p.time(ctx, dev, **timing)
        cache[key] = p.baselines(gemm.collective, BaselineSource.CACHED)
    return cache[key]


def _slowest(dev: Any, ms: float) -> float:
    """The slowest rank's ``ms`` (every rank initializes its userbuffers; the group waits for the last)."""
    import torch
    import torch.distributed as dist

    worst = torch.tensor([ms], dtype=torch.float64, device=dev.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


# --- a whole layer, for `autotune validate` -------------------------------------------------------------


def te_layer_step_ms(
    shape: ModelShape,
    ub_cfgs: Mapping[str, Mapping[str, Any]] | None,
    *,
    steps: int,
    warmup: int,
    group: TPGroup | None = None,
    flags: Mapping[str, bool] | None = None,
) -> list[float]:
    """Per-step times (ms, the slowest rank's) of one ``te.TransformerLayer`` forward and backward on a TP
    group of ``shape.tp`` GPUs, sequence parallel, with ``ub_tp_comm_overlap`` and ``ub_cfgs`` (None: no
    userbuffers; ``{}``: TE's default config for every slot), and the ``ub_*`` arguments ``flags`` where given
    (a consumer's switches), else those ``ub_cfgs`` implies (`te_args.layer_kwargs`).

    Userbuffers are re-initialized for every call (destroy, then ``initialize_ub``), so each variant runs on
    its own; the layer's weights and inputs are built once per group and shape.  Pass the same ``group``
    (`te_group`) to interleave variants without starting processes each time (A B C A B C ...: a call per
    variant and round); without one, a group is started and closed around the call.  `TrialFailure` if the
    group hangs or crashes; `InputError` without TE (`require_te`)."""
    require_te()
    if steps < 1 or warmup < 0:
        raise InputError("steps", "must be at least 1, with warmup at least 0", (steps, warmup))
    owned = group is None
    group = group or te_group(shape.tp)
    try:
        cfgs = None if ub_cfgs is None else {k: dict(v) for k, v in ub_cfgs.items()}
        given = None if flags is None else dict(flags)
        return group.run(_layer_task, shape, cfgs, given, steps=steps, warmup=warmup, timeout_s=600.0)[0]
    finally:
        if owned:
            group.close()


def _layer_task(
    ctx: RankContext,
    shape: ModelShape,
    cfgs: dict[str, Any] | None,
    flags: dict[str, bool] | None,
    *,
    steps: int,
    warmup: int,
) -> list[float]:
    import torch
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.module import base

    from overlap_runtime.harness import device_of, time_calls

    dev = device_of(ctx)
    ub = _userbuffers(ctx)
    if ub.current is not None:
        base.destroy_ub()  # re-initialized for every variant, even one measured just before
        ub.current = None
    ub.ensure(shape, cfgs)
    kwargs = layer_kwargs(shape, cfgs, flags)
    key = (shape, tuple(kwargs.items()))  # one layer per set of userbuffers flags (RS-dgrad or bulk, or none)
    layers = ctx.state.setdefault("te_layers", {})
    if key not in layers:
        torch.manual_seed(1234)  # the same weights whatever the flags
        layer = te.TransformerLayer(**kwargs, tp_group=dist.group.WORLD, params_dtype=torch.bfloat16, device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
        x = torch.randn(layer_input_shape(shape), generator=gen, device=ctx.device, dtype=torch.bfloat16)
        layers[key] = (layer, x, torch.randn_like(x))
    layer, x, dy = layers[key]

    inp: list[Any] = []

    def before() -> None:
        layer.zero_grad(set_to_none=True)
        inp[:] = [x.detach().requires_grad_()]

    return time_calls(dev, before, lambda: layer(inp[0]).backward(dy), repeats=steps, warmup=warmup)
