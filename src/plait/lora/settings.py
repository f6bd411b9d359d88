"""What a LoRA adapter is: rank, scale, dropout and the projections it adapts."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: projections whose output features are sharded under tensor parallelism (B is sharded like them)
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query_key_value", "dense_h_to_4h")
#: projections whose input features are sharded under tensor parallelism (A is sharded like them)
ROW_TARGETS = ("o_proj", "down_proj", "dense", "dense_4h_to_h")
#: every projection a decoder block may have, by Hugging Face's names: separate q/k/v and a gated MLP
#: (Llama and the families built on it), or one fused q/k/v projection and a plain MLP (GPT-NeoX);
#: a model has the ones its blocks hold (checked against the built model, ``config/rules/lora.py``)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
#: the submodule of a decoder block that holds each projection
CONTAINER_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
                "query_key_value": "attention", "dense": "attention", "dense_h_to_4h": "mlp", "dense_4h_to_h": "mlp"}


class LoraSettingsError(ValueError):
    """A LoRA setting that cannot be used; the message names the field, the value and the fix."""


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """The adapter ``W x + scale * B A dropout(x)`` added to each target projection.

    Attributes:
        rank: ``r``, the inner dimension of ``A`` (``[r, in]``) and ``B`` (``[out, r]``).
        alpha: the numerator of the scale (``alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``).
        dropout: probability of dropping an element of the adapter's input (training mode only).
        target_modules: the projections of every decoder block that get an adapter.
        rslora: rank-stabilised scaling, ``alpha / sqrt(r)`` (PEFT's ``use_rslora``).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    rslora: bool = False

    def __post_init__(self) -> None:
        # a list is accepted from callers (recipes) and kept as a tuple, so the settings stay hashable
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        problems = self.problems()
        if problems:
            raise LoraSettingsError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid field at once, one message each."""
        out: list[str] = []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            out.append(f"lora.rank={self.rank!r} is not valid; use a positive integer such as 8 or 16")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            out.append(f"lora.alpha={self.alpha!r} is not valid; use a positive number (often 2 * rank)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) \
                or not 0.0 <= self.dropout < 1.0:
            out.append(f"lora.dropout={self.dropout!r} is not valid; use a probability in [0, 1), e.g. 0.05")
        targets = self.target_modules
        unknown = [t for t in targets if t not in TARGETS]
        if not targets:
            out.append(f"lora.target_modules=[] adapts nothing; name some of {', '.join(TARGETS)}")
        elif unknown:
            out.append(f"lora.target_modules={list(targets)!r} names {unknown!r}, which are not projections of a "
                       f"decoder block; valid names: {', '.join(TARGETS)}")
        elif len(set(targets)) != len(targets):
            dup = sorted({t for t in targets if targets.count(t) > 1})
            out.append(f"lora.target_modules={list(targets)!r} names {dup!r} more than once; name each once")
        if not isinstance(self.rslora, bool):
            out.append(f"lora.rslora={self.rslora!r} is not valid; use true or false")
        return out

    @property
    def scale(self) -> float:
        """The factor on ``B A x``: ``alpha / r`` (``alpha / sqrt(r)`` with ``rslora``)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
