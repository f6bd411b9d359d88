"""A pipeline stage of DeepSeek-V3: Llama's stage (same part names) whose last stage also holds the
multi-token-prediction modules and, for their inputs, a copy of the token embedding.

The embedding is then held by the first and the last stage, as a tied embedding is: its gradients
are summed over the two (``shared_across_stages``) and the first stage's copy is the canonical one
(``secondary_copies``), so both copies stay equal and are counted and saved once.
"""

from __future__ import annotations

import torch

from plait.models.deepseek_v3.config import DeepseekV3Config
from plait.models.deepseek_v3.model import DeepseekV3ForCausalLM, MtpStats, mtp_loss
from plait.models.llama.pipeline_stage import LlamaStage


class DeepseekV3Stage(LlamaStage):
    config: DeepseekV3Config

    def __init__(self, full: DeepseekV3ForCausalLM, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__(full, layer_ids, first=first, last=last)
        self.predicts_ahead = last and len(full.mtp) > 0
        if self.predicts_ahead:
            self.mtp = full.mtp
            self.model.embed_tokens = full.model.embed_tokens
        #: set by training to collect the multi-token-prediction loss (see the model's ``mtp_stats``)
        self.mtp_stats: MtpStats | None = None

    def _embedding_on_both_ends(self) -> bool:
        holds_copy = self.last and (self.config.tie_word_embeddings or self.predicts_ahead)
        return holds_copy and not self.first

    def shared_across_stages(self) -> frozenset[str]:
        """The embedding on the first and the last stage when either holds it twice over (tied head, or
        the prediction modules' inputs)."""
        predicts = getattr(self.config, "num_nextn_predict_layers", 0) > 0
        if predicts and (self.first or self.last) and not (self.first and self.last):
            return frozenset({self.TIED})
        return super().shared_across_stages()

    def secondary_copies(self) -> frozenset[str]:
        return frozenset({self.TIED}) if self._embedding_on_both_ends() else frozenset()

    def auxiliary_losses(self, loss: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, side: tuple, *,
                         segment_ids: torch.Tensor | None, loss_normalizer: float | None) -> torch.Tensor:
        if not (self.predicts_ahead and self.training):
            return loss
        return mtp_loss(self.mtp, hidden, labels, loss, embed=self.model.embed_tokens, head=self.lm_head,
                        output=self.output, side=side, segment_ids=segment_ids, loss_normalizer=loss_normalizer,
                        weight=self.config.mtp_loss_weight, stats=self.mtp_stats)


__all__ = ["DeepseekV3Stage"]
