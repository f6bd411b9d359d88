"""Architecture hyper-parameters of a Mistral model (Hugging Face ``model_type: mistral``).

Mistral is Llama's block with sliding-window attention: each query sees the ``sliding_window``
most recent positions, itself included (``null``: full causal attention). It has no biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.errors import ModelConfigError
from plait.models.llama.config import LlamaConfig


@dataclass
class MistralConfig(LlamaConfig):
    """Field names follow Hugging Face's ``MistralConfig``."""

    family: ClassVar[str] = "mistral"
    model_types: ClassVar[tuple[str, ...]] = ("mistral",)

    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    #: positions a query attends to, itself included; ``None`` is full causal attention
    sliding_window: int | None = 4096

    def validate(self) -> None:
        super().validate()
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ModelConfigError(f"model.sliding_window={w!r} must be a positive integer (positions a query "
                                   f"sees, itself included) or null for full attention")
        biases = [n for n in ("attention_bias", "o_proj_bias", "mlp_bias") if getattr(self, n)]
        if biases:
            raise ModelConfigError(f"{', '.join(f'model.{n}=true' for n in biases)}: Mistral has no biases; "
                                   f"set {' and '.join(biases)} to false")

    def attention_span(self, seq_len: int) -> int:
        """A query attends to at most ``sliding_window`` keys."""
        return seq_len if self.sliding_window is None else min(seq_len, self.sliding_window)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        for key in ("attention_bias", "mlp_bias"):  # not fields of Hugging Face's MistralConfig
            d.pop(key, None)
        d.update({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
        return d
