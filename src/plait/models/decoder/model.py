"""The generic decoder-only language model every family's model derives from, with no distributed code.

:class:`DecoderModel` holds the token embedding, the blocks and the final norm;
:class:`DecoderForCausalLM` adds the output head and the loss module. A family says what differs
through interface points rather than by rewriting the body:

- ``DecoderModel.layer_cls`` (or :meth:`DecoderModel.build_layer`, for blocks that differ by
  index), :meth:`DecoderModel.build_norm` and :meth:`DecoderModel.block_inputs` (the side inputs
  every block receives after the hidden state: Llama's rotary tables and document mask);
- ``DecoderForCausalLM.model_cls``;
- the attribute names of the parts, which are Hugging Face's: ``DecoderModel.embedding_name``
  and ``norm_name``, ``DecoderForCausalLM.decoder_name`` and ``head_name`` (Llama's
  ``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head`` by default; GPT-NeoX's
  ``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``, ``embed_out``). Code that needs a part
  whatever its name reads it through ``embedding`` / ``final_norm`` / ``decoder`` / ``head``.

The tensor-parallel plan swaps the embedding, the norms, the head and the loss module for
parallel ones, which is why they are typed as plain modules here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from plait.models.decoder.config import DecoderConfig
from plait.nn.lm_output import CausalLMOutput

if TYPE_CHECKING:  # the attributes the tensor-parallel plan sets; the model itself has no distributed code
    from plait.comm.primitives import GroupInfo
    from plait.tensor_parallel.heads import HeadLayout
    from plait.tensor_parallel.random import TensorParallelRNG


class DecoderModel(nn.Module):
    """Token embedding, ``config.num_hidden_layers`` blocks of ``layer_cls``, final norm.

    ``forward`` embeds the tokens, runs every block on the hidden state and the family's
    :meth:`block_inputs`, and normalises the result.
    """

    #: the block class; each block is built as ``layer_cls(config, device=, dtype=)``
    layer_cls: ClassVar[type[nn.Module]]
    #: Hugging Face's attribute names of the token embedding and of the final norm
    embedding_name: ClassVar[str] = "embed_tokens"
    norm_name: ClassVar[str] = "norm"

    def __init__(self, config: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # plain modules: the tensor-parallel plan swaps in its parallel embedding and norm
        setattr(self, self.embedding_name, nn.Embedding(config.vocab_size, config.hidden_size, device=device,
                                                        dtype=dtype))
        self.layers = nn.ModuleList(self.build_layer(config, i, device=device, dtype=dtype)
                                    for i in range(config.num_hidden_layers))
        setattr(self, self.norm_name, self.build_norm(config, device=device, dtype=dtype))

    @property
    def embedding(self) -> nn.Module:
        """The token embedding (``embed_tokens`` or the family's name for it)."""
        module: nn.Module = getattr(self, self.embedding_name)
        return module

    @property
    def final_norm(self) -> nn.Module:
        """The norm after the last block (``norm`` or the family's name for it)."""
        module: nn.Module = getattr(self, self.norm_name)
        return module

    def build_layer(self, config: DecoderConfig, layer_id: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> nn.Module:
        """Block ``layer_id`` (a family whose blocks differ by index, e.g. dense and sparse, overrides it)."""
        return self.layer_cls(config, device=device, dtype=dtype)

    def build_norm(self, config: DecoderConfig, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> nn.Module:
        """The norm after the last block (the family's norm: RMSNorm, LayerNorm, ...)."""
        raise NotImplementedError(f"{type(self).__name__} does not say which final norm it uses")

    def block_inputs(self, h: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None,
                     segment_ids: torch.Tensor | None) -> tuple[Any, ...]:
        """What every block receives after the hidden state ``h`` (``[batch, seq, hidden]``), computed
        once per forward: the positional tables, an attention mask. None by default."""
        return ()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``/``segment_ids`` (``[batch, seq]``) describe a packed batch: positions
        restart in each sample and attention stays within a sample."""
        h = self.embed(input_ids)
        side = self.block_inputs(h, input_ids.shape[1], position_ids, segment_ids)
        for layer in self.layers:
            h = layer(h, *side)
        return self.final_norm(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden state the first block receives: the token embedding (a family adds, e.g., the
        embedding dropout of GPT-NeoX)."""
        h: torch.Tensor = self.embedding(input_ids)
        return h


class DecoderForCausalLM(nn.Module):
    """Decoder plus output head. ``forward(ids)`` gives logits; ``forward(ids, labels)`` the loss."""

    #: the decoder class, built as ``model_cls(config, device=, dtype=)``
    model_cls: ClassVar[type[DecoderModel]]
    #: Hugging Face's attribute names of the decoder and of the output head
    decoder_name: ClassVar[str] = "model"
    head_name: ClassVar[str] = "lm_head"

    #: set by the family's tensor-parallel plan (``parallelize``); the builder
    #: (:mod:`plait.materialize`) sets ``rng_tracker`` on every model it builds
    head_layout: HeadLayout
    tensor_parallel: GroupInfo
    sequence_parallel: bool
    rng_tracker: TensorParallelRNG

    def __init__(self, config: DecoderConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        setattr(self, self.decoder_name, self.model_cls(config, device=device, dtype=dtype))
        # a plain module: the tensor-parallel plan swaps in its column-parallel head (and loss)
        setattr(self, self.head_name, nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device,
                                                dtype=dtype))
        self.tie_weights()
        self.output: nn.Module = CausalLMOutput(config.vocab_size)

    @property
    def decoder(self) -> DecoderModel:
        """The decoder (``model`` or the family's name for it)."""
        module: DecoderModel = getattr(self, self.decoder_name)
        return module

    @property
    def head(self) -> nn.Module:
        """The output head (``lm_head`` or the family's name for it)."""
        module: nn.Module = getattr(self, self.head_name)
        return module

    def tie_weights(self) -> None:
        """Re-tie the output head to the embedding (needed after ``to_empty`` or module swaps)."""
        if self.config.tie_word_embeddings:
            self.head.weight = self.decoder.embedding.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                loss_normalizer: float | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits, or with ``labels`` the loss (mean over the target tokens, or their sum divided by
        ``loss_normalizer``); ``position_ids``/``segment_ids`` for a packed batch.
        ``logits_to_keep > 0`` (no labels): the logits of the last that many positions only, the
        ones generation reads (the head over a whole prompt would be the largest tensor of it)."""
        h = self.decoder(input_ids, position_ids, segment_ids)
        if logits_to_keep > 0 and labels is None:
            assert not getattr(self, "sequence_parallel", False), "a sequence shard has no 'last positions'"
            h = h[:, -logits_to_keep:]
        output: torch.Tensor = self.output(self.head(h), labels, loss_normalizer)
        return output


__all__ = ["DecoderForCausalLM", "DecoderModel"]
