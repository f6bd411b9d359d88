"""The sections of a training recipe: typed pydantic models with defaults and one-line descriptions.

Every field has a default, so an empty recipe is the built-in default (a small Llama trained on
Shakespeare in one process). Unknown keys are rejected (``extra="forbid"``) so a typo such as
``parallel.tpp`` is an error rather than a silently ignored setting. Single-field bounds live
here (``ge=1`` ...); rules between fields live in :mod:`plait.config.validate`.

Integers and booleans are strict (``true`` is not ``1``, ``2.0`` is not ``2``, ``"off"`` is not
``false``); floats accept integers and numeric strings (``"1e-3"`` quoted, or numbers written as text
by another tool). Recipes are read as YAML 1.2, where ``1e-3`` is a float and only ``true``/``false``
are booleans (:mod:`plait.config.load`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from plait.config.applicability import CONDITIONS, applies_when, field_condition
from plait.models.decoder.config import DecoderConfig
from plait.models.errors import ModelConfigError
from plait.models.registry import DEFAULT_FAMILY, config_from_hf_dict, family_names, fitted_to_checkpoint, get_family
from plait.moe.section import MoeSection
from plait.nn.mlp import ACTIVATIONS
from plait.precision import KNOBS
from plait.tracking.settings import MlflowSettings, WandbSettings

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Field(allow_inf_nan=False)]

#: ``model`` fields that describe the architecture; with ``model.hf_path`` they come from config.json
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_scaling", "attention_bias", "tie_word_embeddings", "sliding_window",
               # Mixture-of-Experts families (mixtral, qwen3_moe); null = the family's default
               "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers",
               # gpt_neox; null = the family's default
               "layer_norm_eps", "partial_rotary_factor", "use_parallel_residual", "hidden_act",
               # gemma3; null = the family's default
               "sliding_window_pattern", "query_pre_attn_scalar", "rope_local_base_freq",
               # deepseek_v3; null = the family's default (q_lora_rank: a direct query projection)
               "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
               "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
               "first_k_dense_replace", "num_nextn_predict_layers", "mtp_loss_weight")
#: ``model`` fields among them that are training knobs rather than shape: with ``model.hf_path`` a value
#: the recipe sets is applied to the config read from config.json instead of compared with it
TRAINING_KNOBS = ("mtp_loss_weight",)
#: ``train.objective`` values that train on preference pairs, and those of them measured against a reference
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
REFERENCE_OBJECTIVES = ("dpo", "ipo")
#: ``model.family`` values: the registered model families (:mod:`plait.models.registry`)
FAMILY_CHOICES = family_names()


class Section(BaseModel):
    """Base of every recipe section: unknown keys rejected, assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class RunSection(Section):
    name: str = Field(default="shakespeare-tiny", min_length=1,
                      description="Run name; substituted for {name} in run.output_dir")
    output_dir: str = Field(default="runs/{name}", min_length=1,
                            description="Directory of the run's outputs (metrics, TensorBoard, plot, checkpoint); "
                                        "{name} is replaced by run.name")
    seed: Int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of initialisation, data order and sampling")


class ModelSection(Section):
    family: Literal[FAMILY_CHOICES] = Field(  # type: ignore[valid-type]
        default=DEFAULT_FAMILY, description="Model family (architecture); with model.hf_path it comes from "
                                            "config.json's model_type")
    hf_path: str | None = Field(default=None, description="Initialise from a Hugging Face model "
                                                          "directory; the architecture fields then come "
                                                          "from its config.json and must not be set here "
                                                          "(model.mtp_loss_weight, a training knob, may be)")
    vocab_size: Int | None = Field(default=None, ge=1, description="Embedding rows; null = the tokenizer's size")
    hidden_size: Int = Field(default=256, ge=1, description="Width of the residual stream")
    intermediate_size: Int = Field(default=768, ge=1, description="Width of the gated MLP")
    num_hidden_layers: Int = Field(default=4, ge=1, description="Number of decoder blocks")
    num_attention_heads: Int = Field(default=8, ge=1, description="Query heads per layer")
    num_key_value_heads: Int = Field(default=4, ge=1, description="Key/value heads per layer (grouped-query "
                                                                  "attention); must divide num_attention_heads")
    head_dim: Int | None = Field(default=None, ge=1, description="Width of one head; null = "
                                                                 "hidden_size / num_attention_heads")
    max_position_embeddings: Int = Field(default=256, ge=1, description="Longest sequence the model supports")
    rms_norm_eps: Float = Field(default=1e-5, gt=0, description="Epsilon of the RMS norms")
    rope_theta: Float = Field(default=10000.0, gt=0, description="Base of the rotary position embedding")
    rope_scaling: dict[str, Any] | None = Field(default=None, description="Hugging Face rope_scaling "
                                                                          "mapping (rope_type 'default' "
                                                                          "or 'llama3'; gemma3: 'default' "
                                                                          "or 'linear', on its full "
                                                                          "layers); null = none")
    attention_bias: Bool = Field(default=False, description="Biases on the q/k/v/o projections")
    tie_word_embeddings: Bool = Field(default=True, description="Share the input embedding with the output head")
    sliding_window: Int | None = Field(default=None, ge=1, description="Positions a query attends to, itself "
                                                                       "included (model.family 'mistral'; "
                                                                       "'gemma3': on its sliding layers, "
                                                                       "which need it); null = full attention")
    attention_dropout: Float = Field(default=0.0, ge=0, lt=1, description="Dropout on the attention probabilities")
    hidden_dropout: Float = Field(default=0.0, ge=0, lt=1, description="Dropout on the attention and MLP outputs "
                                                                       "before each residual add")
    initializer_range: Float = Field(default=0.02, gt=0, description="Standard deviation of the initial weights")
    num_local_experts: Int | None = Field(default=None, ge=1, description="mixtral: experts per MoE layer")
    num_experts: Int | None = Field(default=None, ge=1, description="qwen3_moe: experts per MoE layer")
    num_experts_per_tok: Int | None = Field(default=None, ge=1, description="MoE families: experts each token uses "
                                                                           "(top-k)")
    moe_intermediate_size: Int | None = Field(default=None, ge=1, description="qwen3_moe, deepseek_v3: width of "
                                                                             "one expert (mixtral: "
                                                                             "intermediate_size)")
    norm_topk_prob: Bool | None = Field(default=None, description="qwen3_moe, deepseek_v3: renormalise the top-k "
                                                                  "router weights to sum to one (mixtral always "
                                                                  "does)")
    decoder_sparse_step: Int | None = Field(default=None, ge=1, description="qwen3_moe: every this many layers is "
                                                                           "sparse")
    mlp_only_layers: list[Int] | None = Field(default=None, description="qwen3_moe: layers with a dense MLP "
                                                                         "(e.g. [0, 1]: the first two)")
    layer_norm_eps: Float | None = Field(default=None, gt=0, description="gpt_neox: epsilon of the layer norms; "
                                                                          "null = 1e-5")
    partial_rotary_factor: Float | None = Field(default=None, gt=0, le=1,
                                                description="gpt_neox: share of each head's dimensions that rotate "
                                                            "(Hugging Face's rotary_pct); null = 0.25")
    use_parallel_residual: Bool | None = Field(default=None, description="gpt_neox: x + attn(ln1(x)) + "
                                                                         "mlp(ln2(x)) (true) or sequential "
                                                                         "attention then MLP (false); null = true")
    hidden_act: Literal[ACTIVATIONS] | None = Field(  # type: ignore[valid-type]
        default=None, description="gpt_neox: the MLP's activation (Hugging Face's hidden_act); null = 'gelu'")

    sliding_window_pattern: Int | None = Field(default=None, ge=1, description="gemma3: every this many layers "
                                                                               "is a full-attention one, the "
                                                                               "others slide; null = 6")
    query_pre_attn_scalar: Float | None = Field(default=None, gt=0, description="gemma3: the attention softmax "
                                                                                "is scaled by its inverse square "
                                                                                "root; null = head_dim")
    rope_local_base_freq: Float | None = Field(default=None, gt=0, description="gemma3: rotary base of the "
                                                                               "sliding layers (rope_theta: the "
                                                                               "full ones'); null = 10000")
    q_lora_rank: Int | None = Field(default=None, ge=1, description="deepseek_v3: width of the query bottleneck; "
                                                                    "null = one direct query projection "
                                                                    "(DeepSeek-V2-Lite)")
    kv_lora_rank: Int | None = Field(default=None, ge=1, description="deepseek_v3: width of the key/value latent; "
                                                                     "null = 512")
    qk_rope_head_dim: Int | None = Field(default=None, ge=1, description="deepseek_v3: the rotary part of each "
                                                                         "query/key head (shared by the keys); "
                                                                         "null = 64")
    qk_nope_head_dim: Int | None = Field(default=None, ge=1, description="deepseek_v3: the part of each query/key "
                                                                         "head without position; null = 128")
    v_head_dim: Int | None = Field(default=None, ge=1, description="deepseek_v3: width of each value head; "
                                                                   "null = 128")
    rope_interleave: Bool | None = Field(default=None, description="deepseek_v3: the rotary dimensions pair up "
                                                                   "interleaved (DeepSeek's checkpoints); "
                                                                   "null = true")
    n_routed_experts: Int | None = Field(default=None, ge=1, description="deepseek_v3: routed experts per MoE "
                                                                         "layer; null = 256")
    n_shared_experts: Int | None = Field(default=None, ge=1, description="deepseek_v3: shared experts every token "
                                                                         "goes through; null = 1")
    n_group: Int | None = Field(default=None, ge=1, description="deepseek_v3: expert groups of the router "
                                                                "(divides n_routed_experts); null = 8")
    topk_group: Int | None = Field(default=None, ge=1, description="deepseek_v3: groups a token's experts come "
                                                                   "from; null = 4")
    routed_scaling_factor: Float | None = Field(default=None, ge=0, description="deepseek_v3: factor on the routed "
                                                                                "experts' weights; null = 2.5")
    first_k_dense_replace: Int | None = Field(default=None, ge=0, description="deepseek_v3: the first this many "
                                                                              "layers are dense; null = 3")
    num_nextn_predict_layers: Int | None = Field(default=None, ge=0, description="deepseek_v3: multi-token "
                                                                                 "prediction modules; null = 0")
    mtp_loss_weight: Float | None = Field(default=None, ge=0, description="deepseek_v3: weight of the mean "
                                                                          "multi-token-prediction loss; "
                                                                          "null = 0.3")

    def arch_values(self) -> dict[str, Any]:
        """The architecture fields as set in the recipe (``None`` head_dim left unresolved)."""
        return {name: getattr(self, name) for name in ARCH_FIELDS}

    def knob_values(self) -> dict[str, Any]:
        """The :data:`TRAINING_KNOBS` this section sets (applied over ``model.hf_path``'s config)."""
        return {name: getattr(self, name) for name in TRAINING_KNOBS
                if name in self.model_fields_set and getattr(self, name) is not None}

    def config_class(self) -> type:
        """The config class of ``model.family``."""
        return get_family(self.family).config_cls

    def to_model_config(self, vocab_size: int | None = None, **extra: Any) -> DecoderConfig:
        """The config of ``model.family`` this section describes (its family's :class:`DecoderConfig`).

        ``vocab_size`` is the tokenizer's size; ``model.vocab_size``, when set, takes precedence
        (it may be larger, e.g. padded). With ``hf_path`` the architecture is read from its
        ``config.json`` and ``vocab_size`` may not exceed the checkpoint's. ``extra`` goes to
        the config (``bos_token_id``, ``eos_token_id``, ...). A family-specific field
        (``sliding_window``) set for a family without it raises :class:`ModelConfigError`.
        """
        extra = {"attention_dropout": self.attention_dropout, "hidden_dropout": self.hidden_dropout, **extra}
        if self.hf_path is not None:
            config = read_hf_config(self.hf_path)
            if vocab_size is not None and vocab_size > config.vocab_size:
                raise ModelConfigError(
                    f"the tokenizer has {vocab_size} tokens but {self.hf_path}/config.json has vocab_size="
                    f"{config.vocab_size}; use the checkpoint's own tokenizer")
            for key, value in {**self.knob_values(), **extra}.items():
                setattr(config, key, value)
            return config
        vocab = self.vocab_size if self.vocab_size is not None else vocab_size
        if vocab is None:
            raise ModelConfigError("model.vocab_size is null and no tokenizer size was given; pass vocab_size")
        if vocab_size is not None and vocab < vocab_size:
            raise ModelConfigError(f"model.vocab_size={vocab} is smaller than the tokenizer's {vocab_size} tokens; "
                                   f"set it to at least {vocab_size} or null")
        cls = self.config_class()
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in self.arch_values().items() if k != "vocab_size"}
        # a field the family lacks counts when it is set to something else than its default (a written
        # recipe holds every field; model.rms_norm_eps at its default says nothing to a layer-norm family)
        foreign = [k for k, v in fields.items() if k not in known and v is not None
                   and v != type(self).model_fields[k].default]
        if foreign:
            raise ModelConfigError(f"model.{foreign[0]}={fields[foreign[0]]!r} is not a field of model.family="
                                   f"{self.family!r}; remove it or choose a family that has it")
        fields = {k: v for k, v in fields.items() if k in known}
        return cls(vocab_size=vocab, initializer_range=self.initializer_range, **fields, **extra)


def read_hf_config(hf_path: str) -> DecoderConfig:
    """The config of a Hugging Face model directory (``config.json``), of the family its
    ``model_type`` names (:mod:`plait.models.registry`)."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{hf_path!r} has no config.json; give a Hugging Face model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    try:
        return fitted_to_checkpoint(config_from_hf_dict(data), hf_path)
    except ModelConfigError as e:  # name the file: the message alone does not say which config
        raise ModelConfigError(f"{path}: {e}") from None


class ParallelSection(Section):
    tp: Int = Field(default=1, ge=1, description="Tensor-parallel degree")
    pp: Int = Field(default=1, ge=1, description="Pipeline-parallel degree (pipeline stages across ranks)")
    dp: Int | None = Field(default=None, ge=1, description="Data-parallel degree; null = world size / (tp * pp * cp)")
    cp: Int = Field(default=1, ge=1, description="Context-parallel degree: each sequence split over this many ranks "
                                                 "(zigzag chunks, ring attention; needs seq_len % (2 * cp) == 0)")
    cp_mode: Literal["ring", "allgather"] = Field(
        default="ring", description="How attention crosses the cp ranks: 'ring' (K/V blocks passed around, "
                                    "overlapped with compute) or 'allgather' (all K/V gathered; short rings)",
                                    json_schema_extra=applies_when("context_parallel"))
    vpp: Int = Field(default=1, ge=1, description="Virtual pipeline stages per pipeline rank (needs pp > 1)")
    ep: Int = Field(default=1, ge=1, description="Expert-parallel degree (MoE families): experts split over this "
                                                 "many data-parallel ranks, tokens exchanged by all-to-all; divides "
                                                 "dp and the expert count")
    sequence_parallel: Bool = Field(default=False, description="Split the activations outside attention "
                                                               "and MLP over the sequence within the TP "
                                                               "group (needs seq_len % tp == 0)")
    kv_replication: Int | None = Field(default=None, ge=1, description="TP ranks that hold the same K/V heads; "
                                                                       "null = the smallest that needs no padding")
    kv_placement: Literal["interleaved", "adjacent"] = Field(
        default="interleaved", description="Placement of K/V replicas in the TP group: 'interleaved' or 'adjacent'",
        json_schema_extra=applies_when("tensor_parallel"))
    zero: Literal[0, 1, 2, 3] | None = Field(
        default=None, description="ZeRO level over the data-parallel ranks: 0 replicates everything; 1 shards "
                                  "optimizer state and master weights; 2 also gradients; 3 also the weights, "
                                  "gathered per decoder block. null = 1 if zero1 else 0; no effect (a warning) "
                                  "with dp=1. See docs/data_parallel.md")
    zero1: Bool = Field(default=False, description="The older spelling of zero: 1 (kept working)")
    reshard_after_forward: Bool = Field(
        default=True, description="Free each block's gathered weights after its forward and "
                                  "gather them again for its backward (false: keep them until its backward; "
                                  "one all-gather per block saved, more memory)",
        json_schema_extra=applies_when("zero3"))
    shard_over: Literal["dp", "host"] = Field(
        default="dp", description="What ZeRO shards over: 'dp' (every data-parallel rank) or 'host' (hybrid: "
                                  "the data-parallel ranks of one host, replicated across hosts; the "
                                  "gradients are reduced inside the host, then across hosts)",
        json_schema_extra=applies_when("sharded"))
    offload_optimizer: Bool = Field(
        default=False, description="Keep the fp32 master weights and AdamW moments in host memory and update "
                                   "them there (the device keeps the weights and gradients); any ZeRO level, "
                                   "not with bf16-pure. See docs/data_parallel.md")
    bucket_mb: Float = Field(default=25.0, gt=0, description="Size cap of a gradient bucket in MB; each "
                                                             "bucket's data-parallel reduction starts "
                                                             "as soon as its last gradient is ready")
    overlap_grad_reduce: Bool = Field(default=True, description="Start each bucket's data-parallel reduction during "
                                                                "backward (false: all after backward, for comparison)")
    microbatches: Int = Field(default=1, ge=1, description="Micro-batches per step (gradient accumulation; "
                                                           "pipeline micro-batches when pp > 1)")
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb"] = Field(
        default="1f1b", description="Pipeline schedule: 'gpipe', '1f1b', 'interleaved-1f1b' (vpp chunks per "
                                    "rank), 'zb-h1' (zero bubble: weight gradients deferred into the bubbles) or "
                                    "'interleaved-zb' (both) (used when pp > 1)",
        json_schema_extra=applies_when("pipeline"))
    partition: Literal["balanced", "even", "manual"] = Field(
        default="balanced", description="Pipeline split: 'balanced' by cost, 'even' "
                                        "by layer count, 'manual' at pipeline_cuts",
                                        json_schema_extra=applies_when("pipeline"))
    partition_cost: Literal["flops", "params"] = Field(
        default="flops", description="Per-unit cost the balanced split evens out (embedding and head included)",
        json_schema_extra=applies_when("pipeline"))
    pipeline_cuts: list[str] | None = Field(
        default=None, description="With partition='manual': the layers that start stages 1.. (e.g. model.layers.4)",
        json_schema_extra=applies_when("pipeline"))

    def zero_level(self) -> int:
        """The ZeRO level the recipe asks for: ``zero``, or 1 for the older ``zero1: true``."""
        if self.zero is not None:
            return self.zero
        return 1 if self.zero1 else 0


DtypeName = Literal["fp32", "bf16"]


class PrecisionSection(Section):
    preset: Literal["fp32", "autocast", "bf16-mixed", "bf16-pure", "manual"] = Field(
        default="fp32", description="Numeric precision bundle: 'fp32'; 'autocast' (fp32 weights, bf16 autocast "
                                    "compute); 'bf16-mixed' (bf16 weights and compute, fp32 master weights, gradients "
                                    "and optimizer state); 'bf16-pure' (everything bf16, stochastic rounding of the "
                                    "update); 'manual' (the knobs below, starting from fp32). See docs/precision.md")
    param_dtype: DtypeName | None = Field(default=None, description="manual only: dtype of the "
                                                                    "model weights (and compute)")
    autocast: Bool | None = Field(default=None, description="manual only: run forward under bf16 autocast")
    master_weights: Bool | None = Field(default=None, description="manual only: keep fp32 master "
                                                                  "weights for the optimizer")
    grad_dtype: DtypeName | None = Field(default=None, description="manual only: dtype of gradient accumulation and "
                                                                   "data-parallel reduction")
    stochastic_rounding: Bool | None = Field(default=None, description="manual only: round bf16 weight updates "
                                                                       "stochastically (needs bf16 weights, no master)")

    def knobs(self) -> dict[str, Any]:
        """The manual knobs as set in the recipe (``None`` = not set)."""
        return {k: getattr(self, k) for k in KNOBS}


class OptimizerSection(Section):
    name: Literal["adamw"] = Field(default="adamw", description="Optimizer; only 'adamw'")
    lr: Float = Field(default=3e-3, gt=0, description="Peak learning rate")
    weight_decay: Float = Field(default=0.1, ge=0, description="Decoupled weight decay (not "
                                                               "applied to norms and biases)")
    beta1: Float = Field(default=0.9, ge=0, lt=1, description="AdamW first-moment decay")
    beta2: Float = Field(default=0.95, ge=0, lt=1, description="AdamW second-moment decay")
    eps: Float = Field(default=1e-8, gt=0, description="AdamW denominator epsilon")
    grad_clip: Float = Field(default=1.0, ge=0, description="Clip the global gradient norm to this value; 0 = off")


class SchedulerSection(Section):
    name: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Decay after warm-up: 'cosine', 'linear' or 'constant'")
    warmup_steps: Int = Field(default=20, ge=0, description="Steps of linear warm-up from 0 to optimizer.lr")
    min_lr_ratio: Float = Field(default=0.1, ge=0, le=1, description="Final learning rate as a "
                                                                     "fraction of optimizer.lr")


#: plait's names for the columns it reads (``data.fields`` maps them to a file's own column names)
FieldName = Literal["text", "messages", "prompt", "completion", "chosen", "rejected", "answer"]


class MixtureSource(Section):
    """One corpus of a weighted mixture (``data.sources``)."""

    source: str = Field(min_length=1, description="A built-in corpus, a text or table file, a glob, a "
                                                  "save_to_disk directory, or a prepared data directory")
    weight: Float = Field(gt=0, description="Share of the training samples drawn from this source (the weights "
                                            "are normalised to sum to 1)")
    name: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9._-]+$",
                             description="Name in metrics (val_loss/<name>); null = the source's file or corpus name")
    fields: dict[FieldName, str] = Field(default_factory=dict, description="Column names of this source's files")
    limit: Int | None = Field(default=None, ge=1, description="Use only the first this many documents")


class DataSection(Section):
    source: str = Field(default="shakespeare", min_length=1,
                        description="Built-in corpus ('shakespeare', 'bible'), a .txt/.jsonl/.json file, a "
                                    ".parquet/.csv/.arrow file, a glob of such files, a save_to_disk directory, a "
                                    "directory of .txt/.jsonl files, or a prepared data directory")
    sources: list[MixtureSource] | None = Field(
        default=None, min_length=2, description="A weighted mixture of corpora instead of data.source: a list of "
                                                "{source, weight, name, fields, limit}; every step draws exactly "
                                                "its share from each (text only)",
        json_schema_extra=applies_when("text"))
    fields: dict[FieldName, str] = Field(default_factory=dict,
                                         description="Column names of the source's files, by plait's name: e.g. "
                                                     "{text: body} reads the text from column 'body'")
    num_workers: Int = Field(default=1, ge=1, le=256, description="Processes that tokenise a text source (the "
                                                                  "prepared data is the same for any number)",
                             json_schema_extra=applies_when("text"))
    tokenizer: str = Field(default="bpe", min_length=1, description="'bpe' = train a byte-level BPE on the source, or "
                                                                    "a path to a tokenizer.json")
    vocab_size: Int = Field(default=2048, ge=257, le=1 << 20, description="Size of the trained BPE (tokenizer: bpe)",
                            json_schema_extra=applies_when("bpe"))
    seq_len: Int = Field(default=128, ge=1, description="Tokens per training sequence")
    val_fraction: Float = Field(default=0.05, gt=0, lt=1, description="Share of the tokens held out for validation",
                                json_schema_extra=applies_when(None, shapes_rows=True))
    micro_batch_size: Int = Field(default=8, ge=1, description="Sequences per micro-batch on one DP rank")
    global_batch_size: Int | None = Field(default=None, ge=1, description="Sequences per optimizer step; "
                                                                          "null = micro_batch_size * microbatches * dp")
    prefetch: Int = Field(default=2, ge=0, description="Batches loaded ahead by a background thread; 0 = none")
    cache_dir: str | None = Field(default=None, description="Where prepared data is cached; null "
                                                            "= $PLAIT_CACHE or ~/.cache/plait")
    format: Literal["text", "sft", "preference", "prompts"] = Field(
        default="text", description="'text': plain documents, every token a target; 'sft': rows (a .jsonl, "
                                    ".json, .parquet, .csv or .arrow file, a save_to_disk directory or a glob) of "
                                    "conversations ('messages') or prompt/completion rows, rendered with the "
                                    "tokenizer's chat template, loss on the assistant tokens only; "
                                    "'preference': prompt/chosen/rejected rows, each pair kept "
                                    "in one row (train.objective dpo, ipo, orpo or simpo); 'prompts': "
                                    "prompt rows with an answer, completed by the policy and scored by a "
                                    "reward (train.objective grpo, see the grpo section)")
    packing: Bool = Field(default=True, description="sft: pack several samples into each row (attention and "
                                                    "positions stay within a sample); false = one sample per row",
                                                    json_schema_extra=applies_when("rows", shapes_rows=True))
    truncation: Literal["drop", "truncate_left", "truncate_right"] = Field(
        default="drop", description="sft: a sample longer than seq_len is dropped, or cut from the left or right "
                                    "(counted and reported)", json_schema_extra=applies_when("rows", shapes_rows=True))
    train_on_prompt: Bool = Field(default=False, description="sft: take the loss on every token, not only on the "
                                                             "assistant's",
                                  json_schema_extra=applies_when("sft", shapes_rows=True))
    skip_bad_rows: Bool = Field(default=False, description="sft: skip malformed rows (counted per reason) "
                                                           "instead of stopping at the first",
                                                           json_schema_extra=applies_when("rows", shapes_rows=True))


class TrainSection(Section):
    steps: Int = Field(default=300, ge=1, description="Optimizer steps")
    objective: Literal["lm", "sft", "dpo", "ipo", "orpo", "simpo", "grpo"] = Field(
        default="lm", description="'lm': next-token loss on every token (data.format text); 'sft': on the target "
                                  "tokens of data.format sft rows, averaged over the global batch's targets; "
                                  "'dpo', 'ipo', 'orpo', 'simpo': a preference loss on data.format preference "
                                  "rows, averaged over the global batch's pairs (see the preference section); "
                                  "'grpo': online reinforcement learning on data.format prompts rows, the policy's "
                                  "completions scored by a verifiable reward (see the grpo section)")
    eval_every: Int = Field(default=100, ge=1, description="Evaluate on the validation split "
                                                           "every this many steps (and at the end)")
    eval_batches: Int = Field(default=8, ge=1, description="Validation global batches per evaluation: the first "
                                                           "eval_batches x global_batch_size validation sequences, the "
                                                           "same under every layout")
    log_every: Int = Field(default=10, ge=1, description="Log metrics every this many steps (and at the end)")
    detect_host_syncs: Bool = Field(default=False, description="Watch the first 3 steps for device-to-host reads "
                                                               "(torch.cuda.set_sync_debug_mode on CUDA, counted "
                                                               "tensor reads on CPU) and print each with its stack")
    sample_prompt: str = Field(default="ROMEO:", description="Prompt of the text sample generated at the end",
                               json_schema_extra=applies_when("sample"))
    sample_tokens: Int = Field(default=48, ge=0, description="Tokens generated for the final "
                                                             "sample; 0 = no sample text")
    stall_timeout_s: Float = Field(default=600.0, ge=0, description="Abort (exit status 3, naming the rank, group and "
                                                                    "operation) when one communicating phase of a step "
                                                                    "takes longer; 0 = off")
    nonfinite: Literal["halt", "skip"] = Field(
        default="halt", description="A step whose loss or gradient norm is not finite: 'halt' (save nothing, stop with "
                                    "an error) or 'skip' (discard its update and go on)")
    activation_checkpointing: Literal["off", "full", "selective"] = Field(
        default="off", description="Recompute activations in backward: 'off', 'full' (every decoder block) or "
                                   "'selective' (the block submodules in train.checkpoint_modules)")
    checkpoint_modules: list[str] = Field(default_factory=list, description="With selective checkpointing: "
                                          "submodule names inside a decoder block, e.g. ['self_attn', 'mlp']")
    compile: Bool = Field(default=False, description="Compile each decoder block and the loss head with "
                                                     "torch.compile (inductor); compile time is reported as compile_s "
                                                     "and left out of tokens/s (see docs/compile.md)")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        default="default", description="torch.compile mode of train.compile: 'default' or "
                                       "'max-autotune-no-cudagraphs' (longer compile, tuned kernels)")


class CheckpointSection(Section):
    save_final: Bool = Field(default=True, description="Write a Hugging Face model directory at the end")
    dir: str = Field(default="{output_dir}/final", min_length=1,
                     description="Directory of the final Hugging Face checkpoint; "
                                 "{output_dir} and {name} are substituted",
                                 json_schema_extra=applies_when("final_model"))
    overwrite: Bool = Field(default=False, description="Replace what plait wrote earlier: a Hugging Face model at "
                                                       "checkpoint.dir outside this run's directory, or (with resume "
                                                       "none) an earlier run's checkpoints in save_dir; what plait did "
                                                       "not write is never replaced")
    save_every: Int = Field(default=0, ge=0, description="Write a sharded training checkpoint every this many steps "
                                                         "and at the end; 0 = only when preempted (SIGTERM/SIGINT)")
    save_dir: str = Field(default="{output_dir}/checkpoints", min_length=1,
                          description="Directory of the sharded training checkpoints (step-N subdirectories); "
                                      "{output_dir} and {name} are substituted")
    keep: Int = Field(default=2, ge=1, description="Complete checkpoints kept (the newest is never deleted)")
    keep_every: Int = Field(default=0, ge=0, description="Also keep every checkpoint whose "
                                                         "step is a multiple of this; 0 = none")
    resume: str = Field(default="none", min_length=1, description="'none', 'auto' (the newest complete checkpoint in "
                                                                  "save_dir, if any) or a checkpoint directory")
    async_save: Bool = Field(default=True, description="Write checkpoints on a background thread after a host copy "
                                                       "(at most one in flight)")


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def _attention_targets() -> list[LoraTarget]:
    return ["q_proj", "k_proj", "v_proj", "o_proj"]


class LoraSection(Section):
    rank: Int | None = Field(default=None, ge=1, description="Adapter rank; null = no LoRA (every weight trains)")
    alpha: Float = Field(default=16.0, gt=0, description="Scale numerator: the update is (alpha / rank) B A "
                                                         "(alpha / sqrt(rank) with rslora)",
                                                         json_schema_extra=applies_when("lora"))
    dropout: Float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input",
                           json_schema_extra=applies_when("lora"))
    target_modules: list[LoraTarget] = Field(default_factory=_attention_targets,
                                             description="Projections of each decoder block that get an adapter",
                                             json_schema_extra=applies_when("lora"))
    rslora: Bool = Field(default=False, description="Rank-stabilised scale alpha / sqrt(rank)",
                         json_schema_extra=applies_when("lora"))
    init_from: str | None = Field(default=None, description="A PEFT adapter directory (adapter_config.json + "
                                                            "adapter_model.safetensors) to start the adapters from, "
                                                            "e.g. an earlier LoRA run's final/; its rank, alpha, "
                                                            "rslora and targets must match this section")
    quantize_base: Literal["none", "nf4", "int8"] = Field(
        default="none", description="QLoRA: store the frozen base projections of every decoder block quantized: "
                                    "'nf4' (4-bit NormalFloat, double-quantized scales, ~0.27x of bf16), 'int8' "
                                    "(~0.53x), in blocks along the hidden size that tensor parallelism never cuts; "
                                    "computed in the precision preset's dtype. 'none' = the base as read",
        json_schema_extra=applies_when("lora"))
    quantize_block_size: Int = Field(default=64, ge=2, description="Values per quantization block along the hidden "
                                                                    "size (QLoRA's 64); an even divisor of "
                                                                    "model.hidden_size",
                                     json_schema_extra=applies_when("quantized"))


    @property
    def quantized(self) -> bool:
        """Whether the run holds its frozen base quantized (LoRA on and ``quantize_base`` not 'none')."""
        return self.rank is not None and self.quantize_base != "none"

class PreferenceSection(Section):
    beta: Float = Field(default=0.1, gt=0, description="DPO/IPO: KL strength (IPO's tau); ORPO: weight of the "
                                                        "odds-ratio term (lambda); SimPO: reward scale (2.0-2.5)")
    label_smoothing: Float = Field(default=0.0, ge=0, lt=0.5, description="dpo and simpo only: assumed probability "
                                                                          "that a preference label is flipped")
    sft_weight: Float | None = Field(default=None, ge=0, description="Weight of the chosen responses' token NLL "
                                                                     "(over the global batch's chosen tokens) added "
                                                                     "to the loss; null = 1.0 for orpo, 0 otherwise")
    gamma: Float = Field(default=0.0, ge=0, description="simpo only: target reward margin (0.5-1.5)")
    reference: Literal["frozen", "adapters_off", "precompute"] | None = Field(
        default=None, description="dpo/ipo: the reference model: 'frozen' (a frozen copy of the initial model), "
                                  "'adapters_off' (the policy with its LoRA adapters disabled; needs lora.rank), "
                                  "'precompute' (the initial model scores every pair once; stored with the "
                                  "prepared data and reused by later runs); null = adapters_off with lora.rank, else "
                                  "frozen. orpo/simpo use none: leave it null")

    def reference_mode(self, objective: str, lora_rank: int | None) -> str | None:
        """The reference model ``objective`` trains against: ``None`` for the reference-free
        objectives (orpo, simpo), else the recipe's choice or its default."""
        if objective not in REFERENCE_OBJECTIVES:
            return None
        if self.reference is not None:
            return self.reference
        return "adapters_off" if lora_rank is not None else "frozen"


class GrpoSection(Section):
    group_size: Int = Field(default=8, ge=2, description="Completions sampled per prompt (one group); the global "
                                                         "batch is prompts x group_size sequences, and "
                                                         "data.micro_batch_size must be a multiple of it")
    max_new_tokens: Int = Field(default=32, ge=1, description="Longest completion in tokens; every prompt plus this "
                                                              "must fit in data.seq_len")
    temperature: Float = Field(default=1.0, gt=0, description="Sampling temperature of the rollouts")
    top_k: Int = Field(default=0, ge=0, description="Sample among the k most likely tokens; 0 = all")
    top_p: Float = Field(default=1.0, gt=0, le=1, description="Sample from the smallest set of tokens whose "
                                                              "probability reaches top_p; 1 = all")
    epochs: Int = Field(default=1, ge=1, description="Optimizer steps on each rollout batch (a new rollout every "
                                                     "this many train.steps)")
    # the variants of plait.post_training.grpo_loss.VARIANTS (a test keeps them equal)
    loss: Literal["grpo", "dr_grpo", "dapo"] = Field(
        default="grpo", description="Loss variant: 'grpo' (advantages scaled by the group's std, per-completion "
                                    "token mean), 'dr_grpo' (unscaled advantages, token sum over a constant) or "
                                    "'dapo' (equal-reward groups dropped, token mean over the batch)")
    epsilon_low: Float = Field(default=0.2, ge=0, lt=1, description="Clip range below 1 of the importance ratio "
                                                                    "(1 - epsilon_low)")
    epsilon_high: Float = Field(default=0.2, ge=0, description="Clip range above 1 of the importance ratio "
                                                               "(1 + epsilon_high; dapo's clip-higher uses e.g. 0.28)")
    kl_coef: Float = Field(default=0.0, ge=0, description="Weight of the KL penalty to the reference model "
                                                          "(k3 estimator); 0 = none, and no reference is kept")
    reference: Literal["adapters_off", "frozen"] | None = Field(
        default=None, description="The KL reference (only with kl_coef > 0): 'adapters_off' (the policy with its "
                                  "LoRA adapters disabled; needs lora.rank) or 'frozen' (a frozen copy of the "
                                  "initial model); null = adapters_off with lora.rank, else frozen")
    reward: str = Field(default="exact_match", min_length=1,
                        description="'exact_match' (the stripped completion equals the row's answer), 'regex' (a "
                                    "full match of grpo.reward_pattern) or path/to/file.py:function, a function "
                                    "(completion, row) -> float, loaded and checked before launch")
    reward_pattern: str | None = Field(default=None, description="reward regex only: the regular expression the "
                                                                 "stripped completion must match; {answer} stands "
                                                                 "for the row's answer")
    eval_source: str | None = Field(default=None, description="Held-out prompt rows (.jsonl) scored by exact match "
                                                              "at each evaluation; null = the validation split of "
                                                              "data.source (data.val_fraction of its rows)")
    eval_rows: Int = Field(default=100, ge=1, description="Held-out prompts scored at each evaluation (the first "
                                                          "eval_rows of the validation split)")

    def reference_mode(self, lora_rank: int | None) -> str | None:
        """The KL reference model: ``None`` without a KL term (``kl_coef == 0``), else the recipe's
        choice or its default (the policy without adapters with LoRA, a frozen copy otherwise)."""
        if self.kl_coef == 0:
            return None
        if self.reference is not None:
            return self.reference
        return "adapters_off" if lora_rank is not None else "frozen"


class LoggingSection(Section):
    jsonl: Bool = Field(default=True, description="Write metrics.jsonl in the output directory")
    tensorboard: Bool = Field(default=True, description="Write TensorBoard event files")
    progress_bar: Bool = Field(default=True, description="Show a progress bar on the terminal")
    plot: Bool = Field(default=True, description="Plot the loss curves to loss.png at the end")
    wandb: WandbSettings | None = Field(default=None, description="Log to Weights & Biases (the fields below; "
                                                                  "e.g. {project: my-project, mode: offline}); "
                                                                  "null = off")
    mlflow: MlflowSettings | None = Field(default=None, description="Log to MLflow (the fields below; e.g. "
                                                                    "{tracking_uri: http://host:5000}); null = off")


class LaunchSection(Section):
    iface: str | None = Field(default=None, min_length=1, description="Network interface gloo and NCCL use between "
                                                                      "hosts (sets GLOO_SOCKET_IFNAME and "
                                                                      "NCCL_SOCKET_IFNAME, e.g. ib0); null = the "
                                                                      "backends' own choice")
    rdzv_timeout_s: Float = Field(default=600.0, gt=0, description="Seconds the hosts of a multi-host run have to "
                                                                   "join the rendezvous before it fails naming the "
                                                                   "endpoint and the hosts missing")


class Recipe(Section):
    """A whole training recipe. ``Recipe()`` is the built-in default."""

    run: RunSection = Field(default_factory=RunSection, description="Name, output directory and seed")
    model: ModelSection = Field(default_factory=ModelSection, description="Model architecture or checkpoint")
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="Parallel layout")
    precision: PrecisionSection = Field(default_factory=PrecisionSection, description="Numeric precision")
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection, description="Optimizer")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Learning-rate schedule")
    data: DataSection = Field(default_factory=DataSection, description="Corpus, tokenizer and batching")
    train: TrainSection = Field(default_factory=TrainSection, description="Length, evaluation, logging cadence")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection,
                                          description="Training checkpoints, resume and the final checkpoint")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Metric sinks")
    lora: LoraSection = Field(default_factory=LoraSection, description="Low-rank adapters (off unless rank is set)")
    preference: PreferenceSection = Field(default_factory=PreferenceSection,
                                          description="Preference objectives (data.format preference)")
    grpo: GrpoSection = Field(default_factory=GrpoSection, description="Online reinforcement learning with verifiable "
                                                                       "rewards (train.objective grpo)")
    moe: MoeSection = Field(default_factory=MoeSection, description="Mixture-of-Experts training (MoE families)")
    launch: LaunchSection = Field(default_factory=LaunchSection,
                                  description="Multi-host networking and rendezvous (plait train, plait launch)")


SECTIONS: dict[str, type[Section]] = {
    name: info.annotation for name, info in Recipe.model_fields.items()  # type: ignore[misc]
}


# ---------------------------------------------------------------------- reference documentation
def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is Annotated:
        return _type_name(args[0])
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " \\| ".join(_type_name(a) for a in rest) + " \\| null"
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(info: Any) -> str:
    marks = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                marks.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "min_length", None):
            marks.append("non-empty")
    return ", ".join(marks)


def _default_text(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def nested_settings(annotation: Any) -> type[BaseModel] | None:
    """The settings model of a field that holds one (``logging.wandb``: ``WandbSettings | None``), else None."""
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def reference_markdown() -> str:
    """The field reference of every section as Markdown tables (the source of docs/recipes.md)."""
    out = []
    for name, info in Recipe.model_fields.items():
        cls = SECTIONS[name]
        out += [f"### `{name}` — {info.description}", "",
                "| field | type | default | description |", "|---|---|---|---|"]
        for field_name, f in cls.model_fields.items():
            bounds = _bounds(f)
            kind = _type_name(f.annotation) + (f" ({bounds})" if bounds else "")
            default = f.get_default(call_default_factory=True)  # a default_factory field has no f.default
            condition = field_condition(cls, field_name)
            applies = f" *Takes effect only when {CONDITIONS[condition][0]}.*" if condition else ""
            out.append(f"| `{name}.{field_name}` | {kind} | {_default_text(default)} | {f.description}{applies} |")
            nested = nested_settings(f.annotation)
            for sub_name, sub in (nested.model_fields.items() if nested else ()):
                sub_bounds = _bounds(sub)
                sub_kind = _type_name(sub.annotation) + (f" ({sub_bounds})" if sub_bounds else "")
                sub_default = _default_text(sub.get_default(call_default_factory=True))
                out.append(f"| `{name}.{field_name}.{sub_name}` | {sub_kind} | {sub_default} | {sub.description} |")
        out.append("")
    return "\n".join(out)
