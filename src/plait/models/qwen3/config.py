"""Architecture hyper-parameters of a dense Qwen3 model (Hugging Face ``model_type: qwen3``).

Qwen3 is Llama's block with two changes the config must say: per-head RMSNorms on q and k
(always present, no field), and an explicit ``head_dim`` that need not equal
``hidden_size / num_attention_heads``. Biases follow ``attention_bias`` on q/k/v and o together
(no Qwen2-style q/k/v-only biases). Qwen3's optional sliding window is refused: its released dense
models train with full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.decoder.config import REQUIRED_HF_KEYS
from plait.models.errors import ModelConfigError
from plait.models.llama.config import LlamaConfig


@dataclass
class Qwen3Config(LlamaConfig):
    """Field names follow Hugging Face's ``Qwen3Config``."""

    family: ClassVar[str] = "qwen3"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3",)
    #: Hugging Face's default ``head_dim`` (128) rarely matches a small model: required, never guessed
    required_hf_keys: ClassVar[tuple[str, ...]] = REQUIRED_HF_KEYS + ("head_dim",)

    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768

    def validate(self) -> None:
        super().validate()
        if self.o_proj_bias != self.attention_bias:
            raise ModelConfigError(f"o_proj_bias={self.o_proj_bias} differs from attention_bias="
                                   f"{self.attention_bias}; Qwen3 biases q/k/v and o together")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        if d.get("use_sliding_window"):
            raise ModelConfigError("use_sliding_window=true is not supported for qwen3 (plait runs its full "
                                   "causal attention); set use_sliding_window=false if the model was trained "
                                   "without it")
        return super().from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": self.attention_bias,
                  "use_sliding_window": False, "sliding_window": None})
        return d

    def layer_parameters(self) -> int:
        """Llama's block plus the two per-head norm weights (``head_dim`` each)."""
        return super().layer_parameters() + 2 * self.head_dim
