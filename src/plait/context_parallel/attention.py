"""The attention function a model's attention core calls under context parallelism.

It has the signature of :func:`plait.nn.attention.causal_attention` (``[batch, seq, heads*head_dim]``
projections of this rank's local tokens, rotary tables of their positions, an optional packed-row
mask) so it slots into the same places: the tensor-parallel core's ``attention_fn`` and the plain
core's ``context_parallel`` hook (see :mod:`plait.context_parallel.apply`). Rotary is applied here,
on the local tokens with the positions the batch split gave them, before K/V leave the rank.

Packed rows: the model builds its document mask from this rank's segment ids, which cannot tell
whether a document continues on another rank; the ids themselves travel with the mask
(:func:`plait.nn.attention.segment_ids_of`) and are all-gathered over the cp group here (a few bytes
per token, once per stage forward) into the whole row's ids, which the ring masks every piece with.
They also carry each token's chunk number (:func:`plait.context_parallel.batch.encode_chunks`):
a packed micro-batch's chunks are paired by attention work, not by the fixed zigzag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from plait.comm.primitives import GroupInfo, all_gather_dim
from plait.context_parallel.allgather import allgather_attention
from plait.context_parallel.batch import decode_chunks
from plait.context_parallel.exchange import RingExchange
from plait.context_parallel.ring import ring_attention
from plait.context_parallel.split import SequenceSplit
from plait.nn.attention import causal_attention, rotated_heads, segment_ids_of

CPMode = Literal["ring", "allgather"]
#: attribute of a document mask caching its micro-batch's split and whole-row document ids
_ROWS_ATTR = "plait_cp_rows"
CP_MODES: tuple[str, ...] = ("ring", "allgather")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's cp group and how attention crosses it.

    ``ranks``: the group's global ranks in ring order (``mesh.my_group_ranks("cp")``); ``mode``:
    ``ring`` (K/V blocks passed around, transfers overlapped with compute unless ``overlap`` is
    false) or ``allgather``; ``zigzag``: the sequence split (must match the batch split).
    """

    info: GroupInfo
    ranks: tuple[int, ...]
    mode: CPMode = "ring"
    zigzag: bool = True
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.mode not in CP_MODES:
            raise ValueError(f"cp_mode={self.mode!r} is not valid; choose one of {CP_MODES}")

    @property
    def size(self) -> int:
        return self.info.size

    def split(self, seq_len: int) -> SequenceSplit:
        return SequenceSplit(seq_len, self.size, self.zigzag)


class ContextParallelAttention:
    """``fn(q, k, v, cos, sin, mask=None)`` over the cp group (an ``AttentionFn``).

    ``active=False`` (see :func:`plait.context_parallel.apply.whole_sequences`) makes it plain causal
    attention on whatever the rank holds: generation gives every rank the whole prompt.
    """

    def __init__(self, cp: ContextParallel) -> None:
        self.cp = cp
        self.exchange = RingExchange(cp.info, list(cp.ranks), overlap=cp.overlap)
        self.active = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
        if not self.active:
            return causal_attention(q, k, v, cos, sin, dropout_p=dropout_p, mask=mask)
        if dropout_p:
            raise ValueError(f"attention dropout ({dropout_p}) is not supported with context parallelism; "
                             f"set model.attention_dropout to 0")
        b, s = q.shape[:2]  # [batch, seq, heads*head_dim] or [batch, seq, heads, head_dim] projections
        q, k, v = rotated_heads(q, k, v, cos, sin)
        split, segments = (self.cp.split(s * self.cp.size), None) if mask is None else self._packed(mask, s)
        if self.cp.mode == "ring":
            out = ring_attention(q, k.contiguous(), v.contiguous(), split, self.exchange, segments)
        else:
            out = allgather_attention(q, k.contiguous(), v.contiguous(), split, self.cp.info, segments)
        return out.transpose(1, 2).reshape(b, s, -1)

    def _packed(self, mask: torch.Tensor, s: int) -> tuple[SequenceSplit, torch.Tensor]:
        """The split of a packed micro-batch and its whole rows' document ids, from the segment ids
        every rank's mask carries (one all-gather per stage forward: cached on the mask, which every
        layer of the forward, and a recomputation, shares)."""
        cached = getattr(mask, _ROWS_ATTR, None)
        if cached is not None:
            return cached
        local = segment_ids_of(mask)
        if local is None:
            raise ValueError("context-parallel attention got a mask without its segment ids; build it with "
                             "plait.nn.attention.document_causal_mask")
        cp = self.cp.size
        docs, chunks = decode_chunks(all_gather_dim(local.unsqueeze(0), 0, self.cp.info.group), cp)
        n = s // 2
        pairs = chunks[:, 0, ::n].tolist()  # the chunk of each rank's two slots (one host read)
        split = SequenceSplit(s * cp, cp, assignment=tuple((a, b) for a, b in pairs))
        rows = (split, split.unsplit(list(docs.unbind(0)), dim=-1))
        setattr(mask, _ROWS_ATTR, rows)
        return rows

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={self.cp.size}, mode={self.cp.mode}, zigzag={self.cp.zigzag})"
