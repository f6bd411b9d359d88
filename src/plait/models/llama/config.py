"""Architecture hyper-parameters of a Llama-family model, with Hugging Face ``config.json`` I/O."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, overload

T = TypeVar("T")
#: a config class of the Llama family or one derived from it (what ``from_hf_dict`` builds)
ConfigT = TypeVar("ConfigT", bound="LlamaConfig")


class ModelConfigError(ValueError):
    """A model configuration that cannot describe a valid model."""


#: ``config.json`` model types this family reads: Llama, and Qwen2 (Llama with q/k/v biases), which
#: :meth:`LlamaConfig.to_hf_dict` also writes. Another architecture (GPT-2, Mistral's sliding window,
#: MoE models) would be silently misread with Llama defaults filling the gaps, so it is refused.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

#: ``config.json`` keys without which the architecture is not described: a missing one would
#: silently take a Llama default (e.g. 32 layers of width 4096) instead of the checkpoint's value.
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings")

ROPE_TYPES = ("default", "llama3")
#: keys a ``llama3`` rope_scaling mapping may hold (``rope_theta`` comes with Hugging Face's newer
#: ``rope_parameters``, which :meth:`LlamaConfig.from_hf_dict` maps to ``rope_scaling``)
LLAMA3_ROPE_KEYS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings", "rope_theta")
#: defaults :func:`plait.models.llama.model.rope_inv_freq` uses when a ``llama3`` mapping omits them
LLAMA3_FREQ_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}


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


def rope_scaling_problems(scaling: Any) -> list[str]:
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
        return [f"needs rope_type (one of {', '.join(map(repr, ROPE_TYPES))}); use null for no scaling"]
    if len({str(v) for v in kinds.values()}) > 1:
        return [f"type={_show(kinds['type'])} disagrees with rope_type={_show(kinds['rope_type'])}; keep one"]
    key, kind = next(iter(kinds.items()))
    if kind not in ROPE_TYPES:
        return [f"{key}={_show(kind)} is not supported; valid: {', '.join(map(repr, ROPE_TYPES))}"]
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


def check_hf_architecture(d: dict[str, Any], model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES,
                           family: str = "Llama") -> None:
    """Refuse a ``config.json`` mapping that does not describe a model this family can run:
    another model type, or one missing the keys that fix the architecture."""
    model_type = d.get("model_type")
    supported = ", ".join(map(repr, model_types))
    if model_type is None:
        raise ModelConfigError(f"has no model_type; the {family} family reads configs of model_type {supported}; "
                               f"add \"model_type\": \"{model_types[0]}\" if this is such a model")
    if model_type not in model_types:
        raise ModelConfigError(f"model_type {model_type!r} is not supported; the {family} family runs "
                               f"models of model_type {supported}")


class Derived(Generic[T]):
    """A config field that may be given as ``None`` ("derive it from the others") and is always a
    ``T`` once ``__post_init__`` has filled it in (e.g. ``head_dim`` from ``hidden_size``).

    A data descriptor, so the constructor and Hugging Face's ``null`` take ``None`` while every
    reader sees the resolved value's type. The value lives in the instance ``__dict__`` under the
    field's own name, so ``vars()``, ``asdict``, ``replace``, pickling and ``repr`` are those of a
    plain field; read on the class it gives ``None``, which the dataclass takes as the default.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> None: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> T | None:
        if obj is None:
            return None
        try:
            value: T = obj.__dict__[self.name]
        except KeyError:  # read before the constructor set it
            raise AttributeError(self.name) from None
        return value

    def __set__(self, obj: object, value: T | None) -> None:
        obj.__dict__[self.name] = value


@dataclass
class LlamaConfig:
    """Field names follow Hugging Face's ``LlamaConfig`` so ``config.json`` maps one to one.

    The class attributes name the family (the key of :mod:`plait.models.registry`), the
    ``config.json`` model types it reads and the keys such a file must hold; a family derived
    from Llama's (Qwen3, Mistral) overrides them.
    """

    family: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = SUPPORTED_MODEL_TYPES
    required_hf_keys: ClassVar[tuple[str, ...]] = REQUIRED_HF_KEYS

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    #: ``None``: one KV head per query head (multi-head attention)
    num_key_value_heads: Derived[int] = Derived()
    #: ``None``: ``hidden_size // num_attention_heads``
    head_dim: Derived[int] = Derived()
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    #: bias on the attention output projection; ``None`` follows ``attention_bias`` (Llama),
    #: ``False`` with ``attention_bias=True`` gives Qwen2-style q/k/v-only biases.
    o_proj_bias: Derived[bool] = Derived()
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
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ModelConfigError(f"model.{name}={value!r} must be a finite number > 0")
        problems = rope_scaling_problems(self.rope_scaling)
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
    def from_hf_dict(cls: type[ConfigT], d: dict[str, Any]) -> ConfigT:
        """The config a Hugging Face ``config.json`` mapping describes; another architecture or a
        mapping missing an architecture key raises :class:`ModelConfigError` (see
        :func:`check_hf_architecture`)."""
        check_hf_architecture(d, cls.model_types, cls.family.capitalize())
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
        missing = [k for k in cls.required_hf_keys if k not in d]
        if missing:
            raise ModelConfigError(f"lacks {', '.join(missing)}; a model_type {d['model_type']!r} config needs "
                                   f"{', '.join(cls.required_hf_keys)} (plait does not guess an architecture)")
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

    def layer_parameters(self) -> int:
        """Parameters of one decoder block (attention, MLP, two norms)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attn + mlp + 2 * h

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        h = self.hidden_size
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * self.layer_parameters() + h + head

    def attention_span(self, seq_len: int) -> int:
        """Keys a query's attention is counted over at sequence length ``seq_len`` (model FLOPs):
        the whole sequence for full causal attention; a sliding-window family counts its window."""
        return seq_len
