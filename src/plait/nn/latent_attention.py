"""The weight-free parts of multi-head latent attention (MLA, DeepSeek-V2/V3), shared by the model's
attention and its tensor-parallel twin.

MLA projects each token to a small latent (``kv_lora_rank`` wide) plus one rotary key part
(``qk_rope_head_dim``) shared by every head; a second projection expands the latent to each head's
key part without position (``qk_nope_head_dim``) and value (``v_head_dim``). A query head is a
part without position and a rotary part. :func:`latent_heads` lays the pieces out as the shared
attention core expects them (``[batch, seq, heads, dim]``, rotated dimensions first): a dot
product does not depend on the order of the dimensions when queries and keys share it, so putting
the rotary part first (Hugging Face puts it last) lets the core's partial rotary
(:func:`plait.nn.rotary.apply_rotary`, the leading dimensions rotate) serve MLA unchanged, with
the window, packing, context-parallel and cached paths the other families have.

DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...`` of the rotary part
(``rope_interleave``); reordering the part as ``(x0, x2, ..., x1, x3, ...)`` in queries and keys
alike turns that into the half-split rotation the core applies, with the same scores.
"""

from __future__ import annotations

import torch


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The even dimensions of the last axis, then the odd ones."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def latent_heads(q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, *, nope_dim: int, rope_dim: int,
                 v_dim: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values as ``[batch, seq, heads, dim]`` with the rotary part first.

    ``q`` ``[batch, seq, heads * (nope_dim + rope_dim)]`` (each head: its part without position, then
    its rotary part, Hugging Face's layout); ``kv`` ``[batch, seq, heads * (nope_dim + v_dim)]`` (the
    expanded latent: each head's key part, then its value); ``k_rope`` ``[batch, seq, rope_dim]``, the
    rotary key part every head shares. The heads are read from the shapes, so a tensor-parallel
    shard holding some of them uses the same function.
    """
    b, s, _ = q.shape
    q = q.view(b, s, -1, nope_dim + rope_dim)
    q_nope, q_rope = q.split((nope_dim, rope_dim), dim=-1)
    k_nope, v = kv.view(b, s, -1, nope_dim + v_dim).split((nope_dim, v_dim), dim=-1)
    k_rope = k_rope.view(b, s, 1, rope_dim)
    if interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    heads = q.shape[2]
    k = torch.cat((k_rope.expand(b, s, heads, rope_dim), k_nope), dim=-1)
    return torch.cat((q_rope, q_nope), dim=-1), k, v


__all__ = ["deinterleave", "latent_heads"]
