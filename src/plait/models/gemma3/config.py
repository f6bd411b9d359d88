"""Architecture hyper-parameters of a Gemma 3 text model (Hugging Face ``model_type: gemma3_text``).

Gemma 3's block on top of Llama's fields: four RMSNorms per block (before and after attention and
the MLP), each and the per-head q/k norms scaled by ``1 + weight``; a GeGLU MLP
(``hidden_activation``); the embedding scaled by ``sqrt(hidden_size)``; the attention softmax
scaled by ``query_pre_attn_scalar ** -0.5``; and layers of two kinds (``layer_types``):
``sliding_attention`` layers see the ``sliding_window`` most recent positions with rotary base
``rope_local_base_freq``, ``full_attention`` layers see the whole context with ``rope_theta`` and
``rope_scaling`` (Hugging Face 5 writes both as ``rope_parameters`` keyed by layer type).
Gemma 2's logit soft-capping is not part of Gemma 3 and is refused, as is bidirectional attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.decoder.config import REQUIRED_HF_KEYS, Derived
from plait.models.decoder.shapes import BlockShape
from plait.models.errors import ModelConfigError
from plait.models.llama.config import LlamaConfig
from plait.nn.mlp import ACTIVATIONS

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
#: Hugging Face's defaults for keys an older ``config.json`` may lack
HF_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}


def _positive(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
            and value > 0)


@dataclass
class Gemma3Config(LlamaConfig):
    """Field names follow Hugging Face's ``Gemma3TextConfig``."""

    family: ClassVar[str] = "gemma3"
    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text",)
    #: Hugging Face's default ``head_dim`` (256) rarely fits a small model: required, never guessed
    required_hf_keys: ClassVar[tuple[str, ...]] = REQUIRED_HF_KEYS + ("head_dim",)
    rope_types: ClassVar[tuple[str, ...]] = ("default", "linear")
    checkpointable_modules: ClassVar[tuple[str, ...]] = (
        "input_layernorm", "self_attn", "self_attn.core", "post_attention_layernorm", "pre_feedforward_layernorm",
        "mlp", "mlp.act", "post_feedforward_layernorm")

    vocab_size: int = 262208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    rms_norm_eps: float = 1e-6
    #: rotary base of the full-attention layers (their ``rope_scaling`` too)
    rope_theta: float = 1000000.0
    #: rotary base of the sliding-window layers (never scaled); ``None``: 10000
    rope_local_base_freq: Derived[float] = Derived()
    #: positions a sliding layer's query sees, itself included
    sliding_window: int | None = 4096
    #: every this many layers is a full-attention one (the last of each group), when ``layer_types`` is not
    #: given; ``None``: 6
    sliding_window_pattern: Derived[int] = Derived()
    #: ``"sliding_attention"`` or ``"full_attention"`` per layer; ``None``: from ``sliding_window_pattern``
    layer_types: Derived[list[str]] = Derived()
    #: the softmax scale is ``query_pre_attn_scalar ** -0.5``; ``None``: ``head_dim`` (the usual scale)
    query_pre_attn_scalar: Derived[float] = Derived()
    #: the gate's activation in the GeGLU MLP
    hidden_activation: str = "gelu_pytorch_tanh"
    #: Gemma 2's soft-capping, null in Gemma 3: refused when set
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.rope_local_base_freq is None:
            self.rope_local_base_freq = 10000.0
        if self.sliding_window_pattern is None:
            self.sliding_window_pattern = 6
        if self.layer_types is None:
            p = self.sliding_window_pattern
            if isinstance(p, bool) or not isinstance(p, int) or p < 1:
                raise ModelConfigError(f"model.sliding_window_pattern={p!r} must be a positive integer (every that "
                                       f"many layers is a full-attention one)")
            self.layer_types = [SLIDING if (i + 1) % p else FULL for i in range(self.num_hidden_layers)]
        else:
            self.layer_types = list(self.layer_types)
        super().__post_init__()  # resolves head_dim, then validates
        if self.query_pre_attn_scalar is None:
            self.query_pre_attn_scalar = self.head_dim
            self.validate()

    def validate(self) -> None:
        super().validate()
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                raise ModelConfigError(f"model.{name}={getattr(self, name)!r} is not supported: Gemma 3 has no logit "
                                       f"soft-capping (plait does not run Gemma 2's); set it to null")
        if self.mlp_bias:
            raise ModelConfigError("model.mlp_bias=true: Gemma 3's MLP has no biases; set it to false")
        if self.o_proj_bias != self.attention_bias:
            raise ModelConfigError(f"o_proj_bias={self.o_proj_bias} differs from attention_bias={self.attention_bias}; "
                                   f"Gemma 3 biases q/k/v and o together")
        if self.hidden_activation not in ACTIVATIONS:
            raise ModelConfigError(f"model.hidden_activation={self.hidden_activation!r} is not supported; valid: "
                                   f"{', '.join(map(repr, ACTIVATIONS))}")
        types = self.layer_types
        if types is not None:
            if len(types) != self.num_hidden_layers:
                raise ModelConfigError(f"model.layer_types has {len(types)} entries for num_hidden_layers="
                                       f"{self.num_hidden_layers}; give one per layer")
            bad = [t for t in types if t not in LAYER_TYPES]
            if bad:
                raise ModelConfigError(f"model.layer_types holds {bad[0]!r}; valid: "
                                       f"{', '.join(map(repr, LAYER_TYPES))}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ModelConfigError(f"model.sliding_window={w!r} must be a positive integer (positions a query sees, "
                                   f"itself included) or null")
        if w is None and types is not None and SLIDING in types:
            raise ModelConfigError("model.sliding_window=None leaves the sliding_attention layers of "
                                   "model.layer_types without a window; give the window")
        if not _positive(self.rope_local_base_freq):
            raise ModelConfigError(f"model.rope_local_base_freq={self.rope_local_base_freq!r} must be a finite "
                                   f"number > 0")
        if self.query_pre_attn_scalar is not None and not _positive(self.query_pre_attn_scalar):
            raise ModelConfigError(f"model.query_pre_attn_scalar={self.query_pre_attn_scalar!r} must be a finite "
                                   f"number > 0 (the softmax scale is its inverse square root)")

    # ------------------------------------------------------------------ per layer
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (``None``: full causal attention)."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def softmax_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def attention_span(self, seq_len: int) -> int:
        """The mean over the layers of the keys a query sees: the window on sliding layers."""
        spans = [min(seq_len, w) if (w := self.window_of(i)) is not None else seq_len
                 for i in range(self.num_hidden_layers)]
        return round(sum(spans) / len(spans))

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def hf_fields(cls, d: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """``rope_parameters`` keyed by layer type (Hugging Face 5) or the released
        ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` keys; Hugging Face's defaults
        for the keys an older file lacks; bidirectional attention refused."""
        if d.get("use_bidirectional_attention"):
            raise ModelConfigError("use_bidirectional_attention=true is not supported (plait trains causal "
                                   "decoders); set it to false")
        known = dict(known)
        for key, value in HF_DEFAULTS.items():
            known.setdefault(key, value)
        if "hidden_act" in d and "hidden_activation" not in d:  # the older spelling
            known["hidden_activation"] = d["hidden_act"]
        params = d.get("rope_parameters")
        if isinstance(params, dict) and (FULL in params or SLIDING in params):
            full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
            if "rope_theta" in full:
                known["rope_theta"] = full["rope_theta"]
            known["rope_scaling"] = dict(full) if full.get("rope_type", "default") != "default" else None
            if "rope_theta" in local:
                known["rope_local_base_freq"] = local["rope_theta"]
            if local.get("rope_type", "default") != "default":
                raise ModelConfigError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is not "
                                       f"supported (Gemma 3's sliding layers are unscaled); use 'default'")
        if isinstance(known.get("rope_scaling"), dict):
            known["rope_scaling"] = {k: v for k, v in known["rope_scaling"].items() if k != "rope_theta"}
        return known

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        for key in ("hidden_act", "mlp_bias", "rope_theta", "rope_scaling", "rope_local_base_freq",
                    "sliding_window_pattern"):
            d.pop(key, None)
        full = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        full.update({k: v for k, v in (self.rope_scaling or {}).items() if k not in ("type", "rope_type")})
        d.update({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                  "attention_bias": self.attention_bias, "layer_types": list(self.layer_types),
                  "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_base_freq},
                                      FULL: full},
                  "use_bidirectional_attention": False})
        return d

    # ------------------------------------------------------------------ counts
    def block_shape(self) -> BlockShape:
        """Llama's separate q/k/v and gated MLP (GeGLU), four RMSNorms, the sequential residual."""
        return BlockShape(fused_qkv=False, qkv_bias=self.attention_bias, o_bias=self.o_proj_bias, gated_mlp=True,
                          mlp_bias=False, norm="rms", parallel_residual=False, rotary_dim=self.head_dim,
                          activation=self.hidden_activation, norms=4)

    def layer_parameters(self) -> int:
        """Llama's block, two more norms and the per-head q/k norm weights (``head_dim`` each)."""
        return super().layer_parameters() + 2 * self.hidden_size + 2 * self.head_dim


__all__ = ["FULL", "LAYER_TYPES", "SLIDING", "Gemma3Config"]
