"""A Llama-family decoder written for clarity and speed, with no distributed code.

Parameter names equal Hugging Face's ``LlamaForCausalLM`` names, so state dicts map one to one.
Tensor parallelism is applied afterwards by :func:`plait.models.llama.parallelize.parallelize`,
which swaps submodules for parallel ones; the forward functions here are written so that the
swapped modules slot in (attention projects q/k/v through one method, the output head goes
through a loss module that the parallel plan can replace).

The model is traceable by ``torch.fx`` with :class:`LlamaDecoderLayer` as a leaf module (its
``pipeline_block`` marker). Other families (Qwen3, Mistral) subclass these classes and override only
what differs, through the ``attention_cls`` / ``layer_cls`` / ``model_cls`` class attributes.

Dropout (``config.attention_dropout`` on the attention weights, ``config.hidden_dropout`` on the
attention and MLP outputs before each residual add) is off by default and draws from the global
generator here; the tensor-parallel plan routes the draws on sharded activations through a
per-rank stream (:mod:`plait.tensor_parallel.random`). The weight-free parts of attention
(rotary, SDPA, dropout) and of the MLP (the SwiGLU product) are their own parameter-free
submodules, ``self_attn.core`` and ``mlp.act``, so that selective activation checkpointing can
name them (:mod:`plait.activation_checkpointing`); they add no parameters and change no names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from plait.models.llama.config import LlamaConfig
from plait.nn.attention import AttentionCore, causal_attention, document_causal_mask
from plait.nn.mlp import GatedMLP, SwiGLU
from plait.nn.norm import RMSNorm, rms_norm
from plait.nn.output import CausalLMOutput
from plait.nn.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rotate_half

if TYPE_CHECKING:  # the attributes the tensor-parallel plan sets; the model itself has no distributed code
    from plait.comm.primitives import GroupInfo
    from plait.tensor_parallel.heads import HeadLayout
    from plait.tensor_parallel.random import TensorParallelRNG

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


class LlamaModel(nn.Module):
    """Embedding, decoder blocks, final norm (and the rotary tables every block shares)."""

    layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # typed as modules: the tensor-parallel plan swaps in its parallel embedding and norm
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(self.layer_cls(config, **kw) for _ in range(config.num_hidden_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.rotary_emb = RotaryEmbedding(config, device=device)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``/``segment_ids`` (``[batch, seq]``) describe a packed batch: positions
        restart in each sample and attention stays within a sample."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, input_ids.shape[1], position_ids)
        mask = None if segment_ids is None else document_causal_mask(segment_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Decoder plus output head. ``forward(ids)`` gives logits; ``forward(ids, labels)`` the loss."""

    model_cls: ClassVar[type[LlamaModel]] = LlamaModel

    #: set by the tensor-parallel plan (:func:`plait.models.llama.parallelize.parallelize`); the
    #: builder (:mod:`plait.materialize`) sets ``rng_tracker`` on every model it builds
    head_layout: HeadLayout
    tensor_parallel: GroupInfo
    sequence_parallel: bool
    rng_tracker: TensorParallelRNG

    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.model = self.model_cls(config, **kw)
        # typed as modules: the tensor-parallel plan swaps in its column-parallel head and loss
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        self.tie_weights()
        self.output: nn.Module = CausalLMOutput(config.vocab_size)

    def tie_weights(self) -> None:
        """Re-tie the output head to the embedding (needed after ``to_empty`` or module swaps)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                loss_normalizer: float | None = None) -> torch.Tensor:
        """Logits, or with ``labels`` the loss (mean over the target tokens, or their sum divided by
        ``loss_normalizer``); ``position_ids``/``segment_ids`` for a packed batch."""
        h = self.model(input_ids, position_ids, segment_ids)
        return self.output(self.lm_head(h), labels, loss_normalizer)
