"""GPT-NeoX (Pythia) written on the generic decoder, with no distributed code.

Parameter names equal Hugging Face's ``GPTNeoXForCausalLM`` checkpoint names:
``gpt_neox.embed_in``, ``gpt_neox.layers.N.{input_layernorm, post_attention_layernorm}``,
``gpt_neox.layers.N.attention.{query_key_value, dense}``,
``gpt_neox.layers.N.mlp.{dense_h_to_4h, dense_4h_to_h}``, ``gpt_neox.final_layer_norm`` and the
untied output head ``embed_out`` (transformers 5 calls the module ``lm_head`` in memory and reads and
writes ``embed_out`` in files, which are what plait reads and writes).

What differs from Llama's block is composed from :mod:`plait.nn`: :class:`~plait.nn.norm.LayerNorm`,
the fused q/k/v projection split head by head (:func:`~plait.nn.attention.split_fused_heads`) into
the shared attention core, rotary tables narrower than the head (partial rotary), the plain
:class:`~plait.nn.mlp.DenseMLP`, and the parallel residual. As in Llama's model, the weight-free
parts are their own submodules (``attention.core``, ``mlp.act``) so selective activation
checkpointing can name them, and ``config.hidden_dropout`` acts on the embedding (``emb_dropout``)
and on the attention and MLP outputs before they join the residual stream.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.model import DecoderForCausalLM, DecoderModel
from plait.models.gpt_neox.config import GPTNeoXConfig
from plait.nn.attention import AttentionCore, document_causal_mask, split_fused_heads
from plait.nn.mlp import DenseMLP
from plait.nn.norm import LayerNorm
from plait.nn.rotary import RotaryEmbedding


class GPTNeoXAttention(nn.Module):
    """Self-attention with one fused projection, ``[q, k, v]`` per head (``query_key_value``), the
    weight-free core (partial rotary, causal SDPA, attention dropout) and ``dense``."""

    def __init__(self, config: GPTNeoXConfig, device=None, dtype=None) -> None:
        super().__init__()
        h, hd, n = config.hidden_size, config.head_dim, config.num_attention_heads
        kw = {"bias": config.attention_bias, "device": device, "dtype": dtype}
        self.head_dim = hd
        self.query_key_value = nn.Linear(h, 3 * n * hd, **kw)
        self.dense = nn.Linear(n * hd, h, **kw)
        self.core = AttentionCore(config.attention_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = split_fused_heads(self.query_key_value(x), self.head_dim)
        return self.dense(self.core(q, k, v, cos, sin, mask))


class GPTNeoXLayer(nn.Module):
    """Pre-norm block with a parallel (``x + attn(ln1(x)) + mlp(ln2(x))``) or sequential residual;
    ``residual_dropout`` (``config.hidden_dropout``) acts on the attention and MLP outputs."""

    #: a pipeline block: the tracer treats it as a leaf, and a stage boundary falls only between blocks
    pipeline_block: ClassVar[bool] = True

    def __init__(self, config: GPTNeoXConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, **kw)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, **kw)
        self.attention = GPTNeoXAttention(config, **kw)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True, **kw)
        self.residual_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: a packed batch's document mask (:func:`plait.nn.attention.document_causal_mask`)."""
        attn = self._drop(self.attention(self.input_layernorm(x), cos, sin, mask))
        if self.use_parallel_residual:
            # summed in Hugging Face's order, so fp32 results match it closely
            return self._drop(self.mlp(self.post_attention_layernorm(x))) + attn + x
        h = attn + x
        return self._drop(self.mlp(self.post_attention_layernorm(h))) + h

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        # skipped at p == 0, as in Llama's block: a zero-probability dropout would still advance the generator
        return self.residual_dropout(y) if self.residual_dropout.p > 0 else y


class GPTNeoXModel(DecoderModel):
    """``embed_in``, the blocks and ``final_layer_norm`` (the generic decoder under GPT-NeoX's
    names), the embedding dropout and the partial rotary tables every block shares."""

    layer_cls: ClassVar[type[nn.Module]] = GPTNeoXLayer
    embedding_name: ClassVar[str] = "embed_in"
    norm_name: ClassVar[str] = "final_layer_norm"
    #: the parts under their names (typed as modules: the TP plan swaps them)
    embed_in: nn.Module
    final_layer_norm: nn.Module
    emb_dropout: nn.Dropout

    def __init__(self, config: GPTNeoXConfig, device=None, dtype=None) -> None:
        super().__init__(config, device=device, dtype=dtype)
        self.emb_dropout = nn.Dropout(config.hidden_dropout)
        self.rotary_emb = RotaryEmbedding(config, device=device, dim=config.rotary_ndims)

    def build_norm(self, config: DecoderConfig, device=None, dtype=None) -> nn.Module:
        assert isinstance(config, GPTNeoXConfig)
        return LayerNorm(config.hidden_size, config.layer_norm_eps, device=device, dtype=dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding, then ``emb_dropout`` (skipped at p == 0)."""
        h: torch.Tensor = self.embed_in(input_ids)
        return self.emb_dropout(h) if self.emb_dropout.p > 0 else h

    def block_inputs(self, h: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None,
                     segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rotary ``cos``/``sin`` tables (``rotary_ndims`` wide) and, for a packed batch, the document mask."""
        cos, sin = self.rotary_emb(h, seq_len, position_ids)
        mask = None if segment_ids is None else document_causal_mask(segment_ids)
        return cos, sin, mask


class GPTNeoXForCausalLM(DecoderForCausalLM):
    """GPT-NeoX's decoder (``gpt_neox``) plus its untied output head (``embed_out``)."""

    config: GPTNeoXConfig
    gpt_neox: GPTNeoXModel
    embed_out: nn.Module
    model_cls: ClassVar[type[DecoderModel]] = GPTNeoXModel
    decoder_name: ClassVar[str] = "gpt_neox"
    head_name: ClassVar[str] = "embed_out"


__all__ = ["GPTNeoXAttention", "GPTNeoXForCausalLM", "GPTNeoXLayer", "GPTNeoXModel"]
