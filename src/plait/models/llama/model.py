"""A Llama-family decoder written for clarity and speed, with no distributed code.

Parameter names equal Hugging Face's ``LlamaForCausalLM`` names, so state dicts map one to one.
Tensor parallelism is applied afterwards by :func:`plait.models.llama.parallelize.parallelize`,
which swaps submodules for parallel ones; the forward functions here are written so that the
swapped modules slot in (attention projects q/k/v through one method, the output head goes
through a loss module that the parallel plan can replace).

The embedding, the block list, the final norm, the head and the loss module are the generic
decoder's (:mod:`plait.models.decoder.model`); Llama's model says which block and norm it uses and
adds the rotary tables. The model is traceable by ``torch.fx`` with :class:`LlamaDecoderLayer` as a
leaf module (its ``pipeline_block`` marker). Other families (Qwen3, Mistral) subclass these classes
and override only what differs, through the ``attention_cls`` / ``layer_cls`` / ``model_cls`` class
attributes.

Dropout (``config.attention_dropout`` on the attention weights, ``config.hidden_dropout`` on the
attention and MLP outputs before each residual add) is off by default and draws from the global
generator here; the tensor-parallel plan routes the draws on sharded activations through a
per-rank stream (:mod:`plait.tensor_parallel.random`). The weight-free parts of attention
(rotary, SDPA, dropout) and of the MLP (the SwiGLU product) are their own parameter-free
submodules, ``self_attn.core`` and ``mlp.act``, so that selective activation checkpointing can
name them (:mod:`plait.activation_checkpointing`); they add no parameters and change no names.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.model import DecoderForCausalLM, DecoderModel
from plait.models.llama.config import LlamaConfig
from plait.nn.attention import AttentionCore, causal_attention, document_causal_mask
from plait.nn.lm_output import CausalLMOutput
from plait.nn.mlp import GatedMLP, SwiGLU
from plait.nn.norm import RMSNorm, rms_norm
from plait.nn.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

# The generic blocks moved to :mod:`plait.nn`; their names stay importable from here.
__all__ = ["AttentionCore", "CausalLMOutput", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM",
           "LlamaMLP", "LlamaModel", "RMSNorm", "RotaryEmbedding", "SwiGLU", "apply_rotary", "causal_attention",
           "rms_norm", "rope_inv_freq", "rotate_half"]


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: q/k/v projections, the weight-free core, the output projection."""

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        # the core applies ``attention_dropout`` only in training mode (``self.training`` is shared
        # with it through ``train()``/``eval()``)
        return self.o_proj(self.core(q, k, v, cos, sin, mask))


class LlamaMLP(GatedMLP):
    """SwiGLU feed-forward block sized by the config."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, device=device,
                         dtype=dtype)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; ``residual_dropout`` (``config.hidden_dropout``) acts on the attention and MLP
    outputs before they join the residual stream (one module used twice: it holds no state)."""

    #: the attention class; a family whose blocks differ only in attention overrides it
    attention_cls: ClassVar[type[nn.Module]] = LlamaAttention
    #: a pipeline block: the tracer treats it as a leaf, and a stage boundary falls only between blocks
    pipeline_block: ClassVar[bool] = True

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = self.attention_cls(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(config, **kw)
        self.residual_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: a packed batch's document mask (:func:`plait.nn.attention.document_causal_mask`)."""
        x = x + self._drop(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self._drop(self.mlp(self.post_attention_layernorm(x)))

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        # Skipped at p == 0: on CUDA a zero-probability dropout would still launch a kernel and
        # advance the generator, shifting every later draw for nothing.
        return self.residual_dropout(y) if self.residual_dropout.p > 0 else y


class LlamaModel(DecoderModel):
    """Embedding, decoder blocks, final RMSNorm (and the rotary tables every block shares)."""

    layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    #: the parts under the base's default names (typed as modules: the TP plan swaps them)
    embed_tokens: nn.Module
    norm: nn.Module
    #: the rotary tables every block receives (a family may stack several: Gemma 3)
    rotary_emb: nn.Module

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(config, device=device)

    def build_norm(self, config: DecoderConfig, device=None, dtype=None) -> nn.Module:
        assert isinstance(config, LlamaConfig)
        return RMSNorm(config.hidden_size, config.rms_norm_eps, device=device, dtype=dtype)

    def block_inputs(self, h: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None,
                     segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rotary ``cos``/``sin`` tables and, for a packed batch, the document mask."""
        cos, sin = self.rotary_emb(h, seq_len, position_ids)
        mask = None if segment_ids is None else document_causal_mask(segment_ids)
        return cos, sin, mask


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama's decoder plus output head (the generic :class:`DecoderForCausalLM`)."""

    config: LlamaConfig
    model: LlamaModel
    lm_head: nn.Module
    model_cls: ClassVar[type[DecoderModel]] = LlamaModel
