"""What every decoder-only family's config holds, and the interface the rest of plait calls on it.

A family's config (:class:`~plait.models.llama.config.LlamaConfig`, and through it Qwen3, Mistral,
Mixtral and Qwen3-MoE) is a dataclass derived from :class:`DecoderConfig`: the sizes every decoder
has (vocabulary, width, depth, attention heads, context), the embedding tie, the initialisation
scale, the special tokens and the dropouts, under Hugging Face's field names so that a
``config.json`` maps one to one. What differs between families (the norm and its epsilon, the
positional encoding, biases, experts, a sliding window) is the family's own fields and overrides:

- :meth:`DecoderConfig.validate` (extended with ``super().validate()``) raises
  :class:`~plait.models.errors.ModelConfigError` naming the field, the value and the fix;
- :meth:`DecoderConfig.hf_fields` maps the family's Hugging Face spellings when reading a
  ``config.json``, :meth:`DecoderConfig.to_hf_dict` adds its ``model_type`` and own keys;
- :meth:`DecoderConfig.layer_parameters` counts one block and :meth:`DecoderConfig.block_shape`
  describes its parts to the planner (the family's block decides);
  :meth:`DecoderConfig.num_parameters` and :meth:`DecoderConfig.attention_span` (model FLOPs,
  pipeline costs) have generic defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, overload

from plait.models.decoder.shapes import BlockShape
from plait.models.errors import ModelConfigError

T = TypeVar("T")
#: a family's config class (what ``from_hf_dict`` builds)
ConfigT = TypeVar("ConfigT", bound="DecoderConfig")

#: ``config.json`` keys without which a decoder is not described: a missing one would silently take
#: a default (e.g. 32 layers of width 4096) instead of the checkpoint's value.
REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings")

#: the size fields that must be positive integers, in the order they are checked
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_hf_architecture(d: dict[str, Any], model_types: tuple[str, ...], family: str) -> None:
    """Refuse a ``config.json`` mapping that does not describe a model of ``family``: no
    ``model_type``, or another one than ``model_types``."""
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
class DecoderConfig:
    """The fields every decoder-only family shares, with Hugging Face's names.

    Class attributes a family sets: ``family`` (the key of :mod:`plait.models.registry` and the
    recipe's ``model.family``), ``model_types`` (the ``config.json`` model types it reads) and
    ``required_hf_keys`` (the keys such a file must hold). The defaults are Llama 2 7B's sizes; a
    family overrides the ones that differ.
    """

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    required_hf_keys: ClassVar[tuple[str, ...]] = REQUIRED_HF_KEYS
    #: the submodules of one decoder block (block-relative names) that selective activation
    #: checkpointing may name (:mod:`plait.activation_checkpointing`): Llama's block by default
    checkpointable_modules: ClassVar[tuple[str, ...]] = ("input_layernorm", "self_attn", "self_attn.core",
                                                         "post_attention_layernorm", "mlp", "mlp.act")
    #: what selective checkpointing recomputes when no names are given: the block's weight-free parts
    #: (the attention core and the MLP's activation), whose saved activations are large and cheap to redo
    selective_checkpoint_modules: ClassVar[tuple[str, ...]] = ("self_attn.core", "mlp.act")

    vocab_size: int = 32000
    hidden_size: int = 4096
    #: the feed-forward width (of a dense block)
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    #: ``None``: one KV head per query head (multi-head attention)
    num_key_value_heads: Derived[int] = Derived()
    #: ``None``: ``hidden_size // num_attention_heads``
    head_dim: Derived[int] = Derived()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    #: dropout on the attention weights (Hugging Face's name; read from and written to config.json)
    attention_dropout: float = 0.0
    #: plait-only residual dropout on the attention and MLP outputs; written to config.json only when
    #: non-zero (Hugging Face's configs have no such field and keep it as an unused attribute)
    hidden_dropout: float = 0.0
    #: the ``config.json`` keys that are not fields, kept as read
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly or change the head count"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ModelConfigError` for a value no decoder can have; a family extends it."""
        for name in _POSITIVE_INT_FIELDS:
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

    # ------------------------------------------------------------------ Hugging Face I/O
    @classmethod
    def from_hf_dict(cls: type[ConfigT], d: dict[str, Any]) -> ConfigT:
        """The config a Hugging Face ``config.json`` mapping describes; another model type or a
        mapping missing one of ``required_hf_keys`` raises :class:`ModelConfigError`. Keys that are
        not fields are kept in ``extra``."""
        check_hf_architecture(d, cls.model_types, cls.family.capitalize())
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = cls.hf_fields(d, {k: v for k, v in d.items() if k in names})
        missing = [k for k in cls.required_hf_keys if k not in d]
        if missing:
            raise ModelConfigError(f"lacks {', '.join(missing)}; a model_type {d['model_type']!r} config needs "
                                   f"{', '.join(cls.required_hf_keys)} (plait does not guess an architecture)")
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    @classmethod
    def hf_fields(cls, d: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments of the ``config.json`` mapping ``d``, given ``known``, its keys
        named like a field. A family maps its other spellings here (Llama: Qwen2's implied biases,
        ``rope_parameters``) and raises :class:`ModelConfigError` for a setting it cannot run."""
        return known

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields under their Hugging Face names (``hidden_dropout`` only when non-zero, ``extra``
        never); a family adds its ``model_type``, ``architectures`` and the keys of its own."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if not self.hidden_dropout:
            del d["hidden_dropout"]
        return d

    # ------------------------------------------------------------------ counts
    def layer_parameters(self) -> int:
        """Parameters of one decoder block; the family's block decides (an MoE family: the mean block)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its decoder block's parameters")

    def block_shape(self) -> BlockShape:
        """The parts of one dense decoder block, as the planner prices them (:class:`BlockShape`);
        the family's block decides."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its decoder block to the planner")

    def final_norm_parameters(self) -> int:
        """Parameters of the norm after the last block: one weight per channel (RMSNorm); a family
        whose norm has a bias too (LayerNorm) counts it."""
        return self.hidden_size

    def tail_layer_ids(self) -> list[int]:
        """Decoder blocks the model runs after its last layer, on the last pipeline stage, numbered on
        from ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction modules); none by default.
        The planner prices each as the block of that layer id, plus :meth:`tail_extra_parameters`."""
        return []

    def tail_extra_parameters(self) -> int:
        """Parameters of the tail modules besides their blocks (whole on every TP rank)."""
        return 0

    def last_stage_holds_embedding(self) -> bool:
        """Whether the last pipeline stage keeps a copy of the token embedding, its gradient summed with
        the first stage's: a tied head's, or the tail modules' inputs (DeepSeek-V3's)."""
        return self.tie_word_embeddings

    def attention_matmul_width(self) -> int:
        """Summed over the query heads, the channels ``QK^T`` and ``PV`` contract per key (model FLOPs:
        ``6 * width * span`` per token and layer): ``2 * heads * head_dim`` when keys and values have
        the head's width."""
        return 2 * self.num_attention_heads * self.head_dim

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        h = self.hidden_size
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_hidden_layers * self.layer_parameters() + self.final_norm_parameters() + head

    def attention_span(self, seq_len: int) -> int:
        """Keys a query's attention is counted over at sequence length ``seq_len`` (model FLOPs):
        the whole sequence for full causal attention; a sliding-window family counts its window."""
        return seq_len


__all__ = ["REQUIRED_HF_KEYS", "ConfigT", "DecoderConfig", "Derived", "check_hf_architecture"]
