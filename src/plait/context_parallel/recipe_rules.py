"""Recipe rules of context parallelism, checked before any process starts (called from
:mod:`plait.config.rules`); each names the field, its value and the fix.

What cp cannot do yet is refused here rather than failing inside a run: attention dropout and a
sliding window shorter than the sequence (the ring computes plain causal / document-causal
attention), preference objectives (their loss needs whole sequences on one rank) and the end-of-run
sample (generation would need the prompt split as well). ZeRO-1 shards over the dp x cp ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from plait.config.problems import divisors

if TYPE_CHECKING:
    from plait.config.schema import Recipe
    from plait.models.llama.config import LlamaConfig


class Checker(Protocol):
    """The part of :class:`plait.config.rules._Checker` these rules use."""

    r: Recipe

    def ok(self, *fields: str) -> bool: ...

    def add(self, field: str, value: Any, valid: str) -> None: ...


def cp_layout_problem(c: Checker, world: int, tp: int, pp: int, cp: int) -> bool:
    """Adds a problem and returns True when ``tp * pp * cp`` does not divide the world size."""
    if world % (tp * pp * cp) == 0:
        return False
    c.add("parallel.cp", cp, f"tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} must divide the world size {world}; "
                             f"cp values that do: {divisors(world // (tp * pp)) if world % (tp * pp) == 0 else []}")
    return True


def check_context_parallel(c: Checker, arch: LlamaConfig | None) -> None:
    r = c.r
    p, d = r.parallel, r.data
    if not c.ok("parallel.cp") or p.cp == 1:
        return
    cp, seq = p.cp, d.seq_len
    if c.ok("data.seq_len") and seq % (2 * cp):
        c.add("data.seq_len", seq, f"must be divisible by 2*parallel.cp = {2 * cp} (each cp rank holds two equal "
                                   f"chunks); use {max(2 * cp, seq - seq % (2 * cp))} or "
                                   f"{seq + 2 * cp - seq % (2 * cp)}")
    elif p.sequence_parallel and p.tp > 1 and c.ok("parallel.tp", "data.seq_len") and (seq // cp) % p.tp:
        c.add("parallel.sequence_parallel", True, f"needs data.seq_len / parallel.cp = {seq // cp} divisible by "
                                                  f"parallel.tp={p.tp}; choose seq_len a multiple of "
                                                  f"{2 * cp * p.tp} or turn it off")
    if c.ok("model.attention_dropout") and r.model.attention_dropout > 0:
        c.add("model.attention_dropout", r.model.attention_dropout,
              f"must be 0 with parallel.cp={cp} (ring attention has no dropout); or set parallel.cp: 1")
    window = getattr(arch, "sliding_window", None) if arch is not None else None
    if window is not None and window < seq:
        c.add("model.sliding_window", window, f"a window shorter than data.seq_len={seq} is not supported with "
                                              f"parallel.cp={cp}; use parallel.cp: 1")
    if c.ok("train.objective") and r.train.objective in ("dpo", "ipo", "orpo", "simpo"):
        c.add("train.objective", r.train.objective, f"preference objectives need whole sequences on one rank; "
                                                    f"use parallel.cp: 1 (cp={cp} given)")
    if c.ok("train.sample_tokens") and r.train.sample_tokens > 0:
        c.add("train.sample_tokens", r.train.sample_tokens, f"the end-of-run sample is not generated with "
                                                            f"parallel.cp={cp}; set train.sample_tokens: 0")
