"""A Llama-family decoder written for clarity and speed, with no distributed code.

Parameter names equal Hugging Face's ``LlamaForCausalLM`` names, so state dicts map one to one.
Tensor parallelism is applied afterwards by :func:`plait.models.llama.parallelize.parallelize`,
which swaps submodules for parallel ones; the forward functions here are written so that the
swapped modules slot in (attention projects q/k/v through one method, the output head goes
through a loss module that the parallel plan can replace).

The model is traceable by ``torch.fx`` with :class:`LlamaDecoderLayer` as a leaf module.

Dropout (``config.attention_dropout`` on the attention weights, ``config.hidden_dropout`` on the
attention and MLP outputs before each residual add) is off by default and draws from the global
generator here; the tensor-parallel plan routes the draws on sharded activations through a
per-rank stream (:mod:`plait.tensor_parallel.random`). The weight-free parts of attention
(rotary, SDPA, dropout) and of the MLP (the SwiGLU product) are their own parameter-free
submodules, ``self_attn.core`` and ``mlp.act``, so that selective activation checkpointing can
name them (:mod:`plait.activation_checkpointing`); they add no parameters and change no names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.llama.config import LlamaConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse rotary frequencies, including Llama 3's long-context frequency scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type != "llama3":
        return inv_freq
    s = config.rope_scaling
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Produces the cos/sin tables for a sequence; the frequencies are a non-persistent buffer."""

    def __init__(self, config: LlamaConfig, device=None) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the frequency table (after materialising a model built on the meta device)."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q`` and ``k`` of shape ``[batch, heads, seq, head_dim]``."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos, sin,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Rotary + causal grouped-query attention on ``[batch, seq, heads*head_dim]`` projections.

    The head counts are read from the shapes (``head_dim`` from the rotary table), so the same
    function serves the full model and a tensor-parallel shard holding a subset of the heads.
    ``dropout_p`` is SDPA's dropout on the attention weights; the caller decides (training mode,
    which generator) since this function cannot know. Returns ``[batch, seq, q_heads*head_dim]``.
    """
    b, s, _ = q.shape
    hd = cos.shape[-1]
    q = q.view(b, s, -1, hd).transpose(1, 2)
    k = k.view(b, s, -1, hd).transpose(1, 2)
    v = v.view(b, s, -1, hd).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(b, s, -1)


class AttentionCore(nn.Module):
    """Rotary + causal SDPA + attention dropout: the weight-free middle of attention.

    A module of its own (``self_attn.core``) only so selective activation checkpointing can
    recompute it; it saves the largest per-head activations and costs no matmul with weights.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, cos, sin, dropout_p=self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}"


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        kw = {"device": device, "dtype": dtype}
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(h, nq * hd, bias=config.attention_bias, **kw)
        self.k_proj = nn.Linear(h, nkv * hd, bias=config.attention_bias, **kw)
        self.v_proj = nn.Linear(h, nkv * hd, bias=config.attention_bias, **kw)
        self.o_proj = nn.Linear(nq * hd, h, bias=config.o_proj_bias, **kw)
        self.core = AttentionCore(config.attention_dropout)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        # the core applies ``attention_dropout`` only in training mode (``self.training`` is shared
        # with it through ``train()``/``eval()``)
        return self.o_proj(self.core(q, k, v, cos, sin))


class SwiGLU(nn.Module):
    """``silu(gate) * up``: the weight-free product of the MLP, a module (``mlp.act``) so selective
    activation checkpointing can recompute it instead of keeping ``silu(gate)`` and the product."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(h, i, bias=bias, **kw)
        self.up_proj = nn.Linear(h, i, bias=bias, **kw)
        self.down_proj = nn.Linear(i, h, bias=bias, **kw)
        self.act = SwiGLU()

    def project_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x)
        return self.down_proj(self.act(gate, up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; ``residual_dropout`` (``config.hidden_dropout``) acts on the attention and MLP
    outputs before they join the residual stream (one module used twice: it holds no state)."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(config, **kw)
        self.residual_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self._drop(self.mlp(self.post_attention_layernorm(x)))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        # Skipped at p == 0: on CUDA a zero-probability dropout would still launch a kernel and
        # advance the generator, shifting every later draw for nothing.
        return self.residual_dropout(y) if self.residual_dropout.p > 0 else y


class CausalLMOutput(nn.Module):
    """Turns output-head logits into the next-token loss (when labels are given) or full logits.

    ``labels`` are aligned with ``input_ids`` (position t predicts ``labels[t+1]``); positions
    labelled ``ignore_index`` do not count. The loss is the mean over counted tokens.
    The tensor-parallel plan replaces this module with a vocab-parallel one.
    """

    def __init__(self, vocab_size: int, ignore_index: int = -100) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return logits
        # Shift the labels, not the logits: the logits are the largest activation and slicing
        # them would copy it. The last position gets ``ignore_index``.
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=self.ignore_index).reshape(-1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shift_labels,
                               ignore_index=self.ignore_index)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, **kw) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(config, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, input_ids.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Decoder plus output head. ``forward(ids)`` gives logits; ``forward(ids, labels)`` the loss."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.model = LlamaModel(config, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.output = CausalLMOutput(config.vocab_size)

    def tie_weights(self) -> None:
        """Re-tie the output head to the embedding (needed after ``to_empty`` or module swaps)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.lm_head(self.model(input_ids)), labels)
