"""One pipeline stage of GPT-NeoX: a contiguous run of blocks, plus the embedding (and its dropout)
on the first stage and the final layer norm, output head and loss on the last.

As in Llama's stage (:mod:`plait.models.llama.pipeline_stage`), the stage is built by moving the
full model's own submodules into it, so parameters keep their names
(``gpt_neox.layers.7.attention.query_key_value.weight`` on whatever stage holds layer 7). GPT-NeoX's
output head is never tied to the embedding, so no parameter is shared between stages. No
communication happens here; the pipeline runtime moves activations between stages.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.models.gpt_neox.model import GPTNeoXForCausalLM
from plait.nn.attention import document_causal_mask
from plait.nn.lm_output import SequenceLoss


class StageDecoder(nn.Module):
    """The stage's share of the full model's ``gpt_neox`` submodule, under the same attribute names.
    Only the modules this stage holds are set: ``embed_in`` and ``emb_dropout`` on the first stage,
    ``final_layer_norm`` on the last."""

    embed_in: nn.Module
    emb_dropout: nn.Dropout
    layers: nn.ModuleDict
    rotary_emb: nn.Module
    final_layer_norm: nn.Module


class GPTNeoXStage(nn.Module):
    def __init__(self, full: GPTNeoXForCausalLM, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = full.config
        self.first, self.last = first, last
        self.layer_ids = list(layer_ids)
        self.gpt_neox = StageDecoder()
        if first:
            self.gpt_neox.embed_in = full.gpt_neox.embed_in
            self.gpt_neox.emb_dropout = full.gpt_neox.emb_dropout
        self.gpt_neox.layers = nn.ModuleDict({str(i): full.gpt_neox.layers[i] for i in layer_ids})
        self.gpt_neox.rotary_emb = full.gpt_neox.rotary_emb
        if last:
            self.gpt_neox.final_layer_norm = full.gpt_neox.final_layer_norm
            self.embed_out = full.embed_out
            self.output = full.output
        for attr in ("head_layout", "tensor_parallel", "sequence_parallel", "rng_tracker"):
            if hasattr(full, attr):
                setattr(self, attr, getattr(full, attr))

    def shared_across_stages(self) -> frozenset[str]:
        """Parameters this stage shares with another pipeline stage: none (the head is untied)."""
        return frozenset()

    def secondary_copies(self) -> frozenset[str]:
        """Parameters held here as a copy owned by another stage: none."""
        return frozenset()

    def tie_weights(self) -> None:
        """Nothing to tie: GPT-NeoX's output head is its own weight."""

    def forward(self, x: torch.Tensor, seq_len: int, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                loss_normalizer: float | None = None, sequence_loss: SequenceLoss | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """The contract of :meth:`plait.models.llama.pipeline_stage.LlamaStage.forward`: ``x`` is token
        ids on the first stage and hidden states otherwise; the last stage returns the loss (or
        ``sequence_loss`` of the logits) with ``labels``, else the logits (of the last
        ``logits_to_keep`` positions when positive); other stages return hidden states."""
        decoder = self.gpt_neox
        if self.first:
            x = decoder.embed_in(x)
            if decoder.emb_dropout.p > 0:
                x = decoder.emb_dropout(x)
        cos, sin = decoder.rotary_emb(x, seq_len, position_ids)
        mask = None if segment_ids is None else document_causal_mask(segment_ids)
        h = x
        for layer in decoder.layers.values():
            h = layer(h, cos, sin, mask)
        if not self.last:
            return h
        if logits_to_keep > 0 and labels is None:
            assert not getattr(self, "sequence_parallel", False), "a sequence shard has no 'last positions'"
            h = h[:, -logits_to_keep:]
        logits = self.embed_out(decoder.final_layer_norm(h))
        if sequence_loss is not None and labels is not None:
            return sequence_loss(logits, labels)
        return self.output(logits, labels, loss_normalizer)

    def extra_repr(self) -> str:
        span = f"{self.layer_ids[0]}-{self.layer_ids[-1]}" if self.layer_ids else "none"
        return f"layers {span}, first={self.first}, last={self.last}"


__all__ = ["GPTNeoXStage"]
