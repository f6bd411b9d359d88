"""Architecture hyper-parameters of a GPT-NeoX model (Hugging Face ``model_type: gpt_neox``; Pythia).

GPT-NeoX's block differs from Llama's in every part, so the config derives from the generic
:class:`~plait.models.decoder.config.DecoderConfig`, not from Llama's:

- layer norms with a bias (``layer_norm_eps``) before attention, before the MLP and after the
  last block;
- one fused q/k/v projection per head (``attention_bias`` on it and on the output projection), no
  grouped-query attention (``num_key_value_heads`` equals ``num_attention_heads``, ``head_dim`` is
  ``hidden_size / num_attention_heads``);
- partial rotary embeddings: the first ``int(head_dim * partial_rotary_factor)`` dimensions of
  each head rotate (base ``rope_theta``), the rest pass through;
- a plain MLP with biases and the activation ``hidden_act`` (Pythia: the exact GeLU);
- ``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))`` (Pythia, GPT-NeoX-20B) or the
  sequential ``h = x + attn(ln1(x)); h + mlp(ln2(h))``;
- an untied output head (``embed_out``): plait refuses ``tie_word_embeddings``.

Field names are Hugging Face's current ones (``rope_theta`` and ``partial_rotary_factor`` are the
keys of transformers 5's ``rope_parameters``); :meth:`GPTNeoXConfig.hf_fields` also reads the
spellings of the released Pythia and GPT-NeoX ``config.json`` files (``rotary_pct``,
``rotary_emb_base``) with transformers' defaults when they are absent (0.25 and 10000), and
:meth:`GPTNeoXConfig.to_hf_dict` writes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.decoder.config import DecoderConfig, Derived
from plait.models.decoder.shapes import BlockShape
from plait.models.errors import ModelConfigError
from plait.nn.mlp import ACTIVATIONS

#: transformers' values when a config.json does not give them
HF_PARTIAL_ROTARY_FACTOR = 0.25
HF_ROPE_THETA = 10000.0
#: the fields a ``None`` (a recipe's null) gives transformers' default
HF_DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "partial_rotary_factor": HF_PARTIAL_ROTARY_FACTOR,
                               "use_parallel_residual": True, "hidden_act": "gelu"}


def _finite_positive(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(float(value)) and value > 0


@dataclass
class GPTNeoXConfig(DecoderConfig):
    """Field names follow Hugging Face's ``GPTNeoXConfig``; the default sizes are GPT-NeoX-20B's,
    as transformers' are."""

    family: ClassVar[str] = "gpt_neox"
    model_types: ClassVar[tuple[str, ...]] = ("gpt_neox",)
    checkpointable_modules: ClassVar[tuple[str, ...]] = ("input_layernorm", "attention", "attention.core",
                                                         "post_attention_layernorm", "mlp", "mlp.act")
    selective_checkpoint_modules: ClassVar[tuple[str, ...]] = ("attention.core", "mlp.act")

    vocab_size: int = 50432
    hidden_size: int = 6144
    intermediate_size: int = 24576
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    max_position_embeddings: int = 2048
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    #: ``None`` (also below): transformers' default, 1e-5
    layer_norm_eps: Derived[float] = Derived()
    rope_theta: float = HF_ROPE_THETA
    #: share of each head's dimensions that rotate (Hugging Face's older ``rotary_pct``); ``None``: 0.25
    partial_rotary_factor: Derived[float] = Derived()
    #: ``None``: plain rotary; a scaled rope type is refused (plait runs GPT-NeoX's default rotary)
    rope_scaling: dict[str, Any] | None = None
    #: ``None``: true
    use_parallel_residual: Derived[bool] = Derived()
    #: ``None``: ``"gelu"``
    hidden_act: Derived[str] = Derived()
    #: biases on ``query_key_value`` and ``dense`` (the MLP always has them)
    attention_bias: bool = True

    def __post_init__(self) -> None:
        for name, default in HF_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        super().__post_init__()

    @property
    def rope_type(self) -> str:
        return "default"

    @property
    def rotary_ndims(self) -> int:
        """The rotated dimensions of each head (Hugging Face's ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def validate(self) -> None:
        super().validate()
        problems = []
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append(f"model.num_key_value_heads={self.num_key_value_heads} differs from num_attention_heads="
                            f"{self.num_attention_heads}; GPT-NeoX has no grouped-query attention: set "
                            f"num_key_value_heads to {self.num_attention_heads}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            problems.append(f"model.head_dim={self.head_dim} is not hidden_size / num_attention_heads = "
                            f"{self.hidden_size} / {self.num_attention_heads}; GPT-NeoX's heads split the hidden "
                            f"size: leave head_dim null")
        for name in ("layer_norm_eps", "rope_theta"):
            if not _finite_positive(getattr(self, name)):
                problems.append(f"model.{name}={getattr(self, name)!r} must be a finite number > 0")
        factor = self.partial_rotary_factor
        if not _finite_positive(factor) or factor > 1:
            problems.append(f"model.partial_rotary_factor={factor!r} must be a number in (0, 1] (the share of "
                            f"each head that rotates; Pythia: 0.25)")
        elif self.rotary_ndims < 2 or self.rotary_ndims % 2:
            problems.append(f"model.partial_rotary_factor={factor!r} rotates int({self.head_dim} * {factor}) = "
                            f"{self.rotary_ndims} dimensions of each head; rotary needs an even number, at "
                            f"least 2: choose a factor giving one")
        if self.rope_scaling is not None:
            problems.append(f"model.rope_scaling={self.rope_scaling!r} is not supported for gpt_neox (plait runs "
                            f"its default rotary embedding); set it to null")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"model.hidden_act={self.hidden_act!r} is not supported; valid: "
                            f"{', '.join(map(repr, ACTIVATIONS))}")
        if not isinstance(self.use_parallel_residual, bool):
            problems.append(f"model.use_parallel_residual={self.use_parallel_residual!r} must be true or false")
        if self.tie_word_embeddings:
            problems.append("model.tie_word_embeddings=true is not supported for gpt_neox (its output head "
                            "embed_out is its own weight in every released model); set it to false")
        if problems:
            raise ModelConfigError("; ".join(problems))

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def hf_fields(cls, d: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """transformers 5's ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``,
        ``rope_type``), the released configs' ``rotary_emb_base`` / ``rotary_pct`` and an old
        ``rope_scaling``; a scaled rope type is kept so that :meth:`validate` refuses it."""
        known = dict(known)
        params = d.get("rope_parameters")
        if isinstance(params, dict):
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in params:
                    known.setdefault(key, params[key])
            if params.get("rope_type", "default") != "default":
                known.setdefault("rope_scaling", dict(params))
        for legacy, name in (("rotary_emb_base", "rope_theta"), ("rotary_pct", "partial_rotary_factor")):
            if legacy in d:
                known.setdefault(name, d[legacy])
        return known

    def to_hf_dict(self) -> dict[str, Any]:
        """``rope_parameters`` for transformers 5 and the legacy ``rotary_pct`` / ``rotary_emb_base``
        for older readers (both describe the same rotary); no ``head_dim`` or
        ``num_key_value_heads``, which a GPT-NeoX config does not have."""
        d = super().to_hf_dict()
        for key in ("head_dim", "num_key_value_heads", "rope_scaling", "rope_theta", "partial_rotary_factor"):
            del d[key]
        d.update({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "use_cache": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.partial_rotary_factor},
                  "rotary_emb_base": self.rope_theta, "rotary_pct": self.partial_rotary_factor})
        return d

    # ------------------------------------------------------------------ counts
    def block_shape(self) -> BlockShape:
        """GPT-NeoX's block: the fused q/k/v, the plain MLP with biases, two layer norms, the parallel
        (or sequential) residual, partial rotary."""
        return BlockShape(fused_qkv=True, qkv_bias=self.attention_bias, o_bias=self.attention_bias, gated_mlp=False,
                          mlp_bias=True, norm="layer", parallel_residual=self.use_parallel_residual,
                          rotary_dim=self.rotary_ndims, activation=self.hidden_act)

    def layer_parameters(self) -> int:
        """One block: the fused q/k/v projection and the output projection (with ``attention_bias``),
        the MLP with its biases, two layer norms (weight and bias each)."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        attn = 3 * q * h + q * h + ((3 * q + h) if self.attention_bias else 0)
        mlp = 2 * h * i + i + h
        return attn + mlp + 4 * h

    def final_norm_parameters(self) -> int:
        """The final layer norm's weight and bias."""
        return 2 * self.hidden_size


__all__ = ["GPTNeoXConfig"]
