"""Architecture hyper-parameters of a Qwen3-MoE model (Hugging Face ``model_type: qwen3_moe``).

Qwen3's block (per-head q/k norms, explicit ``head_dim``) whose MLP is a sparse
Mixture-of-Experts in the layers ``moe_layer_ids`` names: ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``, ``num_experts_per_tok`` per token, their softmax weights renormalised
only with ``norm_topk_prob``. Hugging Face's rule picks the sparse layers: layer ``i`` is sparse
unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the others are
dense MLPs of width ``intermediate_size`` (so ``mlp_only_layers: [0, 1]`` makes the first two
layers dense).

transformers 5 writes the expert count as ``num_local_experts``; both names are read, and
``num_experts`` (the name every release reads) is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from plait.models.errors import ModelConfigError
from plait.models.mixtral.config import check_experts, fill_defaults
from plait.models.qwen3.config import Qwen3Config


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Field names follow Hugging Face's ``Qwen3MoeConfig``."""

    family: ClassVar[str] = "qwen3_moe"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe",)

    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        fill_defaults(self, ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                             "decoder_sparse_step", "mlp_only_layers"))
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        check_experts(self.num_experts, self.num_experts_per_tok, "num_experts")
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model.{name}={value!r} must be a positive integer")
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ModelConfigError(f"model.mlp_only_layers holds {bad}; layer indices are 0 .. "
                                   f"{self.num_hidden_layers - 1}")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Hugging Face's rule (see the module docstring)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3MoeConfig:
        if "num_experts" not in d and "num_local_experts" in d:
            d = {**d, "num_experts": d["num_local_experts"]}
        config = super().from_hf_dict(d)
        assert isinstance(config, Qwen3MoeConfig)
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "mlp_only_layers": list(self.mlp_only_layers)})
        d.pop("num_local_experts", None)
        return d

    def inactive_expert_parameters(self) -> int:
        """Expert parameters a token does not use: ``num_experts - num_experts_per_tok`` experts of every
        MoE layer (what model FLOPs leave out, :mod:`plait.models.flops`)."""
        unused = self.num_experts - self.num_experts_per_tok
        return len(self.moe_layer_ids()) * unused * 3 * self.hidden_size * self.moe_intermediate_size

    def _block_parameters(self) -> tuple[int, int]:
        """(dense block, sparse block) parameter counts."""
        h = self.hidden_size
        dense = super().layer_parameters()
        sparse = dense - 3 * h * self.intermediate_size + self.num_experts * (h + 3 * h * self.moe_intermediate_size)
        return dense, sparse

    def layer_parameters(self) -> int:
        """Parameters of the mean block (sparse blocks: attention, norms, router and every expert),
        rounded down; :meth:`num_parameters` is exact."""
        dense, sparse = self._block_parameters()
        n_sparse = len(self.moe_layer_ids())
        return (n_sparse * sparse + (self.num_hidden_layers - n_sparse) * dense) // self.num_hidden_layers

    def num_parameters(self) -> int:
        dense, sparse = self._block_parameters()
        n_sparse = len(self.moe_layer_ids())
        blocks = n_sparse * sparse + (self.num_hidden_layers - n_sparse) * dense
        return super().num_parameters() - self.num_hidden_layers * self.layer_parameters() + blocks
