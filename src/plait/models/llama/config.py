"""Architecture hyper-parameters of a Llama-family model, with Hugging Face ``config.json`` I/O.

Llama's decoder on top of :class:`~plait.models.decoder.config.DecoderConfig`: RMSNorm (its
epsilon), rotary embeddings (base and Llama 3 frequency scaling), optional q/k/v and output biases
(Qwen2's q/k/v-only biases included) and the SwiGLU MLP's parameter count.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from plait.models.decoder.config import DecoderConfig, Derived
from plait.models.decoder.shapes import BlockShape
from plait.models.errors import ModelConfigError

#: ``config.json`` model types this family reads: Llama, and Qwen2 (Llama with q/k/v biases), which
#: :meth:`LlamaConfig.to_hf_dict` also writes. Another architecture (GPT-2, Mistral's sliding window,
#: MoE models) would be silently misread with Llama defaults filling the gaps, so it is refused.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

ROPE_TYPES = ("default", "llama3")
#: keys a ``llama3`` rope_scaling mapping may hold (``rope_theta`` comes with Hugging Face's newer
#: ``rope_parameters``, which :meth:`LlamaConfig.from_hf_dict` maps to ``rope_scaling``)
LLAMA3_ROPE_KEYS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings", "rope_theta")
#: defaults :func:`plait.models.llama.model.rope_inv_freq` uses when a ``llama3`` mapping omits them
LLAMA3_FREQ_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
#: keys a ``yarn`` rope_scaling mapping may hold (:func:`plait.nn.rotary.yarn_inv_freq`)
YARN_ROPE_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim", "attention_factor", "truncate", "rope_theta")


def _is_number(value: Any) -> bool:
    """An int or float (not a bool) that is a finite float: what the frequency math can use."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        return False


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def rope_scaling_problems(scaling: Any, rope_types: tuple[str, ...] = ROPE_TYPES) -> list[str]:
    """One message per problem of a ``rope_scaling`` mapping, each naming the key, its value and
    what is valid (empty when the mapping is usable). A message about a key starts with it; one
    about the whole mapping starts with "needs" or "must".

    Checked here rather than where the frequencies are computed because a bad value fails late
    and far from its cause: a string ``factor`` raises a TypeError after launch, and a zero
    factor gives infinite frequencies that train to NaN.
    """
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return ["must be a mapping with a rope_type, or null"]
    kinds = {k: scaling[k] for k in ("rope_type", "type") if k in scaling}
    if not kinds:
        return [f"needs rope_type (one of {', '.join(map(repr, rope_types))}); use null for no scaling"]
    if len({str(v) for v in kinds.values()}) > 1:
        return [f"type={_show(kinds['type'])} disagrees with rope_type={_show(kinds['rope_type'])}; keep one"]
    key, kind = next(iter(kinds.items()))
    if kind not in rope_types:
        return [f"{key}={_show(kind)} is not supported; valid: {', '.join(map(repr, rope_types))}"]
    if kind == "linear":
        factor = scaling.get("factor")
        if factor is None or not (_is_number(factor) and factor > 0):
            return [f"factor={_show(factor)} must be a finite number > 0 (rope_type 'linear' divides the positions "
                    f"by it)"]
        return []
    if kind == "yarn":
        return _yarn_problems(scaling)
    if kind != "llama3":
        return []
    problems = []
    for name in scaling:
        if name not in LLAMA3_ROPE_KEYS:
            close = difflib.get_close_matches(str(name), LLAMA3_ROPE_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {_show(close[0])}? " if close else ""
            problems.append(f"{name!s} is not a llama3 rope_scaling key; {hint}valid: "
                            f"{', '.join(LLAMA3_ROPE_KEYS[2:6])}")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in scaling:
            problems.append(f"{name} is missing (rope_type 'llama3' needs it)")
    factor = scaling.get("factor", 1.0)
    if not (_is_number(factor) and factor > 0):
        problems.append(f"factor={_show(factor)} must be a finite number > 0 (the context extension, e.g. 8.0)")
    original = scaling.get("original_max_position_embeddings", 1)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        problems.append(f"original_max_position_embeddings={_show(original)} must be a positive integer (the "
                        f"pre-training context, e.g. 8192)")
    freqs = {k: scaling.get(k, d) for k, d in LLAMA3_FREQ_DEFAULTS.items()}
    bad = [k for k, v in freqs.items() if not (_is_number(v) and v > 0)]
    problems += [f"{k}={_show(freqs[k])} must be a finite number > 0" for k in bad]
    if not bad and freqs["high_freq_factor"] <= freqs["low_freq_factor"]:
        problems.append(f"high_freq_factor={_show(freqs['high_freq_factor'])} must be greater than low_freq_factor="
                        f"{_show(freqs['low_freq_factor'])} (the smoothing between them divides by their difference)")
    return problems


def _yarn_problems(scaling: dict[str, Any]) -> list[str]:
    """What :func:`rope_scaling_problems` finds in a ``yarn`` mapping."""
    problems = []
    for name in scaling:
        if name not in YARN_ROPE_KEYS:
            close = difflib.get_close_matches(str(name), YARN_ROPE_KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {_show(close[0])}? " if close else ""
            problems.append(f"{name!s} is not a yarn rope_scaling key; {hint}valid: {', '.join(YARN_ROPE_KEYS[2:10])}")
    for name in ("factor", "original_max_position_embeddings"):
        if scaling.get(name) is None:
            problems.append(f"{name} is missing (rope_type 'yarn' needs it)")
    factor = scaling.get("factor", 1.0)
    if factor is not None and not (_is_number(factor) and factor > 0):
        problems.append(f"factor={_show(factor)} must be a finite number > 0 (the context extension, e.g. 40.0)")
    original = scaling.get("original_max_position_embeddings", 1)
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        problems.append(f"original_max_position_embeddings={_show(original)} must be a positive integer (the "
                        f"pre-training context, e.g. 4096)")
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        value = scaling.get(name)
        if value is not None and not (_is_number(value) and value >= 0):
            problems.append(f"{name}={_show(value)} must be a finite number >= 0")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        problems.append(f"truncate={_show(truncate)} must be true or false")
    return problems


@dataclass
class LlamaConfig(DecoderConfig):
    """Field names follow Hugging Face's ``LlamaConfig`` so ``config.json`` maps one to one.

    The shared decoder fields are :class:`DecoderConfig`'s; these are Llama's block: the RMSNorm
    epsilon, rotary embeddings and the biases. A family derived from Llama's (Qwen3, Mistral)
    overrides ``family``, ``model_types`` and what differs.
    """

    family: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    #: the ``rope_scaling`` types the family runs (:func:`rope_scaling_problems`)
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    #: bias on the attention output projection; ``None`` follows ``attention_bias`` (Llama),
    #: ``False`` with ``attention_bias=True`` gives Qwen2-style q/k/v-only biases.
    o_proj_bias: Derived[bool] = Derived()
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ModelConfigError(f"model.{name}={value!r} must be a finite number > 0")
        problems = rope_scaling_problems(self.rope_scaling, self.rope_types)
        if problems:
            raise ModelConfigError("; ".join(f"rope_scaling {m}" if m.startswith(("needs", "must")) else
                                             f"rope_scaling.{m}" for m in problems))

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def hf_fields(cls, d: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """Qwen2 (``model_type: qwen2``) is Llama with q/k/v biases and no output bias (a sliding
        window is refused); Hugging Face's newer ``rope_parameters`` gives ``rope_theta`` and, for
        a scaled type, ``rope_scaling``."""
        known = dict(known)
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
        return known

    def to_hf_dict(self) -> dict[str, Any]:
        qwen2 = self.attention_bias and not self.o_proj_bias
        if self.o_proj_bias and not self.attention_bias:
            raise ModelConfigError(
                "o_proj_bias=True with attention_bias=False has no Hugging Face counterpart "
                "(Llama biases q/k/v/o together, Qwen2 only q/k/v)"
            )
        d = super().to_hf_dict()
        del d["o_proj_bias"]  # Hugging Face's attention_bias covers it (or Qwen2's model_type does)
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        rope.update({k: v for k, v in (self.rope_scaling or {}).items() if k not in ("type", "rope_type")})
        d.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "use_cache": True, "rope_parameters": rope})
        if qwen2:  # q/k/v biases without an output bias is Qwen2's architecture
            del d["attention_bias"]
            d.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False})
        return d

    def block_shape(self) -> BlockShape:
        """Llama's block: separate q/k/v, the SwiGLU MLP, two RMSNorms, the sequential residual."""
        return BlockShape(fused_qkv=False, qkv_bias=self.attention_bias, o_bias=self.o_proj_bias, gated_mlp=True,
                          mlp_bias=self.mlp_bias, norm="rms", parallel_residual=False, rotary_dim=self.head_dim)

    def layer_parameters(self) -> int:
        """Parameters of one decoder block (attention, MLP, two norms)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h
