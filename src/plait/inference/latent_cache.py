"""The decoding cache of multi-head latent attention (DeepSeek-V2/V3's MLA): the latent, not the heads.

The generic cache (:mod:`plait.inference.kv_cache`) keeps every head's rotated key and value, which
for MLA is ``heads * (qk_head_dim + v_head_dim)`` numbers a token (40,960 for DeepSeek-V3). The
attention module instead hands this cache what it computes before the expansion: the normalised
latent (``kv_lora_rank`` wide) and the shared rotary key part (``qk_rope_head_dim``), 576 numbers a
token for DeepSeek-V3, one copy for all heads and, under tensor parallelism, on every TP rank
alike (the compressions are replicated).

Attention over the cache folds ``kv_b_proj`` into the two products instead of expanding the
cached latent every step (DeepSeek-V2's "absorbed" form): a head's key is ``W_uk c`` for the latent
``c``, so its score ``q_nope . W_uk c`` is ``(W_uk^T q_nope) . c``; its value is ``W_uv c``, so the
output ``sum_j p_j W_uv c_j`` is ``W_uv (sum_j p_j c_j)``. Each step then costs two products with the
latent per head and no expansion of the prefix; the result equals attention over the expanded keys
and values up to rounding. The mask (padding, sliding window) is the generation's
(:class:`~plait.inference.kv_cache.KVCache`), shared with every other layer.
"""

from __future__ import annotations

import torch

from plait.inference.kv_cache import KVCache
from plait.nn.attention import rotated_heads
from plait.nn.latent_attention import deinterleave


class LatentKVCache:
    """One latent-attention module's cache: ``[batch, max_len, kv_lora_rank]`` latents and
    ``[batch, max_len, qk_rope_head_dim]`` rotated key parts, allocated at the first forward."""

    def __init__(self, shared: KVCache, window: int | None = None) -> None:
        self.shared, self.window = shared, window
        self.latents: torch.Tensor | None = None
        self.rope_keys: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, kv_b_weight: torch.Tensor, *,
                 nope_dim: int, v_dim: int, interleave: bool, scale: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Attention of the new positions over the cached ones and themselves.

        ``q`` ``[batch, n, heads * (nope_dim + rope_dim)]`` (the rank's heads, Hugging Face's layout:
        each head's part without position, then its rotary part); ``latent`` ``[batch, n, rank]``
        (normalised); ``k_rope`` ``[batch, n, rope_dim]`` (not rotated); ``kv_b_weight`` the rank's
        ``kv_b_proj`` weight ``[heads * (nope_dim + v_dim), rank]``; ``scale`` the softmax scale.
        Returns the heads' outputs ``[batch, n, heads * v_dim]`` (``o_proj``'s input).
        """
        s = self.shared
        b, n, _ = q.shape
        rope_dim = k_rope.shape[-1]
        q = q.view(b, n, -1, nope_dim + rope_dim)
        q_nope, q_rope = q.split((nope_dim, rope_dim), dim=-1)
        k_rope = k_rope.view(b, n, 1, rope_dim)
        if interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope, _ = rotated_heads(q_rope, k_rope, k_rope, cos, sin)  # [b, heads, n, rope], [b, 1, n, rope]
        if self.latents is None or self.rope_keys is None:
            self.latents = torch.empty((b, s.max_len, latent.shape[-1]), dtype=latent.dtype, device=latent.device)
            self.rope_keys = torch.empty((b, s.max_len, rope_dim), dtype=k_rope.dtype, device=k_rope.device)
        start, end = s.length, s.length + n
        self.latents[:, start:end] = latent
        self.rope_keys[:, start:end] = k_rope[:, 0]
        latents, rope_keys = self.latents[:, :end], self.rope_keys[:, :end]

        heads = q_nope.shape[2]
        w = kv_b_weight.view(heads, nope_dim + v_dim, -1)
        w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
        q_latent = torch.einsum("bnhd,hdr->bhnr", q_nope, w_uk)  # the queries in the latent's space
        scores = (torch.matmul(q_latent, latents.unsqueeze(1).transpose(-1, -2))
                  + torch.matmul(q_rope, rope_keys.unsqueeze(1).transpose(-1, -2))).float() * scale
        mask = self._additive_mask(n, end, scores.device)
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1).to(latents.dtype)
        mixed = torch.matmul(weights, latents.unsqueeze(1))  # [b, heads, n, rank]
        return torch.einsum("bhnr,hvr->bnhv", mixed, w_uv).reshape(b, n, heads * v_dim)

    def _additive_mask(self, n: int, end: int, device: torch.device) -> torch.Tensor | None:
        """The generation's mask for this layer's window as fp32 0 / -inf ``[batch or 1, 1, n, end]``;
        plain causal masking (an unpadded prefill) made explicit, none when every key is visible."""
        mask = self.shared.additive_mask(self.window)
        if mask is not None:
            return mask.to(device)
        _, causal = self.shared.mask_for(self.window)
        if not causal:
            return None
        i = torch.arange(end - n, end, device=device).view(n, 1)
        j = torch.arange(end, device=device).view(1, end)
        return torch.zeros((n, end), device=device).masked_fill(j > i, float("-inf")).view(1, 1, n, end)


__all__ = ["LatentKVCache"]
