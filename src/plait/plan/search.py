"""Layout search: every valid parallel layout of a model on ``world`` devices, ranked by estimated
step time among those that fit in device memory.

:func:`enumerate_layouts` lists the candidates, :func:`rank_layouts` prices each one with the
memory model (:func:`plait.plan.memory.estimate_memory`) and the time model
(:func:`plait.plan.timing.estimate_step_time`) and recommends the fastest that fits.

Rules of the enumeration (one :class:`~plait.plan.degrees.ParallelDegrees` per combination):

* ``tp`` divides ``devices_per_node`` (a TP group stays inside one node, on the fast links) and
  the world; the heads must place over it (:meth:`HeadLayout.plan`, padding allowed) and it must
  divide ``intermediate_size`` (the MLP split has no padding).
* ``kv_replication``: every factor :meth:`HeadLayout.valid_replications` allows for that ``tp``
  (``SearchOptions.all_kv_replications=False``: only the automatic one).
* ``pp`` divides ``world / tp`` and ``pp * vpp <= num_hidden_layers`` (every stage holds a block);
  ``dp = world / (tp * pp)``.
* micro-batches: with ``microbatches`` given, every layout runs that many per step (the global
  batch then grows with ``dp``); otherwise the global batch is fixed in sequences and
  ``m = global_batch / (dp * micro_batch_size)``, which must be a whole number (layouts whose
  ``dp * micro_batch_size`` does not divide the global batch are skipped). The default global
  batch is :data:`DEFAULT_TOKENS_PER_STEP` tokens (4 Mi, Llama 3's initial batch) in sequences of
  ``seq_len``, at most :data:`DEFAULT_MAX_SEQUENCES` sequences (512 at ``seq_len`` 8192, 1024 at
  4096 and below).
* schedule: ``pp == 1``: none (recorded as ``"1f1b"``, vpp 1); ``pp > 1, vpp == 1``: ``"1f1b"``
  (and ``"gpipe"`` when asked for); ``vpp == 2``: ``"interleaved-1f1b"``, which needs ``m``
  divisible by ``pp`` (:func:`~plait.pipeline.schedules.validate_schedule` decides).
* ``sequence_parallel`` on whenever ``tp > 1`` (and ``seq_len / cp % tp == 0``); MoE models try it
  off and on (it saves the expert work each TP rank repeats without it, and costs one TP all-reduce
  of every MoE parameter's gradient per micro-batch), and only off with
  ``SearchOptions.moe_sequence_parallel=False`` (plait refuses ``moe.capacity_factor`` with it);
  ZeRO levels 0-3 when ``dp * cp > 1`` (3 not with a zero-bubble schedule at ``pp > 1``);
  ``activation_checkpointing`` ``"none"`` and
  ``"full"``.
* ``cp`` (context parallelism): 1, and for ``seq_len >= LONG_SEQ`` also 2, 4, 8, 16 where
  ``seq_len % (2 * cp) == 0`` and ``tp * cp`` divides the world (``SearchOptions.context_parallel``
  fixes the list); ``pp`` then divides ``world / (tp * cp)`` and ``dp = world / (tp * pp * cp)``.
* ``ep`` (MoE families): every divisor of the expert count that divides ``dp`` (expert parallelism
  folds over data parallelism), 1 when ``cp > 1`` (plait refuses both); ``SearchOptions.expert_parallel``
  fixes the list. Dense models: 1.

Ranking: by seconds per sequence of the global batch (the step time when the global batch is
fixed, the default), then by peak memory. A layout fits when its per-rank total is at most the
budget, ``device memory * (1 - headroom)`` with a 10% headroom by default (allocator
fragmentation, CUDA context, NCCL's own buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from plait.devices import DeviceError, DeviceSpec, get_device
from plait.models.decoder.config import DecoderConfig
from plait.models.registry import family_of
from plait.pipeline.partition import partition_model, unit_costs
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES, ScheduleError, validate_schedule
from plait.plan.adapters import AdapterPlan
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import MemoryBreakdown, estimate_memory, precision_bytes
from plait.plan.moe import MoEShape, moe_shape
from plait.plan.timing import TimeBreakdown, estimate_step_time
from plait.tensor_parallel.heads import HeadLayout, HeadLayoutError

#: default global batch, in tokens, when neither a global batch nor micro-batches are given
DEFAULT_TOKENS_PER_STEP = 4 * 1024 * 1024
#: cap of the default global batch in sequences (short-sequence models would get huge batches)
DEFAULT_MAX_SEQUENCES = 1024
DEFAULT_HEADROOM = 0.10
DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b")
#: from this sequence length on, the search also tries context parallelism
LONG_SEQ = 16384


class PlanError(ValueError):
    """No layout can run (bad world), none fits the memory budget, or a bad device/option.

    ``plan``: when no layout fits the budget, the ranked candidates (for a report of the
    nearest misses); ``None`` otherwise.
    """

    plan: Plan | None = None


@dataclass(frozen=True)
class SearchOptions:
    """What the enumeration may vary (the defaults vary everything the brief lists)."""

    #: pipeline schedules tried when ``pp > 1`` (``"gpipe"`` may be added, it never beats 1F1B here; the
    #: zero-bubble ``"zb-h1"``/``"interleaved-zb"`` too, priced without their deferred W working sets)
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    #: largest number of virtual stages per pipeline rank (interleaved schedule)
    max_vpp: int = 2
    activation_checkpointing: tuple[str, ...] = ("none", "full")
    #: try the ZeRO levels of ``zero_levels`` when dp > 1 (False: level 0 only)
    try_zero1: bool = True
    #: the ZeRO levels tried when dp > 1
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    #: optimizer offload choices tried (``(False, True)``: also every layout with the fp32 master and
    #: moments in host memory; not with bf16-pure, which has no fp32 master)
    offload: tuple[bool, ...] = (False,)
    #: every valid KV replication factor (False: only the automatic, smallest one)
    all_kv_replications: bool = True
    kv_placement: str = "interleaved"
    #: upper bounds on the degrees (``None``: no bound beyond the rules)
    max_tp: int | None = None
    max_pp: int | None = None
    #: the pipeline split the estimates assume (``parallel.partition`` / ``partition_cost``;
    #: manual cuts name a fixed stage count, so the search cannot use them)
    partition: str = "balanced"
    partition_cost: str = "flops"
    #: context-parallel degrees tried (``None``: 1, and 2, 4, 8, 16 when ``seq_len`` is at least
    #: :data:`LONG_SEQ`; each must divide the world and give ``seq_len % (2 * cp) == 0``)
    context_parallel: tuple[int, ...] | None = None
    #: expert-parallel degrees tried (MoE): ``None`` every divisor of the expert count that divides
    #: the layout's dp (EP folds over data parallelism); an int or a tuple fixes them (a layout whose
    #: dp none of them divides is skipped). Dense models: 1.
    expert_parallel: int | tuple[int, ...] | None = None
    #: MoE: try sequence parallelism (off and on) when tp > 1; False keeps it off (a recipe with
    #: ``moe.capacity_factor``, which plait refuses with sequence parallelism). Dense models: unused.
    moe_sequence_parallel: bool = True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_global_batch(seq_len: int) -> int:
    """:data:`DEFAULT_TOKENS_PER_STEP` tokens in sequences of ``seq_len``, between 1 and
    :data:`DEFAULT_MAX_SEQUENCES` sequences."""
    return max(1, min(DEFAULT_TOKENS_PER_STEP // seq_len, DEFAULT_MAX_SEQUENCES))


def layout_microbatches(layout: ParallelDegrees, *, micro_batch_size: int, microbatches: int | None = None,
                        global_batch_size: int | None = None, seq_len: int | None = None) -> int | None:
    """Micro-batches per step of ``layout`` under the rule of the module docstring (``None``: the
    global batch does not split into whole micro-batches over this layout's DP ranks)."""
    if microbatches is not None:
        return microbatches
    if global_batch_size is None:
        if seq_len is None:
            raise PlanError("give microbatches, global_batch_size or seq_len")
        global_batch_size = default_global_batch(seq_len)
    per_step = layout.dp * micro_batch_size
    if global_batch_size % per_step:
        return None
    return global_batch_size // per_step


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")


class _Reasons:
    """Why candidate degrees were rejected, for the error of a world with no layout at all."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)

    def summary(self, limit: int = 8) -> str:
        shown = self.items[:limit]
        more = len(self.items) - len(shown)
        return "; ".join(shown) + (f"; ... ({more} more)" if more > 0 else "")


def _head_check(config: DecoderConfig, tp: int, placement: str) -> tuple[list[int], int] | str:
    """``(valid kv replication factors, automatic factor)`` for ``tp``, or a reason string."""
    c = config
    try:
        auto = HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp, None, placement)
    except HeadLayoutError as e:
        return f"tp={tp}: {e}"
    if c.intermediate_size % tp:
        return f"tp={tp} does not divide intermediate_size={c.intermediate_size}"
    valid = []
    for m in HeadLayout.valid_replications(c.num_attention_heads, c.num_key_value_heads, tp):
        try:
            HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, tp, m, placement)
        except HeadLayoutError:
            continue
        valid.append(m)
    return valid, auto.kv_replication


def _enumerate(config: DecoderConfig, world: int, *, devices_per_node: int, micro_batch_size: int, seq_len: int,
               microbatches: int | None, global_batch_size: int | None,
               options: SearchOptions) -> tuple[list[tuple[ParallelDegrees, int]], _Reasons]:
    reasons = _Reasons()
    out: list[tuple[ParallelDegrees, int]] = []
    layers = config.num_hidden_layers
    tps = [t for t in _divisors(devices_per_node) if world % t == 0
           and (options.max_tp is None or t <= options.max_tp)]
    skipped_tp = [t for t in _divisors(devices_per_node) if world % t]
    if skipped_tp and len(tps) <= 1:
        reasons.add(f"tp must divide both devices_per_node={devices_per_node} and the world, which leaves "
                    f"tp in {tps}")
    if options.context_parallel is not None:
        cps = list(options.context_parallel)
    else:
        cps = [1] + ([c for c in (2, 4, 8, 16) if seq_len % (2 * c) == 0] if seq_len >= LONG_SEQ else [])
    for tp, cp in ((t, c) for t in tps for c in cps):
        if world % (tp * cp) or seq_len % (2 * cp if cp > 1 else 1):
            reasons.add(f"cp={cp} with tp={tp}: tp*cp must divide the world {world} and 2*cp the seq_len {seq_len}")
            continue
        heads = _head_check(config, tp, options.kv_placement)
        if isinstance(heads, str):
            reasons.add(heads)
            continue
        valid_kv, auto_kv = heads
        kv_factors = valid_kv if options.all_kv_replications else [auto_kv]
        moe = moe_shape(config)
        sps = _sequence_parallel_choices(tp, seq_len // cp, moe, options)
        for pp in _divisors(world // (tp * cp)):
            if options.max_pp is not None and pp > options.max_pp:
                continue
            if pp > layers:
                reasons.add(f"pp={pp} (tp={tp}) exceeds the {layers} decoder layers")
                continue
            dp = world // (tp * pp * cp)
            eps = [e for e in _expert_degrees(moe, options) if dp % e == 0 and (e == 1 or cp == 1)]
            if not eps:
                reasons.add(f"tp={tp} pp={pp} cp={cp} gives dp={dp}, which parallel.ep={options.expert_parallel} does "
                            f"not divide (expert parallelism folds over data parallelism; not with cp > 1)")
                continue
            probe = ParallelDegrees(tp=tp, pp=pp, dp=dp, cp=cp)
            m = layout_microbatches(probe, micro_batch_size=micro_batch_size, microbatches=microbatches,
                                    global_batch_size=global_batch_size, seq_len=seq_len)
            if m is None:
                g = global_batch_size or default_global_batch(seq_len)
                reasons.add(f"tp={tp} pp={pp} gives dp={dp}, and dp*micro_batch_size={dp}*{micro_batch_size} "
                            f"does not divide the global batch of {g} sequences")
                continue
            pipeline: list[tuple[int, str]] = []
            if pp == 1:
                pipeline.append((1, "1f1b"))
            else:
                for name in options.schedules:
                    vpps = range(2, options.max_vpp + 1) if name in INTERLEAVED_SCHEDULES else (1,)
                    for vpp in vpps:
                        if pp * vpp > layers:
                            reasons.add(f"pp*vpp={pp}*{vpp} exceeds the {layers} decoder layers")
                            continue
                        try:
                            validate_schedule(name, pp, m, vpp)
                        except ScheduleError as e:
                            reasons.add(f"tp={tp} pp={pp} vpp={vpp}: {e}")
                            continue
                        pipeline.append((vpp, name))
            for vpp, schedule in pipeline:
                for kv in kv_factors:
                    for ep, sp in ((e, s) for e in eps for s in sps):
                        for zero in _zero_levels(dp * cp, pp, schedule, options):
                            for ckpt, offload in ((c, o) for c in options.activation_checkpointing
                                                  for o in options.offload):
                                out.append((ParallelDegrees(tp=tp, pp=pp, dp=dp, vpp=vpp, kv_replication=kv,
                                                   sequence_parallel=sp, zero=zero, activation_checkpointing=ckpt,
                                                   schedule=schedule, cp=cp, ep=ep, offload=offload), m))
    return out, reasons


def _zero_levels(dp: int, pp: int, schedule: str, options: SearchOptions) -> tuple[int, ...]:
    """The ZeRO levels to try: none at dp = 1 (nothing to shard); level 3 not with a zero-bubble
    schedule across pipeline stages, which recipes refuse (its deferred weight gradients)."""
    if dp == 1 or not options.try_zero1:
        return (0,)
    split_backward = schedule in ("zb-h1", "interleaved-zb")
    return tuple(z for z in options.zero_levels if not (z == 3 and pp > 1 and split_backward))


def _sequence_parallel_choices(tp: int, local_seq: int, moe: MoEShape | None,
                               options: SearchOptions) -> tuple[bool, ...]:
    """Sequence parallelism for a TP degree (module rules): a dense model always takes it when the
    rank's sequence splits over ``tp`` (it saves activations and costs little TP traffic); an MoE
    model tries it off and on (it also saves the repeated expert work, but sums every MoE
    parameter's gradient over TP in each micro-batch's backward), only off with
    ``options.moe_sequence_parallel=False``."""
    if tp == 1 or local_seq % tp:
        return (False,)
    if moe is None:
        return (True,)
    return (False, True) if options.moe_sequence_parallel else (False,)


def _expert_degrees(moe: MoEShape | None, options: SearchOptions) -> list[int]:
    """The ep degrees to try (before the dp rule): 1 for a dense model; the fixed ones, else the
    divisors of the expert count."""
    if moe is None:
        return [1]
    fixed = options.expert_parallel
    if fixed is not None:
        return [fixed] if isinstance(fixed, int) else list(fixed)
    return _divisors(moe.experts)


def _describe_model(config: DecoderConfig) -> str:
    return (f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
            f"{config.num_key_value_heads} KV heads, intermediate {config.intermediate_size}")


def enumerate_layouts(config: DecoderConfig, world: int, *, devices_per_node: int = 8, micro_batch_size: int = 1,
                      seq_len: int, microbatches: int | None = None, global_batch_size: int | None = None,
                      options: SearchOptions | None = None) -> list[ParallelDegrees]:
    """Every valid layout of ``config`` (a family's config) on ``world`` devices (module rules).

    Raises :class:`PlanError` naming the world and why, when there is none.
    """
    pairs = _enumerate_checked(config, world, devices_per_node=devices_per_node, micro_batch_size=micro_batch_size,
                               seq_len=seq_len, microbatches=microbatches, global_batch_size=global_batch_size,
                               options=options or SearchOptions())
    return [layout for layout, _ in pairs]


def _enumerate_checked(config: DecoderConfig, world: int, *, devices_per_node: int, micro_batch_size: int,
                       seq_len: int, microbatches: int | None, global_batch_size: int | None,
                       options: SearchOptions) -> list[tuple[ParallelDegrees, int]]:
    _check_positive(world=world, devices_per_node=devices_per_node, micro_batch_size=micro_batch_size,
                    seq_len=seq_len, microbatches=microbatches, global_batch_size=global_batch_size)
    if microbatches is not None and global_batch_size is not None:
        raise PlanError("give either microbatches (fixed per DP rank) or global_batch_size (fixed in sequences), "
                        "not both")
    if options.max_vpp < 1:
        raise PlanError(f"max_vpp={options.max_vpp} must be >= 1")
    if options.partition not in ("balanced", "even"):
        raise PlanError(f"partition={options.partition!r} is not valid for a search; valid: 'balanced', 'even'")
    pairs, reasons = _enumerate(config, world, devices_per_node=devices_per_node, micro_batch_size=micro_batch_size,
                                seq_len=seq_len, microbatches=microbatches, global_batch_size=global_batch_size,
                                options=options)
    if not pairs:
        raise PlanError(f"world {world} has no valid layout for this model ({_describe_model(config)}; "
                        f"{devices_per_node} devices per node): {reasons.summary()}")
    return pairs


# ---------------------------------------------------------------------------------- ranking
@dataclass
class Candidate:
    """One priced layout."""

    layout: ParallelDegrees
    microbatches: int
    global_batch_size: int
    memory: MemoryBreakdown  # the peak over pipeline ranks
    time: TimeBreakdown
    fits: bool

    @property
    def seconds_per_sequence(self) -> float:
        return self.time.total_s / self.global_batch_size

    def sort_key(self) -> tuple[float, int]:
        # 9 significant digits: layouts the time model cannot tell apart tie, and memory decides
        return float(f"{self.seconds_per_sequence:.9g}"), int(self.memory.total)


@dataclass
class Plan:
    """The outcome of :func:`rank_layouts`: every candidate, fastest first, and the recommendation."""

    world: int
    device: DeviceSpec
    memory_bytes: int          # device memory used for the budget
    budget_bytes: int          # memory_bytes * (1 - headroom)
    headroom: float
    devices_per_node: int
    micro_batch_size: int
    seq_len: int
    precision: str
    candidates: list[Candidate] = field(default_factory=list)
    recommended: Candidate | None = None

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]


def resolve_device(device: DeviceSpec | str) -> DeviceSpec:
    """A :class:`~plait.devices.DeviceSpec` from a spec or a table name; unknown names raise :class:`PlanError`."""
    if isinstance(device, DeviceSpec):
        return device
    try:
        return get_device(str(device))
    except DeviceError as e:
        raise PlanError(str(e)) from None


def smallest_budget_hint(min_total: int, headroom: float) -> str:
    """The device memory (GB and GiB) at which a layout of ``min_total`` bytes per rank would fit."""
    need = min_total / (1 - headroom)
    return f"{math.ceil(need / 1e9 * 10) / 10:.1f} GB ({need / 1024**3:.1f} GiB)"


def stage_split(config: DecoderConfig, num_stages: int, seq_len: int, *, method: str = "balanced", cost: str = "flops",
                cuts: list[str] | None = None) -> list[list[int]]:
    """Decoder layers of each of ``num_stages`` pipeline stages, as
    :func:`~plait.plan.pipeline_split.plan_partition` splits them, from the units the model family
    declares (what its model traces to) instead of a traced model, so it costs microseconds, not
    seconds."""
    units = family_of(config).units(config)
    part = partition_model(units, unit_costs(config, units, seq_len, kind=cost), num_stages, method=method,
                           cuts=cuts, cost_kind=cost)
    return part.stage_layers()


def rank_layouts(config: DecoderConfig, world: int, device: DeviceSpec | str, *, devices_per_node: int = 8,
                 micro_batch_size: int = 1, seq_len: int, microbatches: int | None = None,
                 global_batch_size: int | None = None, precision: str = "autocast", memory_bytes: int | None = None,
                 headroom: float = DEFAULT_HEADROOM,
                 options: SearchOptions | None = None, require_fit: bool = True, peak: float | None = None,
                 adapters: AdapterPlan | None = None) -> Plan:
    """Price every layout of :func:`enumerate_layouts` and recommend the fastest that fits.

    ``device``: a table name (``"h100"``) or a :class:`~plait.devices.DeviceSpec`;
    ``memory_bytes`` overrides its memory and ``peak`` its peak FLOP/s per device for the precision's
    matmul dtype (e.g. a CPU rank that gets a share of the host's cores). Each candidate's memory is
    the peak over its pipeline ranks (``estimate_memory(..., stage=None)``); ``adapters``: a LoRA
    run (only the adapters train; a quantized base is priced as stored; under ZeRO-3 the
    full-training price, an upper bound, see :mod:`plait.plan.adapters`). Raises
    :class:`PlanError` for an unknown device, a world without layouts, and (with ``require_fit``)
    a budget no layout fits, naming the smallest device memory that would fit one.
    """
    spec = resolve_device(device)
    try:
        precision_bytes(precision)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if not 0 <= headroom < 1:
        raise PlanError(f"headroom={headroom!r} must be in [0, 1)")
    if memory_bytes is None:
        memory_bytes = spec.memory_bytes
        if memory_bytes is None:
            raise PlanError(f"device {spec.name!r} has no memory size in the table; give the memory per device")
    if memory_bytes <= 0:
        raise PlanError(f"memory per device must be positive, got {memory_bytes} bytes")
    options = options or SearchOptions()
    pairs = _enumerate_checked(config, world, devices_per_node=devices_per_node, micro_batch_size=micro_batch_size,
                               seq_len=seq_len, microbatches=microbatches, global_batch_size=global_batch_size,
                               options=options)
    budget = int(memory_bytes * (1 - headroom))
    candidates = []
    splits: dict[int, list[list[int]] | None] = {1: None}
    for layout, m in pairs:
        if layout.offload and (precision == "bf16-pure" or (not spec.host_link_bw and spec.name != "cpu")):
            continue  # no fp32 master to offload, or no host link to price it over
        n = layout.pp * layout.vpp
        if n not in splits:
            try:
                splits[n] = stage_split(config, n, seq_len, method=options.partition, cost=options.partition_cost)
            except ValueError as e:
                raise PlanError(f"pipeline split into {n} stages: {e}") from None
        try:
            mem = estimate_memory(config, layout, precision=precision, micro_batch_size=micro_batch_size,
                                  seq_len=seq_len, microbatches=m, stage_layers=splits[n], adapters=adapters)
            t = estimate_step_time(config, layout, spec, precision=precision, micro_batch_size=micro_batch_size,
                                   seq_len=seq_len, microbatches=m, stage_layers=splits[n],
                                   devices_per_node=devices_per_node, peak=peak)
        except ValueError as e:  # e.g. a device without the bandwidths the time model needs
            raise PlanError(f"cannot price {layout.short()} on {spec.name}: {e}") from None
        candidates.append(Candidate(layout, m, m * micro_batch_size * layout.dp, mem, t, mem.total <= budget))
    candidates.sort(key=Candidate.sort_key)
    plan = Plan(world=world, device=spec, memory_bytes=int(memory_bytes), budget_bytes=budget, headroom=headroom,
                devices_per_node=devices_per_node, micro_batch_size=micro_batch_size, seq_len=seq_len,
                precision=precision, candidates=candidates)
    fitting = plan.fitting
    plan.recommended = fitting[0] if fitting else None
    if plan.recommended is None and require_fit:
        best = min(candidates, key=lambda c: c.memory.total)
        gib = 1024**3
        error = PlanError(
            f"no layout of world {world} fits in {memory_bytes / 1e9:.1f} GB per device "
            f"({spec.name}, budget {budget / gib:.1f} GiB after {headroom:.0%} headroom): the smallest needs "
            f"{best.memory.total / gib:.1f} GiB per rank ({best.layout.short()}); the smallest device memory "
            f"that would fit is {smallest_budget_hint(best.memory.total, headroom)}")
        error.plan = plan
        raise error
    return plan


__all__ = ["DEFAULT_HEADROOM", "DEFAULT_MAX_SEQUENCES", "DEFAULT_TOKENS_PER_STEP", "Candidate", "Plan", "PlanError",
           "SearchOptions", "default_global_batch", "enumerate_layouts", "layout_microbatches", "rank_layouts",
           "resolve_device", "smallest_budget_hint", "stage_split"]
