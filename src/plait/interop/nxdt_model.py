"""The ``model`` section of an NxDT config: architecture, family, fusions, activation checkpointing.

The architecture comes from the keys written inline (NxDT's Megatron-style models) and from
``model.model_config``, a Hugging Face config.json (NxDT's HF-style models), when it is readable
here; inline keys win, as they do in NxDT. See docs/nxdt.md for the table.

NxDT's Megatron GPT model (``megatron_gpt_config.yaml``) is GPT-NeoX's block when it has layer
norms, the GeLU MLP and rotary embeddings: it becomes plait's ``gpt_neox`` family (the layer-norm
epsilon, ``rotary_percentage``, the residual form of ``transformer_block_type``, ``has_bias``). Its
defaults (learned absolute positions, tied embeddings) have no plait counterpart and are reported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from plait.config.schema import ARCH_FIELDS, ModelSection
from plait.interop.nxdt_collect import Collector
from plait.interop.nxdt_sections import NOT_NUMERIC, ignore_listed, one_of
from plait.models.registry import BY_MODEL_TYPE
from plait.models.registry import FAMILIES as REGISTERED_FAMILIES

#: model keys that do not matter to plait, and why
_MODEL_IGNORED = {
    "encoder_seq_length": "NxDT's copy of data.seq_length",
    "qkv_linear": NOT_NUMERIC, "fuse_qkv": NOT_NUMERIC, "transformer_engine": NOT_NUMERIC,
    "use_cpu_initialization": "plait builds on the meta device and materializes each rank's shard",
    "persist_layer_norm": NOT_NUMERIC, "gradient_accumulation_fusion": NOT_NUMERIC,
    "bias_activation_fusion": NOT_NUMERIC, "masked_softmax_fusion": NOT_NUMERIC, "apply_rope_fusion": NOT_NUMERIC,
    "disable_layer_norm_checkpointing": NOT_NUMERIC,
    "capacity_factor": "not imported: set moe.capacity_factor by hand (the drop policies differ, docs/moe.md)",
}
#: values of value-dependent model keys that are what plait's models do anyway
_MODEL_DEFAULTS: dict[str, tuple[set[str | bool], str]] = {
    "normalization": ({"rmsnorm", "RMSNorm"}, "plait's models use RMSNorm"),
    "activation": ({"swiglu", "SwiGLU"}, "plait's MLP is the gated SiLU (SwiGLU) MLP"),
    "position_embedding_type": ({"rope"}, "plait's models use rotary embeddings"),
    "do_layer_norm_weight_decay": ({False}, "plait never decays norms and biases"),
}
#: NxDT's recompute module classes (activations_checkpoint_recompute) -> plait block submodules
RECOMPUTE_MODULES = {"CoreAttention": "self_attn.core", "Attention": "self_attn", "MLP": "mlp",
                     "LlamaMLP": "mlp", "LlamaAttention": "self_attn", "MistralAttention": "self_attn"}
#: model keys written inline in an NxDT config -> plait model fields
MODEL_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
                "num_attention_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim",
                "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
                "vocab_size": "vocab_size", "layernorm_epsilon": "rms_norm_eps", "rms_norm_eps": "rms_norm_eps",
                "init_method_std": "initializer_range", "hidden_dropout": "hidden_dropout",
                "attention_dropout": "attention_dropout",
                "share_embeddings_and_output_weights": "tie_word_embeddings"}
#: plait's families, longest name first (a run named "qwen3_moe-..." is qwen3_moe, not qwen3)
FAMILIES = tuple(sorted(REGISTERED_FAMILIES, key=len, reverse=True))
#: NxDT's ``normalization`` values of a layer-norm model (Megatron GPT, which plait runs as gpt_neox)
LAYER_NORMS = {"layernorm", "LayerNorm"}
#: ``transformer_block_type`` -> ``model.use_parallel_residual``: ``gpt_j`` adds attention and MLP to the
#: block input (GPT-J's and GPT-NeoX's parallel residual), ``pre_ln`` runs them one after the other
BLOCK_TYPES = {"gpt_j": True, "pre_ln": False}
#: a Hugging Face config.json's other spellings of recipe fields (GPT-NeoX's released configs)
HF_ALIASES = {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}


def import_model(c: Collector, base_dir: Path) -> None:
    m = "model."
    family = _model_config(c, base_dir)
    neox = family == "gpt_neox" or (family is None and one_of(c.get(m + "normalization"), LAYER_NORMS))
    for key, name in MODEL_FIELDS.items():
        if c.has(m + key):
            value = c.get(m + key)
            if key == "layernorm_epsilon" and c.has(m + "rms_norm_eps"):
                c.ignore(m + key, "model.rms_norm_eps is given")
                continue
            if key == "layernorm_epsilon" and neox:
                name = "layer_norm_eps"
            c.map(m + key, {f"model.{name}": value})
    if c.has(m + "sliding_window"):  # written inline (a Mistral without model_config)
        if "sliding_window" in ModelSection.model_fields:
            c.map(m + "sliding_window", {"model.sliding_window": c.get(m + "sliding_window")})
        else:
            c.unmap(m + "sliding_window", "no recipe field: plait's mistral family reads sliding_window from a "
                                          "Hugging Face config.json (model.hf_path)")
    arch_given = c.has(m + "num_attention_heads") or c.owner("model.num_attention_heads") is not None
    if arch_given and c.owner("model.num_key_value_heads") is None:
        c.map("(model.num_kv_heads absent)", {"model.num_key_value_heads": c.value("model.num_attention_heads")},
              "multi-head attention: one K/V head per query head", value=None)
    if arch_given and c.owner("model.tie_word_embeddings") is None:
        c.map("(model.share_embeddings_and_output_weights absent)", {"model.tie_word_embeddings": False},
              "NxDT's Llama and Mistral models have an untied output head", value=None)
    _family(c, family, guess=not neox)  # a layer-norm model is gpt_neox, whatever its name
    if neox:
        _gpt_neox(c)
    elif c.has(m + "has_bias") or c.has(m + "bias"):
        key = m + ("has_bias" if c.has(m + "has_bias") else "bias")
        if c.get(key) is False:
            c.map(key, {"model.attention_bias": False})
        else:
            c.unmap(key, "plait has q/k/v/o biases (model.attention_bias) but no MLP biases")
    _whole_rotary_blocks(c)
    for key, (fine, reason) in _MODEL_DEFAULTS.items():
        if c.has(m + key) and not c.done(m + key):
            if one_of(c.get(m + key), fine):
                c.ignore(m + key, reason)
            else:
                c.unmap(m + key, f"plait supports only {sorted(fine, key=str)[0]!r}")
    ignore_listed(c, m, _MODEL_IGNORED)
    _init_and_dropout(c)
    _moe(c)
    if c.has(m + "peft"):
        c.unmap(m + "peft", "not imported: plait's LoRA is the lora section (rank, alpha, target_modules; "
                            "docs/post_training.md maps the keys); the recipe trains every weight")
    if c.has(m + "make_vocab_size_divisible_by"):
        c.ignore(m + "make_vocab_size_divisible_by", "plait does not pad the vocabulary; set model.vocab_size "
                                                     "to a padded size if you want one")
    _fusions(c)
    _checkpointing(c)


def _model_config(c: Collector, base_dir: Path) -> str | None:
    """Reads ``model.model_config`` (a Hugging Face config.json) when it is readable here; returns its model_type."""
    key = "model.model_config"
    path_text = c.get(key)
    if not isinstance(path_text, str):
        return None
    path = Path(path_text) if Path(path_text).is_absolute() else base_dir / path_text
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        c.unmap(key, f"cannot read {path} here ({type(e).__name__}): the architecture must be set in model.* "
                     "(or use model.hf_path for a Hugging Face checkpoint)")
        return None
    if not isinstance(data, dict):
        c.unmap(key, f"{path} does not hold a JSON object")
        return None
    special = ("head_dim", "sliding_window")
    fields = {f"model.{name}": data[name] for name in ARCH_FIELDS if name in data and name not in special}
    if data.get("head_dim") is not None:
        fields["model.head_dim"] = data["head_dim"]
    params = data.get("rope_parameters")
    rope: dict = params if isinstance(params, dict) else {}
    for name in ("rope_theta", "partial_rotary_factor"):  # transformers 5 writes them in rope_parameters
        if name in rope and f"model.{name}" not in fields:
            fields[f"model.{name}"] = rope[name]
    for alias, name in HF_ALIASES.items():
        if alias in data and f"model.{name}" not in fields:
            fields[f"model.{name}"] = data[alias]
    if data.get("model_type") == "gpt_neox" and "attention_bias" not in data:
        fields["model.attention_bias"] = True  # transformers' GPT-NeoX default (Pythia's config.json omits it)
    known = _family_fields(data.get("model_type"))
    if known is not None:  # a key another family reads (Mistral's hidden_act) says nothing to this one
        fields = {name: value for name, value in fields.items() if name.split(".", 1)[1] in known}
    for name, value in fields.items():
        c.map(f"{key}:{name.split('.')[1]}", {name: value}, value=value)
    c.ignore(key, f"the architecture fields of {path.name} are mapped one by one above; plait starts from "
                  "random weights as NxDT does (model.hf_path would load a checkpoint)")
    sliding = data.get("sliding_window")
    if sliding is not None:
        if "sliding_window" in ModelSection.model_fields:
            c.map(f"{key}:sliding_window", {"model.sliding_window": sliding}, value=sliding)
        else:
            c.unmap(f"{key}:sliding_window", "no recipe field: plait's mistral family reads sliding_window from a "
                                             "Hugging Face config.json (model.hf_path)", value=sliding)
    model_type = data.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _family_fields(model_type: object) -> set[str] | None:
    """The config fields of the family reading ``model_type`` (``None`` for a type plait does not run)."""
    family = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    return None if family is None else {f.name for f in dataclasses.fields(family.config_cls)}


def _family(c: Collector, model_type: str | None, guess: bool = True) -> None:
    """``model.family`` from config.json's model_type, else (``guess``) from the run's name (a guess,
    said so)."""
    if model_type is not None:
        family, source, how = model_type, "model.model_config:model_type", "from config.json"
    elif not guess:
        return
    else:
        name = str(c.get("name", "")).lower()
        named = next((f for f in FAMILIES if f in name), None)
        if named is None:
            return
        family = named
        source, how = "(family from name)", f"guessed from the config's name {c.get('name')!r}"
    if family not in FAMILIES:
        c.unmap(source, f"plait's model families are {', '.join(FAMILIES)}", value=family)
    elif "family" in ModelSection.model_fields:
        c.map(source, {"model.family": family}, how, value=family)
    elif family != "llama":
        c.unmap(source, "this plait has no model.family recipe field yet; the recipe describes a Llama model",
                value=family)


def _gpt_neox(c: Collector) -> None:
    """A layer-norm model: plait's gpt_neox family when its MLP is GeLU and its positions rotary."""
    m = "model."
    if c.owner("model.family") is None:
        c.map(m + "normalization", {"model.family": "gpt_neox"},
              "a layer-norm decoder with a GeLU MLP and rotary embeddings is GPT-NeoX's block", value=None)
    elif c.has(m + "normalization") and one_of(c.get(m + "normalization"), LAYER_NORMS):
        c.ignore(m + "normalization", "plait's gpt_neox family has layer norms")
    act = c.get(m + "activation")
    if c.has(m + "activation"):
        if one_of(act, {"gelu", "GeLU"}):
            c.map(m + "activation", {"model.hidden_act": "gelu"})
        else:
            c.unmap(m + "activation", "plait's layer-norm family (gpt_neox) has a GeLU MLP; a layer-norm "
                                      f"{act!r} MLP is no plait model")
    position = c.get(m + "position_embedding_type")
    if c.has(m + "position_embedding_type"):
        if one_of(position, {"rope"}):
            c.ignore(m + "position_embedding_type", "plait's gpt_neox family uses rotary embeddings")
        else:
            c.unmap(m + "position_embedding_type", f"plait has no {position!r} position embeddings, only rotary "
                                                   "ones (position_embedding_type: rope); the recipe written "
                                                   "describes a rotary model")
    if c.has(m + "rotary_percentage"):
        c.map(m + "rotary_percentage", {"model.partial_rotary_factor": c.get(m + "rotary_percentage")})
    if c.has(m + "transformer_block_type"):
        kind = c.get(m + "transformer_block_type")
        if one_of(kind, BLOCK_TYPES):
            c.map(m + "transformer_block_type", {"model.use_parallel_residual": BLOCK_TYPES[kind]})
        else:
            c.unmap(m + "transformer_block_type", f"plait's gpt_neox blocks are {' or '.join(BLOCK_TYPES)}")
    for key in ("has_bias", "bias"):
        if c.has(m + key):
            if c.get(m + key) is False:
                c.unmap(m + key, "plait's gpt_neox always has MLP biases (attention_bias covers q/k/v and the "
                                 "output projection)")
            else:
                c.map(m + key, {"model.attention_bias": True}, "gpt_neox: biases everywhere, as has_bias")
    tied = c.owner("model.tie_word_embeddings")
    if tied is not None and tied.fields.get("model.tie_word_embeddings") is True:
        c.drop(tied, "plait's gpt_neox has an untied output head (embed_out); the recipe written unties it")
        c.map("(gpt_neox output head)", {"model.tie_word_embeddings": False}, "an untied head", value=None)
    if c.has(m + "apply_query_key_layer_scaling"):
        c.ignore(m + "apply_query_key_layer_scaling", "the same attention: Megatron divides the scores by the layer "
                                                      "number before its fp32 softmax and multiplies it back")


def _whole_rotary_blocks(c: Collector) -> None:
    """``rotary_percentage`` and ``transformer_block_type`` of a model that is not gpt_neox: plait's
    other families rotate whole heads in sequential pre-norm blocks."""
    m = "model."
    if c.has(m + "rotary_percentage") and not c.done(m + "rotary_percentage"):
        if c.get(m + "rotary_percentage") in (1, 1.0):
            c.ignore(m + "rotary_percentage", "every dimension of a head rotates, as in plait's RMSNorm families")
        else:
            c.unmap(m + "rotary_percentage", "plait's RMSNorm families rotate whole heads (only gpt_neox rotates a "
                                             "part of each)")
    if c.has(m + "transformer_block_type") and not c.done(m + "transformer_block_type"):
        if c.get(m + "transformer_block_type") == "pre_ln":
            c.ignore(m + "transformer_block_type", "plait's blocks are pre-norm (pre_ln)")
        else:
            c.unmap(m + "transformer_block_type", "plait's RMSNorm families have pre-norm (pre_ln) blocks")


def _init_and_dropout(c: Collector) -> None:
    """Two Megatron GPT keys with numerical effects plait does not have."""
    m = "model."
    if c.has(m + "use_scaled_init_method"):
        if c.get(m + "use_scaled_init_method") is False:
            c.ignore(m + "use_scaled_init_method", "plait draws every weight from init_method_std, unscaled")
        else:
            c.unmap(m + "use_scaled_init_method", "plait draws every weight from N(0, init_method_std); the output "
                                                  "layers are not scaled by 1/sqrt(2 * layers)")
    if c.has(m + "ffn_dropout"):
        if c.get(m + "ffn_dropout") in (0, 0.0, None):
            c.ignore(m + "ffn_dropout", "no dropout inside the MLP, as in plait")
        else:
            c.unmap(m + "ffn_dropout", "plait has no dropout inside the MLP (model.hidden_dropout acts on its "
                                       "output)")


#: NxDT's Mixture-of-Experts model keys -> plait's (Hugging Face names, like the dense fields)
_MOE_FIELDS = {"num_moe_experts": "model.num_local_experts", "num_local_experts": "model.num_local_experts",
               "moe_top_k": "model.num_experts_per_tok", "num_experts_per_tok": "model.num_experts_per_tok",
               "router_aux_loss_coef": "moe.aux_loss_coef"}


def _moe(c: Collector) -> None:
    """The expert count, top-k and auxiliary-loss weight; plait's Mixtral has an MoE block in every
    layer, so ``moe_frequency`` must be 1."""
    m = "model."
    for key, field in _MOE_FIELDS.items():
        if c.has(m + key):
            c.map(m + key, {field: c.get(m + key)}, "with model.family mixtral (docs/moe.md)")
    if c.has(m + "moe_frequency"):
        if c.get(m + "moe_frequency") == 1:
            c.ignore(m + "moe_frequency", "1 = an MoE block in every layer, as plait's mixtral family has")
        else:
            c.unmap(m + "moe_frequency", "plait's mixtral family has an MoE block in every layer (1), so the "
                                         "recipe written describes a different model; qwen3_moe's "
                                         "decoder_sparse_step is the Qwen3-MoE equivalent")


def _fusions(c: Collector) -> None:
    for key in c.section("model.fusions"):
        reason = ("plait's attention is torch's fused scaled_dot_product_attention" if key in
                  ("flash_attention", "softmax") else NOT_NUMERIC)
        c.ignore(f"model.fusions.{key}", reason)


def _checkpointing(c: Collector) -> None:
    m = "model."
    key = m + "activations_checkpoint_granularity"
    granularity = c.get(key)
    recompute = c.get(m + "activations_checkpoint_recompute")
    if c.has(key):
        if granularity is None:
            c.map(key, {"train.activation_checkpointing": "off"})
        elif granularity == "full":
            c.map(key, {"train.activation_checkpointing": "full"})
        elif granularity == "selective":
            names = ["self_attn.core"]
            if isinstance(recompute, list) and recompute and all(one_of(r, RECOMPUTE_MODULES) for r in recompute):
                names = list(dict.fromkeys(RECOMPUTE_MODULES[r] for r in recompute))
                c.ignore(m + "activations_checkpoint_recompute", f"mapped with {key}")
            if c.value("model.family") == "gpt_neox":  # its attention is the block's `attention`
                names = [n.replace("self_attn", "attention", 1) for n in names]
            c.map(key, {"train.activation_checkpointing": "selective", "train.checkpoint_modules": names},
                  f"NxDT recomputes the core attention (plait's {names[0]})")
        else:
            c.unmap(key, "plait's activation checkpointing is off, full or selective")
    if c.has(m + "activations_checkpoint_recompute") and not c.done(m + "activations_checkpoint_recompute"):
        c.unmap(m + "activations_checkpoint_recompute",
                f"module classes plait knows: {', '.join(RECOMPUTE_MODULES)}")
    if c.has(m + "activations_checkpoint_method"):
        c.ignore(m + "activations_checkpoint_method", "plait checkpoints every decoder block the same way")
    if c.has(m + "activations_checkpoint_num_layers"):
        if c.get(m + "activations_checkpoint_num_layers") in (None, 1):
            c.ignore(m + "activations_checkpoint_num_layers", "plait checkpoints each block separately")
        else:
            c.unmap(m + "activations_checkpoint_num_layers", "plait checkpoints each block separately, not in "
                                                              "groups of layers")
