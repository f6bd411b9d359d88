"""Architecture hyper-parameters of a Mixtral model (Hugging Face ``model_type: mixtral``).

Mixtral is Mistral's block whose MLP is a sparse Mixture-of-Experts: ``num_local_experts`` SwiGLU
experts of width ``intermediate_size`` (there is no dense MLP), of which each token uses the
``num_experts_per_tok`` with the highest router probability, their weights renormalised to sum
to one. ``router_aux_loss_coef`` is kept for the round trip; training reads its coefficient from
the recipe's ``moe`` section. Router jitter is refused (plait does not implement it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.errors import ModelConfigError
from plait.models.mistral.config import MistralConfig


def check_experts(num_experts: Any, top_k: Any, experts_key: str) -> None:
    """``num_experts`` and ``top_k`` are positive integers with ``top_k <= num_experts``."""
    for name, value in ((experts_key, num_experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(f"model.{name}={value!r} must be a positive integer")
    if top_k > num_experts:
        raise ModelConfigError(f"model.num_experts_per_tok={top_k} exceeds model.{experts_key}={num_experts}: a "
                               f"token cannot use more experts than there are; set num_experts_per_tok <= "
                               f"{num_experts}")


def fill_defaults(config: Any, names: tuple[str, ...]) -> None:
    """Set each field of ``names`` given as ``None`` (a recipe leaving it unset) to its default."""
    for f in dataclasses.fields(config):
        if f.name in names and getattr(config, f.name) is None:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            setattr(config, f.name, default)


@dataclass
class MixtralConfig(MistralConfig):
    """Field names follow Hugging Face's ``MixtralConfig``."""

    family: ClassVar[str] = "mixtral"
    model_types: ClassVar[tuple[str, ...]] = ("mixtral",)

    intermediate_size: int = 14336
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    sliding_window: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0

    def __post_init__(self) -> None:
        fill_defaults(self, ("num_local_experts", "num_experts_per_tok"))
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        check_experts(self.num_local_experts, self.num_experts_per_tok, "num_local_experts")
        if self.router_jitter_noise:
            raise ModelConfigError(f"model.router_jitter_noise={self.router_jitter_noise!r} is not supported; set it "
                                   f"to 0.0 (plait's routers take no input noise)")

    def moe_layer_ids(self) -> list[int]:
        """Every block of Mixtral is sparse."""
        return list(range(self.num_hidden_layers))

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
        return d

    def inactive_expert_parameters(self) -> int:
        """Expert parameters a token does not use: ``num_local_experts - num_experts_per_tok`` experts of
        every MoE layer (what model FLOPs leave out, :mod:`plait.models.flops`)."""
        unused = self.num_local_experts - self.num_experts_per_tok
        return len(self.moe_layer_ids()) * unused * 3 * self.hidden_size * self.intermediate_size

    def layer_parameters(self) -> int:
        """Attention, two norms, the router and every expert (the total, not the active count)."""
        h, i, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        dense_mlp = 3 * h * i
        return super().layer_parameters() - dense_mlp + e * h + e * dense_mlp
