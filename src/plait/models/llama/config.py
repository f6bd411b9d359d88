"""Architecture hyper-parameters of a Llama-family model, with Hugging Face ``config.json`` I/O."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """A model configuration that cannot describe a valid model."""


@dataclass
class LlamaConfig:
    """Field names follow Hugging Face's ``LlamaConfig`` so ``config.json`` maps one to one."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    #: bias on the attention output projection; ``None`` follows ``attention_bias`` (Llama),
    #: ``False`` with ``attention_bias=True`` gives Qwen2-style q/k/v-only biases.
    o_proj_bias: bool | None = None
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    #: dropout on the attention weights (Hugging Face's name; read from and written to config.json)
    attention_dropout: float = 0.0
    #: plait-only residual dropout on the attention and MLP outputs; written to config.json only when
    #: non-zero (Hugging Face Llama has no such field and keeps it as an unused attribute)
    hidden_dropout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly or change the head count"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"model.{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs "
                f"a whole number of query heads per KV head"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ModelConfigError(f"model.{name}={value!r} must be a probability in [0, 1)")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ModelConfigError(
                    f"rope_scaling.rope_type={kind!r} is not supported; valid: 'default', 'llama3'"
                )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        if d.get("model_type") == "qwen2":
            if d.get("use_sliding_window"):
                raise ModelConfigError(
                    "use_sliding_window=true is not supported (plait runs full causal attention); "
                    "set use_sliding_window=false in config.json if the model was trained without it"
                )
            known.setdefault("attention_bias", True)
            known.setdefault("o_proj_bias", False)
        if "rope_theta" not in known and isinstance(d.get("rope_parameters"), dict):
            params = d["rope_parameters"]
            known["rope_theta"] = params.get("rope_theta", cls.rope_theta)
            if params.get("rope_type", "default") != "default":
                known["rope_scaling"] = dict(params)
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_hf_dict(self) -> dict[str, Any]:
        qwen2 = self.attention_bias and not self.o_proj_bias
        if self.o_proj_bias and not self.attention_bias:
            raise ModelConfigError(
                "o_proj_bias=True with attention_bias=False has no Hugging Face counterpart "
                "(Llama biases q/k/v/o together, Qwen2 only q/k/v)"
            )
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "o_proj_bias")}
        if not self.hidden_dropout:
            del d["hidden_dropout"]
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        rope.update({k: v for k, v in (self.rope_scaling or {}).items() if k not in ("type", "rope_type")})
        d.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "use_cache": True, "rope_parameters": rope})
        if qwen2:  # q/k/v biases without an output bias is Qwen2's architecture
            del d["attention_bias"]
            d.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False})
        return d

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * per_layer + h + head
