"""Rotary position embeddings (RoPE), including Llama 3's and YaRN's long-context frequency scaling
and partial rotary (GPT-NeoX: only the leading dimensions of each head rotate).

The functions read a *rope config*: any object with ``head_dim``, ``rope_theta``, ``rope_type``
(``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``) and ``rope_scaling`` (the ``linear``,
``llama3`` or ``yarn`` mapping, or ``None``), which every family's config provides under Hugging
Face's names, or a :class:`RopeSpec`. Layers of one model with different rotary settings (Gemma 3's sliding and
full-attention layers) share one :class:`LayerRotaryEmbeddings`, which stacks a table per setting.
The rotated width is ``head_dim`` unless a narrower ``dim`` is given; tables of that width then
rotate the first ``dim`` dimensions of each head and pass the others through (:func:`apply_rotary`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class RopeConfig(Protocol):
    @property
    def head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...

    @property
    def rope_type(self) -> str: ...


def rope_inv_freq(config: RopeConfig, dim: int | None = None) -> torch.Tensor:
    """Inverse rotary frequencies of a rotated width ``dim`` (default ``config.head_dim``), including
    Llama 3's long-context frequency scaling."""
    dim = config.head_dim if dim is None else dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type == "linear":  # positions divided by the factor: every frequency scaled down
        assert config.rope_scaling is not None, "rope_type 'linear' comes from a rope_scaling mapping"
        return inv_freq / config.rope_scaling["factor"]
    if config.rope_type == "yarn":
        assert config.rope_scaling is not None, "rope_type 'yarn' comes from a rope_scaling mapping"
        return yarn_inv_freq(inv_freq, dim, config.rope_theta, config.rope_scaling)
    if config.rope_type != "llama3":
        return inv_freq
    s = config.rope_scaling
    assert s is not None, "rope_type 'llama3' comes from a rope_scaling mapping"
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for no extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023): the fast dimensions (more than ``beta_fast`` turns over
    the pre-training context) keep their frequency, the slow ones (fewer than ``beta_slow``) are
    divided by ``factor``, and a linear ramp blends the dimensions between (its ends rounded out
    unless ``truncate`` is false), as Hugging Face computes them."""
    factor, ctx = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def turns_dim(turns: float) -> float:  # the dimension that makes ``turns`` rotations over the context
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(fast), turns_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by the factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: RopeConfig) -> float:
    """The factor on the cos/sin tables: YaRN's ``attention_factor`` (given, or
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)``); 1 for every other rope type."""
    if config.rope_type != "yarn":
        return 1.0
    s = config.rope_scaling
    assert s is not None, "rope_type 'yarn' comes from a rope_scaling mapping"
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Produces the cos/sin tables for a sequence; the frequencies are a non-persistent buffer.

    ``dim``: the rotated width of each head (default ``config.head_dim``; smaller for partial rotary).
    """

    inv_freq: torch.Tensor

    def __init__(self, config: RopeConfig, device=None, dim: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dim = config.head_dim if dim is None else dim
        #: multiplies both tables (YaRN's attention factor; 1 otherwise)
        self.attention_factor = rope_attention_factor(config)
        self.register_buffer("inv_freq", rope_inv_freq(config, self.dim).to(device), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the frequency table (after materialising a model built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config, self.dim).to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, seq_len: int,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[seq, dim]`` for positions ``0..seq_len-1``, or, given
        ``position_ids [batch, seq]`` (a packed row restarts them in each sample), of shape
        ``[batch, 1, seq, dim]`` (broadcast over the heads)."""
        inv_freq = self.inv_freq.float()
        if position_ids is None:
            pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
        else:
            freqs = (position_ids.to(inv_freq.device, torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(x.dtype), sin.to(x.dtype)


@dataclass(frozen=True)
class RopeSpec:
    """A rope config of its own (one kind of layer's): ``head_dim``, ``rope_theta`` and the
    ``rope_scaling`` mapping (``None``: unscaled)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))


class LayerRotaryEmbeddings(nn.Module):
    """The rotary tables of several rope configs at once, for models whose layers differ in them.

    ``forward`` has :class:`RotaryEmbedding`'s signature and returns ``(cos, sin)`` with a leading
    dimension of ``len(configs)``: table ``i`` is that of ``configs[i]``, and a layer reads its own
    with ``cos[i]``. Each config's frequencies are a non-persistent buffer of a
    :class:`RotaryEmbedding` under ``tables.i``.
    """

    def __init__(self, configs: Sequence[RopeConfig], device=None) -> None:
        super().__init__()
        self.tables = nn.ModuleList(RotaryEmbedding(c, device=device) for c in configs)

    def forward(self, x: torch.Tensor, seq_len: int,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [table(x, seq_len, position_ids) for table in self.tables]
        return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q`` and ``k`` of shape ``[batch, heads, seq, head_dim]``. Tables narrower than
    ``head_dim`` (partial rotary) rotate the leading ``cos.shape[-1]`` dimensions of each head and
    leave the rest as they are."""
    width = cos.shape[-1]
    if width == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return _rotate_leading(q, cos, sin, width), _rotate_leading(k, cos, sin, width)


def _rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    rot, rest = x[..., :width], x[..., width:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
