"""Architecture hyper-parameters of a DeepSeek-V3 model (Hugging Face ``model_type: deepseek_v3``).

DeepSeek-V3's decoder on top of Llama's fields (RMSNorm, rotary base and scaling, biases):

* **multi-head latent attention**: queries through a low-rank bottleneck (``q_lora_rank``; ``null``
  projects them directly, DeepSeek-V2-Lite's shape), keys and values through a shared latent
  (``kv_lora_rank``) expanded per head, one rotary key part (``qk_rope_head_dim``) shared by the
  heads, value heads of their own width (``v_head_dim``); YaRN rope scaling (``rope_scaling``
  ``yarn``) whose ``mscale_all_dim`` also scales the softmax;
* **fine-grained MoE** from layer ``first_k_dense_replace`` on (the layers before are dense MLPs of
  ``intermediate_size``): ``n_routed_experts`` experts of ``moe_intermediate_size``,
  ``num_experts_per_tok`` per token chosen by sigmoid scores plus a balancing bias within the
  ``topk_group`` best of ``n_group`` groups, weights renormalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``, and ``n_shared_experts`` shared experts (one MLP of their summed
  width) every token goes through;
* **multi-token prediction**: ``num_nextn_predict_layers`` modules after the decoder, module ``k``
  predicting the token ``k + 1`` places beyond the next one; their loss is added with
  ``mtp_loss_weight`` (plait's field, DeepSeek-V3's lambda) and logged apart.

``head_dim`` is Hugging Face's: the rotary width ``qk_rope_head_dim`` (what the rotary tables are
built for); there are no key/value heads to group, so ``num_key_value_heads`` is the head count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.decoder.config import REQUIRED_HF_KEYS
from plait.models.decoder.shapes import BlockShape, LatentAttentionShape
from plait.models.errors import ModelConfigError
from plait.models.llama.config import LlamaConfig
from plait.models.mixtral.config import check_experts, fill_defaults
from plait.nn.rotary import yarn_mscale

#: the epsilon of the two latent norms (Hugging Face builds them with its RMSNorm's default)
LATENT_NORM_EPS = 1e-6
#: the only router DeepSeek-V3 describes (``scoring_func`` / ``topk_method`` of its config.json)
ROUTER_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass
class DeepseekV3Config(LlamaConfig):
    """Field names follow Hugging Face's ``DeepseekV3Config`` (defaults: DeepSeek-V3's 671B shape)."""

    family: ClassVar[str] = "deepseek_v3"
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3",)
    required_hf_keys: ClassVar[tuple[str, ...]] = REQUIRED_HF_KEYS + (
        "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
        "moe_intermediate_size")
    rope_types: ClassVar[tuple[str, ...]] = ("default", "yarn")
    checkpointable_modules: ClassVar[tuple[str, ...]] = (
        "input_layernorm", "self_attn", "self_attn.core", "post_attention_layernorm", "mlp")
    selective_checkpoint_modules: ClassVar[tuple[str, ...]] = ("self_attn.core",)
    #: the shared experts are added ungated (Qwen2-MoE gates its shared expert)
    shared_expert_gate: ClassVar[bool] = False

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    max_position_embeddings: int = 163840
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    #: query bottleneck width; ``None``: one direct query projection (DeepSeek-V2-Lite)
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    #: the rotary part's dimensions pair up as ``(x0, x1), (x2, x3), ...`` (DeepSeek's checkpoints)
    rope_interleave: bool = True
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    hidden_act: str = "silu"
    #: Hugging Face's name of the load-balancing loss weight; training reads the recipe's ``moe`` section
    router_aux_loss_coef: float = 0.0
    num_nextn_predict_layers: int = 0
    #: weight of the mean multi-token-prediction loss added to the next-token loss (plait's field)
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        fill_defaults(self, ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
                             "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                             "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                             "first_k_dense_replace", "hidden_act", "num_nextn_predict_layers", "mtp_loss_weight"))
        if self.head_dim is not None and self.head_dim != self.qk_rope_head_dim:
            raise ModelConfigError(f"model.head_dim={self.head_dim!r} differs from qk_rope_head_dim="
                                   f"{self.qk_rope_head_dim!r}; DeepSeek-V3's head_dim is the rotary width (leave it "
                                   f"null)")
        self.head_dim = self.qk_rope_head_dim
        self.num_key_value_heads = self.num_attention_heads
        super().__post_init__()

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size",
                     "n_shared_experts", "n_group", "topk_group"):
            if not _positive_int(getattr(self, name)):
                raise ModelConfigError(f"model.{name}={getattr(self, name)!r} must be a positive integer")
        super().validate()
        if self.q_lora_rank is not None and not _positive_int(self.q_lora_rank):
            raise ModelConfigError(f"model.q_lora_rank={self.q_lora_rank!r} must be a positive integer, or null for "
                                   f"a direct query projection")
        check_experts(self.n_routed_experts, self.num_experts_per_tok, "n_routed_experts")
        e, g, tg, k = self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok
        if e % g:
            raise ModelConfigError(f"model.n_group={g} must divide n_routed_experts={e} (experts form equal groups)")
        if tg > g or tg * (e // g) < k:
            raise ModelConfigError(f"model.topk_group={tg} must be <= n_group={g} and its groups must hold at least "
                                   f"num_experts_per_tok={k} experts ({e // g} per group)")
        first = self.first_k_dense_replace
        if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= self.num_hidden_layers:
            raise ModelConfigError(f"model.first_k_dense_replace={first!r} must be an integer in [0, "
                                   f"num_hidden_layers={self.num_hidden_layers}] (dense layers before MoE ones)")
        mtp = self.num_nextn_predict_layers
        if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
            raise ModelConfigError(f"model.num_nextn_predict_layers={mtp!r} must be an integer >= 0 (multi-token "
                                   f"prediction modules; 0 = none)")
        for name in ("routed_scaling_factor", "mtp_loss_weight", "router_aux_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ModelConfigError(f"model.{name}={value!r} must be a finite number >= 0")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"model.hidden_act={self.hidden_act!r} is not supported; DeepSeek-V3's MLPs are "
                                   f"SwiGLU: use 'silu'")
        if self.mlp_bias:
            raise ModelConfigError("model.mlp_bias=true: DeepSeek-V3's MLPs have no biases; set it to false")
        if self.o_proj_bias != self.attention_bias:
            raise ModelConfigError(f"o_proj_bias={self.o_proj_bias} differs from attention_bias={self.attention_bias}; "
                                   f"DeepSeek-V3 biases the compressions and o_proj together")

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        """The width of one query or key head: its part without position and its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (the name plait's MoE code reads)."""
        return self.n_routed_experts

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts' summed width (one gated MLP, as Hugging Face builds them)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling."""
        scale = self.qk_head_dim ** -0.5
        s = self.rope_scaling
        if self.rope_type == "yarn" and s is not None and s.get("mscale_all_dim"):
            scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are sparse (a multi-token-prediction module's
        block, numbered after the decoder's, too)."""
        return layer_id >= self.first_k_dense_replace

    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def hf_fields(cls, d: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """Llama's ``rope_parameters`` reading; ``num_key_value_heads`` and ``head_dim`` are implied by
        MLA (Hugging Face writes its defaults); another router than sigmoid/noaux_tc and a sparse-layer
        frequency other than 1 are refused; DeepSeek's ``aux_loss_alpha`` is the aux-loss weight."""
        for key, valid in ROUTER_KEYS.items():
            if key in d and d[key] != valid:
                raise ModelConfigError(f"{key}={d[key]!r} is not supported: plait runs DeepSeek-V3's router "
                                       f"({key}={valid!r})")
        if d.get("moe_layer_freq", 1) != 1:
            raise ModelConfigError(f"moe_layer_freq={d['moe_layer_freq']!r} is not supported: every layer from "
                                   f"first_k_dense_replace on is sparse (moe_layer_freq=1)")
        known = super().hf_fields(d, known)
        known.pop("num_key_value_heads", None)
        known.pop("head_dim", None)
        if "aux_loss_alpha" in d and "router_aux_loss_coef" not in d:
            known["router_aux_loss_coef"] = d["aux_loss_alpha"]
        if "num_nextn_predict_layers" not in d and "num_mtp_layers" in d:
            known["num_nextn_predict_layers"] = d["num_mtp_layers"]
        if isinstance(known.get("rope_scaling"), dict):
            known["rope_scaling"] = {k: v for k, v in known["rope_scaling"].items() if k != "rope_theta"}
        return known

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        for key in ("mlp_bias",):
            d.pop(key, None)
        d.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                  "attention_bias": self.attention_bias, "head_dim": self.qk_rope_head_dim,
                  "num_key_value_heads": self.num_attention_heads, "qk_head_dim": self.qk_head_dim, **ROUTER_KEYS})
        return d

    # ------------------------------------------------------------------ counts
    def attention_parameters(self) -> int:
        """One MLA block's projections and latent norms."""
        h, n = self.hidden_size, self.num_attention_heads
        bias = self.attention_bias
        if self.q_lora_rank is None:
            q = h * n * self.qk_head_dim
        else:
            r = self.q_lora_rank
            q = h * r + (r if bias else 0) + r + r * n * self.qk_head_dim
        c = self.kv_lora_rank + self.qk_rope_head_dim
        kv = h * c + (c if bias else 0) + self.kv_lora_rank + self.kv_lora_rank * n * (self.qk_nope_head_dim +
                                                                                       self.v_head_dim)
        o = n * self.v_head_dim * h + (h if bias else 0)
        return q + kv + o

    def _block_parameters(self, layer_id: int) -> int:
        h = self.hidden_size
        if self.is_moe_layer(layer_id):
            ffn = self.n_routed_experts * (h + 3 * h * self.moe_intermediate_size)
            ffn += 3 * h * self.shared_expert_intermediate_size
        else:
            ffn = 3 * h * self.intermediate_size
        return self.attention_parameters() + ffn + 2 * h

    def mtp_parameters(self) -> int:
        """The multi-token-prediction modules: two input norms, the ``2h -> h`` projection, a block and
        the output norm each (the embedding and the head are the model's)."""
        return self.tail_extra_parameters() + sum(self._block_parameters(i) for i in self.tail_layer_ids())

    def layer_parameters(self) -> int:
        """Parameters of the mean decoder block, rounded down; :meth:`num_parameters` is exact."""
        return sum(self._block_parameters(i) for i in range(self.num_hidden_layers)) // self.num_hidden_layers

    def num_parameters(self) -> int:
        blocks = sum(self._block_parameters(i) for i in range(self.num_hidden_layers))
        rest = super().num_parameters() - self.num_hidden_layers * self.layer_parameters()
        return rest + blocks + self.mtp_parameters()

    def inactive_expert_parameters(self) -> int:
        """Expert parameters a token does not use (what model FLOPs leave out, :mod:`plait.models.flops`)."""
        unused = self.n_routed_experts - self.num_experts_per_tok
        sparse = self.moe_layer_ids() + [i for i in self.tail_layer_ids() if self.is_moe_layer(i)]
        return len(sparse) * unused * 3 * self.hidden_size * self.moe_intermediate_size

    def block_shape(self) -> BlockShape:
        """Llama's MLP and norms with the latent attention's shape."""
        latent = LatentAttentionShape(q_rank=self.q_lora_rank, kv_rank=self.kv_lora_rank,
                                      rope_dim=self.qk_rope_head_dim, nope_dim=self.qk_nope_head_dim,
                                      v_dim=self.v_head_dim)
        return BlockShape(fused_qkv=False, qkv_bias=self.attention_bias, o_bias=self.o_proj_bias, gated_mlp=True,
                          mlp_bias=False, norm="rms", parallel_residual=False, rotary_dim=self.qk_rope_head_dim,
                          latent=latent)

    def tail_layer_ids(self) -> list[int]:
        """The prediction modules' blocks, numbered on from the decoder's."""
        return [self.num_hidden_layers + k for k in range(self.num_nextn_predict_layers)]

    def tail_extra_parameters(self) -> int:
        """Each prediction module's two input norms, ``eh_proj`` and output norm."""
        h = self.hidden_size
        return self.num_nextn_predict_layers * (3 * h + 2 * h * h)

    def last_stage_holds_embedding(self) -> bool:
        """A tied head, or prediction modules embedding the tokens ahead."""
        return self.tie_word_embeddings or self.num_nextn_predict_layers > 0

    def attention_matmul_width(self) -> int:
        """Per head: ``QK^T`` over ``qk_head_dim`` channels, ``PV`` over ``v_head_dim``."""
        return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)

__all__ = ["LATENT_NORM_EPS", "DeepseekV3Config"]
