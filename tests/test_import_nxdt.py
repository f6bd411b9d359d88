"""``plait import-nxdt``: NxDT configs (tests/fixtures/nxdt) become plait recipes that validate.

The four fixtures are NxDT-style configs written for these tests (Llama 3 8B pre-training, a
Llama 2 SFT, a Mistral with its architecture in a config.json, NxDT's Megatron GPT in GPT-NeoX's
shape). Each test checks what the
import maps, what it reports as ignored or not mapped, and that plait's own validation accepts
the written recipe for its world size. No training runs here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plait.cli import main
from plait.config import load_recipe, validate_recipe
from plait.config.schema import ModelSection
from plait.interop.nxdt import NxdtConfigError, import_nxdt, read_nxdt
from plait.interop.nxdt_collect import leaf_keys

FIXTURES = Path(__file__).parent / "fixtures" / "nxdt"
LLAMA3 = FIXTURES / "llama3_8b_pretrain.yaml"
SFT = FIXTURES / "llama2_7b_sft.yaml"
MISTRAL = FIXTURES / "mistral_7b_pretrain.yaml"
NEOX = FIXTURES / "megatron_gpt_neox.yaml"


def _import(path: Path, **changes):
    """Import ``path`` with dotted-key ``changes`` applied (``None`` removes the key)."""
    data = read_nxdt(path)
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return import_nxdt(data, path.parent, source=str(path))


def _fields(result) -> dict[str, object]:
    """Every plait field the mapped entries set, flattened (``section.field`` -> value)."""
    return {f"{section}.{name}": value for section, values in result.recipe.items() for name, value in values.items()}


def _by_kind(result, kind: str) -> dict[str, str]:
    return {e.key: e.reason for e in result.entries if e.kind == kind}


# ---------------------------------------------------------------------- the three fixtures
EXPECTED = {
    LLAMA3: (128, {
        "run.name": "llama3-8b-pretrain", "run.seed": 1234, "run.output_dir": "/shared/experiments/{name}",
        "parallel.tp": 32, "parallel.pp": 1, "parallel.dp": 4, "parallel.vpp": 1, "parallel.zero1": True,
        "parallel.sequence_parallel": True, "parallel.kv_replication": 4, "parallel.microbatches": 128,
        "data.global_batch_size": 512, "data.micro_batch_size": 1, "data.seq_len": 8192,
        "data.tokenizer": "/shared/tokenizers/llama3/tokenizer.json", "data.source": "/shared/data/fineweb_text",
        "model.num_hidden_layers": 32, "model.hidden_size": 4096, "model.intermediate_size": 14336,
        "model.num_attention_heads": 32, "model.num_key_value_heads": 8, "model.vocab_size": 128256,
        "model.rope_theta": 500000.0, "model.max_position_embeddings": 8192, "model.rms_norm_eps": 1e-5,
        "model.tie_word_embeddings": False, "train.steps": 10000, "train.log_every": 10, "train.eval_every": 500,
        "train.eval_batches": 4, "train.activation_checkpointing": "selective",
        "train.checkpoint_modules": ["self_attn.core"], "optimizer.lr": 3e-4, "optimizer.weight_decay": 0.1,
        "optimizer.beta1": 0.9, "optimizer.beta2": 0.95, "optimizer.grad_clip": 1.0, "scheduler.name": "cosine",
        "scheduler.warmup_steps": 2000, "scheduler.min_lr_ratio": pytest.approx(0.1),
        "precision.preset": "bf16-mixed", "checkpoint.save_every": 250, "checkpoint.keep": 2,
        "checkpoint.resume": "auto", "checkpoint.async_save": True, "logging.tensorboard": True,
    }, set()),
    SFT: (32, {
        "run.name": "llama2-sft", "run.output_dir": "/shared/runs/llama2-sft", "parallel.tp": 8, "parallel.dp": 4,
        "parallel.microbatches": 8, "data.global_batch_size": 32, "data.seq_len": 4096,
        "data.source": "/shared/data/instructions/train.jsonl", "model.max_position_embeddings": 4096,
        "model.num_key_value_heads": 32, "model.intermediate_size": 11008, "model.tie_word_embeddings": False,
        "train.activation_checkpointing": "full", "optimizer.beta2": 0.999, "optimizer.grad_clip": 0.0,
        "optimizer.weight_decay": 0.0, "scheduler.name": "linear", "scheduler.min_lr_ratio": 0.0,
        "precision.preset": "bf16-pure", "checkpoint.save_every": 400, "checkpoint.keep_every": 400,
        "checkpoint.resume": "none", "logging.tensorboard": False,
    }, {"model_alignment_strategy", "trainer.val_check_interval", "trainer.limit_val_batches", "data.val_dir",
        "data.dev_choose_samples"}),
    MISTRAL: (64, {
        "run.name": "hf_mistral_7b", "parallel.tp": 8, "parallel.pp": 4, "parallel.vpp": 2, "parallel.dp": 2,
        "parallel.schedule": "interleaved-1f1b", "parallel.kv_replication": 1, "parallel.microbatches": 32,
        "model.num_hidden_layers": 32, "model.num_key_value_heads": 8, "model.vocab_size": 32000,
        "model.max_position_embeddings": 4096, "model.tie_word_embeddings": False,
        "train.activation_checkpointing": "off", "precision.preset": "manual", "precision.param_dtype": "bf16",
        "precision.master_weights": True, "precision.grad_dtype": "fp32", "precision.stochastic_rounding": False,
        "scheduler.min_lr_ratio": pytest.approx(0.1), "data.tokenizer": "/shared/models/mistral-7b/tokenizer.json",
    }, {"model.optim.sched.constant_steps"}),
    NEOX: (32, {
        "model.family": "gpt_neox", "model.num_hidden_layers": 16, "model.hidden_size": 2048,
        "model.intermediate_size": 8192, "model.num_attention_heads": 8, "model.num_key_value_heads": 8,
        "model.vocab_size": 50304, "model.layer_norm_eps": 1e-5, "model.partial_rotary_factor": 0.25,
        "model.use_parallel_residual": True, "model.hidden_act": "gelu", "model.attention_bias": True,
        "model.tie_word_embeddings": False, "parallel.tp": 8, "parallel.dp": 4, "parallel.sequence_parallel": True,
        "train.activation_checkpointing": "selective", "train.checkpoint_modules": ["attention.core"],
        "precision.preset": "bf16-mixed",
    }, {"model.optim.sched.constant_steps"}),
}


@pytest.mark.parametrize("path", list(EXPECTED), ids=lambda p: p.stem)
def test_fixture_mapping(path: Path) -> None:
    world, fields, not_mapped = EXPECTED[path]
    result = _import(path)
    got = _fields(result)
    for name, value in fields.items():
        assert got.get(name) == value, name
    assert result.world_size == world
    assert result.problems == []
    unmapped = set(_by_kind(result, "not mapped"))
    if path is MISTRAL and "family" not in ModelSection.model_fields:
        not_mapped = not_mapped | {"model.model_config:model_type"}  # reported: no model.family field to hold it
    if path is MISTRAL and "sliding_window" not in ModelSection.model_fields:
        not_mapped = not_mapped | {"model.model_config:sliding_window"}
    assert unmapped == not_mapped


def test_mistral_family() -> None:
    """model.family comes from config.json's model_type, sliding_window from config.json, when the recipe
    has those fields; else they are reported as not mapped."""
    result = _import(MISTRAL)
    unmapped = _by_kind(result, "not mapped")
    if "family" in ModelSection.model_fields:
        assert _fields(result)["model.family"] == "mistral"
        assert _fields(_import(LLAMA3))["model.family"] == "llama"  # from the config's name, said to be a guess
    else:
        assert "model.family" in unmapped["model.model_config:model_type"]
    if "sliding_window" in ModelSection.model_fields:
        assert _fields(result)["model.sliding_window"] == 4096
    else:
        assert "sliding_window" in unmapped["model.model_config:sliding_window"]


@pytest.mark.parametrize("path", list(EXPECTED), ids=lambda p: p.stem)
def test_every_key_is_accounted_for(path: Path) -> None:
    """Each leaf key of the config has one entry: mapped, ignored or not mapped (with a reason unless mapped)."""
    result = _import(path)
    keys = [e.key for e in result.entries]
    for leaf in leaf_keys(read_nxdt(path)):
        covering = [k for k in keys if leaf == k or leaf.startswith(k + ".")]
        assert len(covering) == 1, (leaf, covering)
    for e in result.entries:
        assert e.kind == "mapped" or e.reason, e.key


def test_ignored_keys_say_why() -> None:
    ignored = _by_kind(_import(LLAMA3), "ignored")
    assert "Neuron" in ignored["compiler_flags"]
    assert "Neuron" in ignored["neuron_rt_exec_timeout"]
    assert "scaled_dot_product_attention" in ignored["model.fusions.flash_attention"]
    assert "mixed_precision" in ignored["precision.master_weights"]
    assert "train.steps" in ignored["model.optim.sched.max_steps"]


@pytest.mark.parametrize("path", list(EXPECTED), ids=lambda p: p.stem)
def test_written_recipe_validates(path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "recipe.yaml"
    assert main(["import-nxdt", str(path), "-o", str(out)]) == 0
    report = capsys.readouterr().out
    assert "mapped (" in report and "ignored (" in report and "not mapped (" in report
    world = EXPECTED[path][0]
    assert f"--nproc {world} --no-path-checks: ok" in report
    resolved = validate_recipe(load_recipe(out), world, check_paths=False)
    assert resolved.world_size == world
    assert main(["config", "validate", str(out), "--nproc", str(world), "--no-path-checks"]) == 0


def test_megatron_gpt_is_gpt_neox_and_its_defaults_are_reported() -> None:
    """NxDT's Megatron GPT with layer norms is plait's gpt_neox (no rms_norm_eps, whatever its name);
    what gpt_neox cannot be (megatron_gpt_config.yaml's learned absolute positions and tied embeddings,
    a post-norm block, a SwiGLU MLP) is reported, and the recipe written still validates."""
    fields = _fields(_import(NEOX))
    assert "model.rms_norm_eps" not in fields and fields["model.layer_norm_eps"] == 1e-5
    result = _import(NEOX, **{"model.position_embedding_type": "learned_absolute",
                              "model.share_embeddings_and_output_weights": True, "model.activation": "swiglu",
                              "model.transformer_block_type": "post_ln", "model.has_bias": False,
                              "model.use_scaled_init_method": True, "model.ffn_dropout": 0.1})
    unmapped = _by_kind(result, "not mapped")
    assert "rotary" in unmapped["model.position_embedding_type"]
    assert "untied" in unmapped["model.share_embeddings_and_output_weights"]
    assert "GeLU" in unmapped["model.activation"] and "gpt_j or pre_ln" in unmapped["model.transformer_block_type"]
    assert "MLP biases" in unmapped["model.has_bias"] and "1/sqrt" in unmapped["model.use_scaled_init_method"]
    assert "inside the MLP" in unmapped["model.ffn_dropout"]
    assert _fields(result)["model.tie_word_embeddings"] is False
    validate_recipe(result.recipe, result.world_size, check_paths=False)
    llama = _import(LLAMA3, **{"model.rotary_percentage": 0.5, "model.transformer_block_type": "pre_ln"})
    assert "whole heads" in _by_kind(llama, "not mapped")["model.rotary_percentage"]
    assert "pre-norm" in _by_kind(llama, "ignored")["model.transformer_block_type"]


def test_pythia_config_json_gives_gpt_neox(tmp_path: Path) -> None:
    """An HF-style NxDT config whose model_config is a released Pythia config.json (rotary_pct,
    rotary_emb_base, no attention_bias key, no KV heads) maps to gpt_neox with transformers' values."""
    import json

    pythia = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_act": "gelu",
              "hidden_size": 768, "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
              "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_emb_base": 10000, "rotary_pct": 0.25,
              "tie_word_embeddings": False, "use_parallel_residual": True, "vocab_size": 50304}
    (tmp_path / "config.json").write_text(json.dumps(pythia))
    result = _import(MISTRAL, **{"model.model_config": str(tmp_path / "config.json"), "model.max_position_embeddings":
                                 2048, "data.seq_length": 2048})
    fields = _fields(result)
    assert fields["model.family"] == "gpt_neox" and fields["model.partial_rotary_factor"] == 0.25
    assert fields["model.rope_theta"] == 10000 and fields["model.attention_bias"] is True
    assert fields["model.num_key_value_heads"] == 12 and fields["model.use_parallel_residual"] is True
    assert "model.rms_norm_eps" not in fields and "model.sliding_window" not in fields
    resolved = validate_recipe(result.recipe, result.world_size, check_paths=False)
    assert resolved.model_config(50304).num_parameters() == 162322944  # Pythia-160M


# ---------------------------------------------------------------------- values plait refuses
def test_kv_multiplier_plait_cannot_place_is_withdrawn() -> None:
    """NxDT accepts kv_size_multiplier=3 at its own risk; plait's head layout refuses it: reported, left null."""
    result = _import(LLAMA3, **{"distributed_strategy.kv_size_multiplier": 3})
    reason = _by_kind(result, "not mapped")["distributed_strategy.kv_size_multiplier"]
    assert "invalid for plait" in reason and "kv_replication" in reason
    assert "parallel.kv_replication" not in _fields(result)
    assert result.problems == []
    validate_recipe(result.recipe, result.world_size, check_paths=False)


def test_global_batch_not_divisible_is_reported() -> None:
    result = _import(LLAMA3, **{"data.global_batch_size": 510})
    reason = _by_kind(result, "not mapped")["data.global_batch_size"]
    assert "multiple of micro_batch_size*dp = 1*4" in reason
    assert "data.global_batch_size" not in _fields(result) and "parallel.microbatches" not in _fields(result)
    validate_recipe(result.recipe, result.world_size, check_paths=False)


def test_without_device_count_dp_stays_open() -> None:
    result = _import(SFT, **{"trainer.devices": None, "trainer.num_nodes": None})
    assert "parallel.dp" not in _fields(result)
    assert "dp is unknown" in _by_kind(result, "not mapped")["data.global_batch_size"]
    assert result.world_size == 8
    validate_recipe(result.recipe, result.world_size, check_paths=False)


def test_interleaved_schedule_needs_enough_microbatches() -> None:
    """vpp=2 at pp=4 with 2 micro-batches: plait's interleaved schedule refuses; the vpp is withdrawn, said so."""
    result = _import(MISTRAL, **{"data.global_batch_size": 4})
    assert result.problems == []
    unmapped = _by_kind(result, "not mapped")
    assert "invalid for plait" in unmapped["data.global_batch_size"]
    assert "interleaved-1f1b" in unmapped["distributed_strategy.virtual_pipeline_model_parallel_size"]
    assert "parallel.vpp" not in _fields(result) and _fields(result)["parallel.pp"] == 4
    validate_recipe(result.recipe, result.world_size, check_paths=False)


def test_unreadable_model_config_is_reported(tmp_path: Path) -> None:
    result = _import(MISTRAL, **{"model.model_config": str(tmp_path / "missing.json")})
    assert "cannot read" in _by_kind(result, "not mapped")["model.model_config"]


@pytest.mark.parametrize("kind,preset", [("fp32", "fp32"), ("autocast", "autocast"),
                                         ("mixed_precision", "bf16-mixed"), ("mixed_precisionSR", "bf16-mixed"),
                                         ("bf16SR", "bf16-pure")])
def test_precision_types(kind: str, preset: str) -> None:
    result = _import(SFT, **{"precision.type": kind})
    assert _fields(result)["precision.preset"] == preset


def test_unknown_precision_type_is_not_mapped() -> None:
    result = _import(SFT, **{"precision.type": "fp8"})
    assert "precision.type" in _by_kind(result, "not mapped")
    assert "precision.preset" not in _fields(result)


# ---------------------------------------------------------------------- the command
def test_recipe_to_stdout_report_to_stderr(capsys) -> None:
    assert main(["import-nxdt", str(SFT)]) == 0
    captured = capsys.readouterr()
    recipe = yaml.safe_load(captured.out)
    assert recipe["parallel"]["tp"] == 8
    assert "not mapped (5):" in captured.err


@pytest.mark.parametrize("text,expected", [
    ("- a\n- b\n", "not a YAML mapping"),
    ("parallel:\n  tp: 2\n", "not an NxDT config"),
    ("trainer: [\n", "not valid YAML"),
])
def test_bad_input_exit_2(tmp_path: Path, capsys, text: str, expected: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["import-nxdt", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and str(path) in err and len(err.strip().splitlines()) == 1


def test_missing_file_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["import-nxdt", str(tmp_path / "none.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(NxdtConfigError):
        read_nxdt(tmp_path / "none.yaml")


def test_existing_output_needs_force(tmp_path: Path, capsys) -> None:
    out = tmp_path / "recipe.yaml"
    out.write_text("keep me\n")
    assert main(["import-nxdt", str(SFT), "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    # --force replaces only an earlier import's output, never a file of someone else's
    assert main(["import-nxdt", str(SFT), "-o", str(out), "--force"]) == 2
    assert "not written by plait import-nxdt" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    ours = tmp_path / "imported.yaml"
    assert main(["import-nxdt", str(LLAMA3), "-o", str(ours)]) == 0
    assert main(["import-nxdt", str(SFT), "-o", str(ours), "--force"]) == 0
    assert load_recipe(ours).parallel.tp == 8


@pytest.mark.parametrize("changes", [
    {"distributed_strategy.tensor_model_parallel_size": "8"},
    {"model.normalization": {"kind": "rmsnorm"}, "model.optim.name": ["adamw"]},
    {"model.activations_checkpoint_recompute": [{"CoreAttention": 1}]},
    {"trainer": 5, "model.optim.betas": "0.9,0.95"},
    {"model.max_position_embeddings": "${oc.env:SEQ}", "data.seq_length": "${data.seq_length}"},
    {"distributed_strategy.pipeline_model_parallel_size": 64},
], ids=["tp-text", "unhashable", "recompute-mapping", "trainer-scalar", "references", "pp-over-layers"])
def test_odd_values_are_reported_not_crashed(changes: dict) -> None:
    """Values NxDT would reject or plait cannot use never crash the import; the recipe still validates."""
    result = _import(LLAMA3, **changes)
    assert result.problems == []
    assert result.of_kind("not mapped")
    validate_recipe(result.recipe, result.world_size, check_paths=False)


# ---------------------------------------------------------------------- Mixture-of-Experts, context parallelism
def test_mixtral_moe_keys_and_expert_parallelism_are_mapped() -> None:
    """NxDT's expert count, top-k, aux-loss weight and expert-parallel degree land in plait's mixtral
    fields (Hugging Face names), moe section and parallel.ep; the recipe validates."""
    result = _import(LLAMA3, **{"name": "hf_mixtral_tiny", "model.num_moe_experts": 8, "model.moe_top_k": 2,
                                "model.router_aux_loss_coef": 0.02, "model.moe_frequency": 1,
                                "distributed_strategy.expert_model_parallel_size": 2,
                                "distributed_strategy.sequence_parallel": False})  # MoE runs without SP
    fields = _fields(result)
    assert fields["model.family"] == "mixtral"
    assert (fields["model.num_local_experts"], fields["model.num_experts_per_tok"]) == (8, 2)
    assert fields["moe.aux_loss_coef"] == 0.02 and fields["parallel.ep"] == 2
    assert "model.moe_frequency" in _by_kind(result, "ignored")
    every_other = _by_kind(_import(LLAMA3, **{"model.moe_frequency": 2}), "not mapped")["model.moe_frequency"]
    assert "every layer" in every_other
    assert result.problems == []
    validate_recipe(result.recipe, result.world_size, check_paths=False)


def test_context_parallel_size_is_reported_for_a_hand_mapping() -> None:
    result = _import(LLAMA3, **{"distributed_strategy.context_parallel_size": 2})
    assert "parallel.cp by hand" in _by_kind(result, "not mapped")["distributed_strategy.context_parallel_size"]
    assert "parallel.cp" not in _fields(result)
