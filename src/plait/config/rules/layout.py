"""The layout: the parallel degrees against the world size, attention heads and the MLP against
tensor parallelism, sequence parallelism against the sequence length, and the global batch."""

from __future__ import annotations

from plait.config.problems import divisors
from plait.config.resolve import derive_world_and_dp
from plait.config.rules.checker import Checker
from plait.config.rules.context_parallel import cp_layout_problem
from plait.tensor_parallel.heads import HeadLayout, HeadLayoutError


def check_layout(c: Checker) -> None:
    """Checks the degrees against :attr:`Checker.world_size`; sets :attr:`Checker.dp` (``None``
    when it cannot be derived)."""
    c.dp = _layout_dp(c)


def _layout_dp(c: Checker) -> int | None:
    p, world_size = c.r.parallel, c.world_size
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                   or world_size < 1):
        c.add("world_size", world_size, "must be a positive integer (the number of processes)")
        return None
    if not c.ok("parallel.tp", "parallel.pp", "parallel.dp"):
        return None
    tp, pp = p.tp, p.pp
    cp = p.cp if c.ok("parallel.cp") else 1
    world, dp = derive_world_and_dp(tp, pp, p.dp, world_size, cp)
    if world % (tp * pp):
        valid = divisors(world // pp) if world % pp == 0 else []
        hint = f"tp values that do with pp={pp}: {valid}" if valid else f"pp={pp} does not divide it either"
        c.add("parallel.tp", tp, f"tp*pp = {tp}*{pp} = {tp * pp} must divide the world size {world}; {hint}")
        return None
    if cp_layout_problem(c, world, tp, pp, cp):
        return None
    if p.dp is not None and p.dp * tp * pp * cp != world:
        names, denom = ("tp*pp", tp * pp) if cp == 1 else ("tp*pp*cp", tp * pp * cp)
        c.add("parallel.dp", p.dp, f"must equal world size / ({names}) = {world}/{denom} = {world // denom}; "
                                   f"or null to derive it")
        return None
    return dp


def check_heads(c: Checker) -> None:
    p, arch = c.r.parallel, c.arch
    if arch is None or not c.ok("parallel.tp", "parallel.kv_replication", "parallel.kv_placement"):
        return
    try:
        HeadLayout.plan(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, p.tp,
                        p.kv_replication, p.kv_placement)
    except HeadLayoutError as e:
        if p.kv_replication is not None and str(e).startswith("kv_replication"):
            c.add("parallel.kv_replication", p.kv_replication, str(e))
        else:
            c.add("parallel.tp", p.tp, str(e))
        return
    if arch.intermediate_size % p.tp:
        valid = [d for d in divisors(arch.intermediate_size) if d <= arch.num_attention_heads]
        c.add("parallel.tp", p.tp, f"must divide model.intermediate_size={arch.intermediate_size}; "
                                   f"valid tp: {valid}")


def check_sequence(c: Checker) -> None:
    r, arch = c.r, c.arch
    seq = r.data.seq_len
    if arch is not None and c.ok("data.seq_len") and seq > arch.max_position_embeddings:
        c.add("data.seq_len", seq, f"must be <= model.max_position_embeddings={arch.max_position_embeddings}")
    tp = r.parallel.tp
    if r.parallel.sequence_parallel and c.ok("parallel.tp") and tp == 1:
        c.warnings.append("parallel.sequence_parallel: true — has no effect with tp=1")
    if (r.parallel.sequence_parallel and c.ok("parallel.sequence_parallel", "parallel.tp", "data.seq_len")
            and tp > 1 and seq % tp):
        c.add("parallel.sequence_parallel", True, f"needs data.seq_len={seq} divisible by parallel.tp={tp}; "
                                                  f"use a seq_len that is a multiple of {tp} or turn it off")


def check_batch(c: Checker) -> None:
    d, p, dp = c.r.data, c.r.parallel, c.dp
    if (dp is None or d.global_batch_size is None
            or not c.ok("data.global_batch_size", "data.micro_batch_size", "parallel.microbatches")):
        return
    expected = d.micro_batch_size * p.microbatches * dp
    if d.global_batch_size != expected:
        c.add("data.global_batch_size", d.global_batch_size,
              f"must equal micro_batch_size*microbatches*dp = {d.micro_batch_size}*{p.microbatches}*{dp} = "
              f"{expected}; or null to derive it")
