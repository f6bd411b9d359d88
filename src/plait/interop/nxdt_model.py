"""The ``model`` section of an NxDT config: architecture, family, fusions, activation checkpointing.

The architecture comes from the keys written inline (NxDT's Megatron-style models) and from
``model.model_config``, a Hugging Face config.json (NxDT's HF-style models), when it is readable
here; inline keys win, as they do in NxDT. See docs/nxdt.md for the table.
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.config.schema import ARCH_FIELDS, ModelSection
from plait.interop.nxdt_collect import Collector
from plait.interop.nxdt_sections import NOT_NUMERIC, ignore_listed, one_of
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


def import_model(c: Collector, base_dir: Path) -> None:
    m = "model."
    family = _model_config(c, base_dir)
    for key, name in MODEL_FIELDS.items():
        if c.has(m + key):
            value = c.get(m + key)
            if key == "layernorm_epsilon" and c.has(m + "rms_norm_eps"):
                c.ignore(m + key, "model.rms_norm_eps is given")
                continue
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
    if c.has(m + "has_bias") or c.has(m + "bias"):
        key = m + ("has_bias" if c.has(m + "has_bias") else "bias")
        if c.get(key) is False:
            c.map(key, {"model.attention_bias": False})
        else:
            c.unmap(key, "plait has q/k/v/o biases (model.attention_bias) but no MLP biases")
    for key, (fine, reason) in _MODEL_DEFAULTS.items():
        if c.has(m + key):
            if one_of(c.get(m + key), fine):
                c.ignore(m + key, reason)
            else:
                c.unmap(m + key, f"plait supports only {sorted(fine, key=str)[0]!r}")
    ignore_listed(c, m, _MODEL_IGNORED)
    _moe(c)
    if c.has(m + "peft"):
        c.unmap(m + "peft", "not imported: plait's LoRA is the lora section (rank, alpha, target_modules; "
                            "docs/post_training.md maps the keys); the recipe trains every weight")
    if c.has(m + "make_vocab_size_divisible_by"):
        c.ignore(m + "make_vocab_size_divisible_by", "plait does not pad the vocabulary; set model.vocab_size "
                                                     "to a padded size if you want one")
    _family(c, family)
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


def _family(c: Collector, model_type: str | None) -> None:
    """``model.family`` from config.json's model_type, else from the run's name (a guess, said so)."""
    if model_type is not None:
        family, source, how = model_type, "model.model_config:model_type", "from config.json"
    else:
        name = str(c.get("name", "")).lower()
        guess = next((f for f in FAMILIES if f in name), None)
        if guess is None:
            return
        family = guess
        source, how = "(family from name)", f"guessed from the config's name {c.get('name')!r}"
    if family not in FAMILIES:
        c.unmap(source, f"plait's model families are {', '.join(FAMILIES)}", value=family)
    elif "family" in ModelSection.model_fields:
        c.map(source, {"model.family": family}, how, value=family)
    elif family != "llama":
        c.unmap(source, "this plait has no model.family recipe field yet; the recipe describes a Llama model",
                value=family)


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
            c.map(key, {"train.activation_checkpointing": "selective", "train.checkpoint_modules": names},
                  "NxDT recomputes the core attention (plait's self_attn.core)")
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
