"""One pipeline stage of the Llama model: a contiguous run of decoder layers, plus the embedding
on the first stage and the final norm, output head and loss on the last.

Parameters keep the full model's names (``model.layers.7.mlp.up_proj.weight`` stays that on
whatever stage holds layer 7), because the stage is built by moving the full model's own
submodules into it. With tied embeddings the last stage also holds ``model.embed_tokens``
(its weight is the output head's), so the tied tensor has its canonical name on both ends.
No communication happens here; the pipeline runtime moves activations between stages.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.models.llama.model import LlamaForCausalLM
from plait.nn.attention import document_causal_mask
from plait.nn.lm_output import SequenceLoss


class StageModel(nn.Module):
    """The stage's share of the full model's ``model`` submodule, under the same attribute names
    (so parameter names are unchanged). Only the modules this stage holds are set:
    ``embed_tokens`` on the first stage (and on the last with tied embeddings), ``norm`` on the last."""

    embed_tokens: nn.Module
    layers: nn.ModuleDict
    rotary_emb: nn.Module
    norm: nn.Module


class LlamaStage(nn.Module):
    def __init__(self, full: LlamaForCausalLM, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = full.config
        self.first, self.last = first, last
        self.layer_ids = list(layer_ids)
        self.model = StageModel()
        tied = full.config.tie_word_embeddings
        if first or (last and tied):
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layer_ids})
        self.model.rotary_emb = full.model.rotary_emb
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head
            self.output = full.output
        for attr in ("head_layout", "tensor_parallel", "sequence_parallel", "rng_tracker"):
            if hasattr(full, attr):
                setattr(self, attr, getattr(full, attr))

    #: the parameter two pipeline stages share when the embeddings are tied (first stage: input
    #: embedding; last stage: the output head's weight), under its canonical name
    TIED = "model.embed_tokens.weight"

    def shared_across_stages(self) -> frozenset[str]:
        """Parameters this stage shares with another pipeline stage (their gradients are summed over
        the stages holding them): the tied embedding on the first and the last stage."""
        tied = self.config.tie_word_embeddings and (self.first or self.last) and not (self.first and self.last)
        return frozenset({self.TIED}) if tied else frozenset()

    def secondary_copies(self) -> frozenset[str]:
        """Parameters held here as a copy whose canonical owner is another stage: the tied embedding
        on a last stage that is not also the first (the first stage's copy counts)."""
        return frozenset({self.TIED}) if self.last and not self.first and self.config.tie_word_embeddings \
            else frozenset()

    def tie_weights(self) -> None:
        if self.last and self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, x: torch.Tensor, seq_len: int, labels: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                loss_normalizer: float | None = None, sequence_loss: SequenceLoss | None = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """``x``: token ids on the first stage, hidden states otherwise. The last stage returns the
        loss when ``labels`` are given (see :class:`~plait.nn.lm_output.CausalLMOutput` for
        ``loss_normalizer``; ``sequence_loss``, when given, computes it from the logits instead,
        e.g. a preference objective), else the logits; other stages return hidden states.
        ``position_ids``/``segment_ids`` (``[batch, seq]``, every stage gets them from the batch)
        describe a packed batch. ``logits_to_keep > 0`` (no labels): the last stage returns the
        logits of the last that many positions only (what generation reads)."""
        h = self.embed(x) if self.first else x
        cos, sin = self.model.rotary_emb(h, seq_len, position_ids)
        mask = None if segment_ids is None else document_causal_mask(segment_ids)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin, mask)
        if not self.last:
            return h
        if logits_to_keep > 0 and labels is None:
            assert not getattr(self, "sequence_parallel", False), "a sequence shard has no 'last positions'"
            h = h[:, -logits_to_keep:]
        normed = self.model.norm(h)
        logits = self.lm_head(normed)
        if sequence_loss is not None and labels is not None:
            return sequence_loss(logits, labels)
        out: torch.Tensor = self.output(logits, labels, loss_normalizer)
        if labels is None:
            return out
        return self.auxiliary_losses(out, normed, labels, (cos, sin, mask), segment_ids=segment_ids,
                                     loss_normalizer=loss_normalizer)

    def auxiliary_losses(self, loss: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, side: tuple, *,
                         segment_ids: torch.Tensor | None, loss_normalizer: float | None) -> torch.Tensor:
        """The last stage's next-token ``loss``, with the gradients of a family's further losses added in
        its backward (DeepSeek-V3's multi-token prediction); ``hidden`` is the final norm's output and
        ``side`` what the blocks received. None by default."""
        return loss

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the first block receives on the first stage: the token embedding (a family built on
        this stage scales it, as its model's ``embed`` does)."""
        h: torch.Tensor = self.model.embed_tokens(input_ids)
        return h

    def extra_repr(self) -> str:
        span = f"{self.layer_ids[0]}-{self.layer_ids[-1]}" if self.layer_ids else "none"
        return f"layers {span}, first={self.first}, last={self.last}"
