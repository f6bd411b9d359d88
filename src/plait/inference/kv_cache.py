"""A preallocated key/value cache: prefill once, then decode one token per forward.

Without a cache every new token re-runs attention over the whole prefix. With one, each
attention core keeps the rotated keys and the values of every position it has seen, in buffers
of ``[batch, local_kv_heads, max_len, head_dim]`` allocated once, and a forward computes only the
new positions: their queries attend to the cached keys plus their own.

The cache plugs into the weight-free middle of attention. Every attention core
(:class:`plait.nn.attention.AttentionCore`, and the tensor-parallel
:class:`~plait.tensor_parallel.attention.ParallelAttentionCore`) has a ``kv_cache`` attribute;
when it is set, the core hands its q/k/v projections and rotary tables to it instead of running
causal attention on them. The core receives projections of *its* heads, so under tensor
parallelism each rank caches only the K/V heads it holds (KV replicas cache the same head), and
under pipeline parallelism each rank caches only its own stages' layers: the cache needs no
communication and knows no model.

Rows of a batch are left-padded to a common prompt length, so every row writes the same slot at
each step. :class:`KVCache` (one per generation) holds what the layers share: the slots filled so
far, each row's padding and the attention mask of the current forward, built once per forward
for all layers. Query slot ``i`` of row ``b`` sees key slot ``j`` when ``pad[b] <= j <= i`` and,
with a sliding window ``w``, ``i - j < w`` (positions within a row are consecutive slots, so the
window counts what it counts without a cache). A padding query sees only itself: its output is
never read, and a row of the mask is never empty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.nn.attention import rotated_heads


class _Unset:
    """The type of :data:`UNSET`: "not given", where ``None`` means full attention."""


UNSET = _Unset()


class KVCache:
    """The shared state of one generation's caches: ``batch`` rows of at most ``max_len`` slots.

    ``pads`` (``[batch]``, int64): the left padding of each row. ``window``: the sliding window
    (``None``: full causal attention). Call :meth:`layer` once per attention core, then for each
    forward of ``n`` new positions :meth:`begin` before it and :meth:`advance` after it.
    """

    def __init__(self, batch: int, max_len: int, pads: torch.Tensor, *, window: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        if pads.shape != (batch,):
            raise ValueError(f"pads must have shape [{batch}], got {list(pads.shape)}")
        if window is not None and window < 1:
            raise ValueError(f"window={window} must be a positive number of positions (or None)")
        self.batch, self.max_len, self.window = batch, max_len, window
        self.device = torch.device(device)
        self.pads = pads.to(device=self.device, dtype=torch.long)
        self.length = 0
        self.mask: torch.Tensor | None = None
        self.causal = False
        self._n = 0
        self._masks: dict[int | None, tuple[torch.Tensor | None, bool]] = {}
        self._additives: dict[int | None, torch.Tensor | None] = {}
        self._padded = bool((self.pads > 0).any())

    def layer(self, window: int | None | _Unset = UNSET) -> LayerKVCache:
        """A new layer's cache, sharing this generation's slots. ``window``: that layer's own sliding
        window (``None``: full attention), for models whose layers differ in it (Gemma 3); by
        default the generation's ``window``."""
        if not isinstance(window, _Unset) and window is not None and window < 1:
            raise ValueError(f"window={window} must be a positive number of positions (or None)")
        return LayerKVCache(self, self.window if isinstance(window, _Unset) else window)

    def begin(self, n: int) -> None:
        """Prepare the masks of a forward over the next ``n`` slots (all layers of a window share one)."""
        start = self.length
        if start + n > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {start} are filled and {n} more do not fit")
        self._n = n
        self._masks = {}
        self._additives = {}
        self.mask, self.causal = self.mask_for(self.window)

    def mask_for(self, window: int | None) -> tuple[torch.Tensor | None, bool]:
        """The boolean mask of the current forward for layers of sliding ``window`` (``None``: when
        every key up to the query is visible), and whether SDPA should apply plain causal masking."""
        if window in self._masks:
            return self._masks[window]
        start, n = self.length, self._n
        end = start + n
        windowed = window is not None and window < end
        if not self._padded and not windowed and (start == 0 or n == 1):
            # every key up to the query is visible: plain causal attention (prefill) or no mask at all
            result: tuple[torch.Tensor | None, bool] = (None, n > 1)
        else:
            i = torch.arange(start, end, device=self.device).view(1, n, 1)
            j = torch.arange(end, device=self.device).view(1, 1, end)
            visible = (j <= i) & (j >= self.pads.view(-1, 1, 1))
            if windowed:
                assert window is not None
                visible &= (i - j) < window
            visible |= j == i  # a padding query sees itself (never read; no empty row)
            result = (visible.unsqueeze(1), False)
        self._masks[window] = result
        return result

    def additive_mask(self, window: int | None | _Unset = UNSET) -> torch.Tensor | None:
        """The current mask (of layers of ``window``; by default the generation's) as fp32
        ``0``/``-inf``, built once per forward and window, shared by the layers."""
        w = self.window if isinstance(window, _Unset) else window
        if w not in self._additives:
            mask, _ = self.mask_for(w)
            self._additives[w] = None if mask is None else torch.zeros(
                mask.shape, dtype=torch.float32, device=self.device).masked_fill(~mask, float("-inf"))
        return self._additives[w]

    def advance(self, n: int) -> None:
        """The ``n`` slots of the forward just run are now part of the cache."""
        self.length += n

    def positions(self, n: int) -> torch.Tensor:
        """Rotary positions ``[batch, n]`` of the next ``n`` slots (a row's first real token is
        position 0; padding slots get 0 too)."""
        slots = torch.arange(self.length, self.length + n, device=self.device).view(1, n)
        return (slots - self.pads.view(-1, 1)).clamp_min(0)


class LayerKVCache:
    """One attention core's keys and values, allocated at the first forward (when the local head
    count, ``head_dim`` and dtype are known)."""

    def __init__(self, shared: KVCache, window: int | None = None) -> None:
        self.shared = shared
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """Attention of the new positions (``[batch, n, heads*head_dim]`` projections, or
        ``[batch, n, heads, head_dim]`` ones) over the cached ones and themselves; returns
        ``[batch, n, q_heads*head_dim]``."""
        s = self.shared
        b, n = q.shape[:2]
        q, k, v = rotated_heads(q, k, v, cos, sin)
        if self.keys is None or self.values is None:
            # values may be narrower than keys (multi-head latent attention's v_head_dim)
            self.keys = torch.empty((b, k.shape[1], s.max_len, k.shape[3]), dtype=k.dtype, device=k.device)
            self.values = torch.empty((b, v.shape[1], s.max_len, v.shape[3]), dtype=v.dtype, device=v.device)
        start, end = s.length, s.length + n
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        keys, values = self.keys[:, :, :end], self.values[:, :, :end]
        if n == 1 and b > 1:  # measured: faster than the fused kernel for a batch, slower for one row
            out = decode_attention(q, keys, values, s.additive_mask(self.window))
        else:
            gqa = q.shape[1] != keys.shape[1]
            visible, causal = s.mask_for(self.window)
            mask = None if visible is None else visible.to(q.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b, n, -1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     additive_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new position per row: ``q [b, heads, 1, d]`` over ``keys``
    ``[b, kv_heads, L, d]`` and ``values`` ``[b, kv_heads, L, dv]`` (``dv`` is ``d`` but for latent
    attention's), with ``additive_mask [b, 1, 1, L]`` (0 or -inf, fp32) or none.

    The ``heads / kv_heads`` query heads that share a K/V head are stacked as the rows of one
    matrix product against it (the grouping SDPA's ``enable_gqa`` uses), so nothing is repeated
    and a decode step is two batched matrix products with an fp32 softmax between them. For a
    batch of rows this is faster on CPUs than the fused kernel (``bench/bench_generate.py``:
    ~10% of the whole step at batch 16 in bf16; slower for a single row, which keeps the fused
    kernel), and equal to it up to rounding."""
    b, h, _, d = q.shape
    kv = keys.shape[1]
    grouped = q.reshape(b, kv, h // kv, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * (d ** -0.5)
    if additive_mask is not None:
        scores = scores + additive_mask
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).reshape(b, h, 1, values.shape[-1])  # values may be narrower (MLA)


__all__ = ["KVCache", "LayerKVCache"]
