"""A pipeline stage of Gemma 3: Llama's stage (same part names) whose first stage scales the embedding."""

from __future__ import annotations

import torch

from plait.models.gemma3.model import embedding_scale
from plait.models.llama.pipeline_stage import LlamaStage


class Gemma3Stage(LlamaStage):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding_scale(self.model.embed_tokens(input_ids), self.config.hidden_size)
