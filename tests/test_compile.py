"""``train.compile``: recipe rules, which modules are compiled, and compiled-vs-eager parity.

Tolerance of the parity tests: inductor fuses and reorders the reductions of the compiled units
(RMSNorm's mean of squares, the softmax sums of attention and of the loss, vectorised
accumulation in its C++ kernels), so compiled runs are not bitwise equal to eager ones. Each
reordering is an fp32 round-off (relative 1e-7 per step, measured); over 20 steps of training
the differences grow a little through the optimizer, and the losses stay within the project's
fp32 parity bound, relative 1e-5 (DESIGN.md), the gradient norms within 1e-4 and the weights
(norm-relative) within 1e-4.

The parity runs compile (about 30 s per process on a cold cache on 2 busy cores): `make test-slow`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distributed import run_distributed
from plait.activation_checkpointing import apply_activation_checkpointing
from plait.config import RecipeError, check_recipe
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.models.mixtral import MixtralConfig, MixtralForCausalLM
from plait.train.compile import (
    MODES,
    compile_cache_dir,
    compile_seconds,
    compile_stages,
    compile_units,
    inductor_options,
    is_compiled,
    runs_eagerly,
)
from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, train_and_gather, weight_errors

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)


# ---------------------------------------------------------------------- recipe rules
def _problems(overrides: list[str], world: int | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        check_recipe(None, overrides, world)
    return str(info.value)


def test_compile_fields_are_typed():
    message = _problems(["train.compile=1"])
    assert "train.compile" in message
    message = _problems(["train.compile=true", "train.compile_mode=fast"])
    assert "train.compile_mode" in message and "max-autotune-no-cudagraphs" in message


def test_compile_rules_name_the_field_and_the_fix():
    message = _problems(["train.compile_mode=max-autotune-no-cudagraphs"])
    assert "train.compile_mode" in message and "train.compile=true" in message
    message = _problems(["train.compile=true", "parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=2",
                         "model.num_hidden_layers=4"], world=2)
    assert "parallel.schedule: 'zb-h1'" in message and "train.compile=false" in message
    message = _problems(["train.compile=true", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-zb",
                         "parallel.microbatches=2", "model.num_hidden_layers=4"], world=2)
    assert "use 'interleaved-1f1b'" in message
    check_recipe(None, ["train.compile=true", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "train.activation_checkpointing=full"], 2)  # a supported layout passes


# ---------------------------------------------------------------------- what is compiled
def test_units_are_whole_blocks_and_the_loss_head_without_tensor_parallelism():
    model = LlamaForCausalLM(TINY, device="meta")
    names = [n for n, _ in compile_units(model)]
    assert names == ["model.layers.0", "model.layers.1", "model.norm", "output"]


def test_units_stay_outside_checkpointed_modules():
    model = LlamaForCausalLM(TINY, device="meta")
    apply_activation_checkpointing([model], "full")
    names = [n for n, _ in compile_units(model)]
    # the checkpoint recomputes the block through the same compiled children
    assert names[:4] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn",
                         "model.layers.0.post_attention_layernorm", "model.layers.0.mlp"]
    model = LlamaForCausalLM(TINY, device="meta")
    apply_activation_checkpointing([model], "selective", ["self_attn.core", "mlp.act"])
    names = [n for n, _ in compile_units(model)]
    assert "model.layers.0.input_layernorm" in names and "model.layers.0.self_attn.core" not in names
    assert not any(n.endswith(("_proj", "mlp.act")) for n in names)  # lone projections are not units


def test_communicating_modules_run_eagerly_and_their_children_are_units():
    model = LlamaForCausalLM(TINY, device="meta")
    for block in model.model.layers:  # stand-ins for TP=2 attention and MLP modules
        block.self_attn.tp = block.mlp.tp = SimpleNamespace(size=2)
    assert runs_eagerly(model.model.layers[0].self_attn) and not runs_eagerly(model.model.layers[0])
    names = [n for n, _ in compile_units(model)]
    assert names[:4] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn.core",
                         "model.layers.0.post_attention_layernorm", "model.layers.0.mlp.act"]


def test_moe_layers_run_eagerly_and_the_rest_of_their_blocks_is_compiled():
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32)
    model = MixtralForCausalLM(config, device="meta")
    names = [n for n, _ in compile_units(model)]
    assert names[:3] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn",
                         "model.layers.0.post_attention_layernorm"]
    assert not any("block_sparse_moe" in n for n in names) and names[-2:] == ["model.norm", "output"]


def test_evaluation_runs_the_eager_forward_and_compiles_nothing():
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        eager = model(ids)
    names = compile_stages([model])
    assert all(is_compiled(model.get_submodule(n)) for n in names)
    before = compile_seconds()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), eager, rtol=0, atol=0)
    assert compile_seconds() == before
    with pytest.raises(ValueError, match="compile mode='fast'"):
        compile_stages([model], "fast")


@pytest.mark.parametrize("mode", MODES)
def test_every_compile_mode_is_accepted_by_torch_compile(mode):
    """torch.compile refuses ``mode`` and ``options`` together: a mode goes in as its options."""
    names = compile_stages([LlamaForCausalLM(TINY)], mode)
    assert names and inductor_options(mode)["fallback_random"] is True
    assert mode == "default" or inductor_options(mode)["max_autotune"] is True


def test_compile_cache_is_in_plaits_cache_directory(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes when unset
    assert compile_cache_dir(tmp_path) == tmp_path / "compile"
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "env"))
    assert compile_cache_dir() == tmp_path / "env" / "compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own choice wins
    assert compile_cache_dir(tmp_path) == tmp_path / "mine"


# ---------------------------------------------------------------------- parity (slow)
STEPS = 20
BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
        "data.micro_batch_size=2", "optimizer.grad_clip=1.0", "model.tie_word_embeddings=false",
        "scheduler.warmup_steps=2", "optimizer.lr=1.5e-3", "logging.progress_bar=false",
        "logging.tensorboard=false", "parallel.bucket_mb=0.05", "parallel.tp=1", "parallel.sequence_parallel=false"]

#: name: (overrides, world, microbatches per data-parallel rank); every layout's eager run equals
#: the single-process eager run with 2 micro-batches (tests/test_dp_parity.py and others)
LAYOUTS = {
    "single": ([], 1, 2),
    "tp2-sp": (["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 2),
    "pp2": (["parallel.pp=2"], 2, 2),
    "dp2-zero1": (["parallel.dp=2", "parallel.zero1=true"], 2, 1),
    "checkpoint-full": (["train.activation_checkpointing=full"], 1, 2),
    # TP without SP: norms, attention core and the SwiGLU inside the (eager) checkpoint of the MLP are units
    "checkpoint-selective-tp2": (["parallel.tp=2", "train.activation_checkpointing=selective",
                                  "train.checkpoint_modules=[mlp]"], 2, 2),
}
#: MoE (tiny Mixtral, aux and z-losses on): compiled attention and norms around eager MoE layers
MOE = ["model.family=mixtral", "model.intermediate_size=32", "model.num_local_experts=4",
       "model.num_experts_per_tok=2", "moe.aux_loss_coef=0.1", "moe.z_loss_coef=0.01"]
MOE_LAYOUTS = {
    "moe-single": ([], 1, 2),
    "moe-ep2": (["parallel.dp=2", "parallel.ep=2"], 2, 1),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


_EAGER: dict[tuple[str, ...], list[dict]] = {}


def _eager(corpus, tmp_path, items: list[str], world: int) -> list[dict]:
    key = (*items, str(world))
    if key not in _EAGER:
        _EAGER[key] = run_recipe(corpus, tmp_path / "eager", items, world, STEPS)
    return _EAGER[key]


def _compiled_worker(rank, world, recipe_yaml, prepared, steps):
    import yaml

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    units = [n for stage in trainer.state.stages for n, m in stage.named_modules() if is_compiled(m)]
    return {**train_and_gather(trainer, steps), "units": units, "compile_s": compile_seconds()}


def run_compiled(corpus, out_dir, items: list[str], world: int) -> list[dict]:
    """:func:`trainer_runs.run_recipe` with ``train.compile=true``, also returning each rank's
    compiled units and compile time (so a run that compiled nothing cannot pass)."""
    import yaml

    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = items + ["train.compile=true", f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    results = run_distributed(_compiled_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                              STEPS)
    for rank, r in enumerate(results):
        assert r["units"] and r["compile_s"] > 0, f"rank {rank} compiled nothing: {r['units']}"
    return results


def _assert_close(compiled: list[dict], eager: dict) -> None:
    assert eager["losses"][-1] < eager["losses"][0] - 0.3, "the reference must learn"
    for rank, r in enumerate(compiled):
        rel = max_relative(r["losses"], eager["losses"])
        print(f"rank {rank}: max relative loss difference compiled vs eager over {STEPS} steps {rel:.1e}")
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{eager['losses']}"
        rel = max_relative(r["norms"], eager["norms"])
        assert rel <= 1e-4, f"rank {rank}: relative grad-norm difference {rel:.2e}"
    for key, err in weight_errors(merged_weights(compiled), eager["weights"]).items():
        assert err <= 1e-4, f"{key}: relative weight difference {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(corpus, tmp_path, name):
    overrides, world, microbatches = LAYOUTS[name]
    dp = 2 if "parallel.dp=2" in overrides else 1
    eager = _eager(corpus, tmp_path, BASE + [f"parallel.microbatches={microbatches * dp}"], 1)[0]
    compiled = run_compiled(corpus, tmp_path / "compiled", BASE + overrides + [f"parallel.microbatches={microbatches}"],
                            world)
    _assert_close(compiled, eager)
    assert compile_cache_dir().is_dir() and any(compile_cache_dir().iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_compiled_moe_layout_matches_eager_single_process(corpus, tmp_path, name):
    overrides, world, microbatches = MOE_LAYOUTS[name]
    dp = 2 if "parallel.dp=2" in overrides else 1
    base = [b for b in BASE if not b.startswith("model.intermediate_size")] + MOE
    eager = _eager(corpus, tmp_path, base + [f"parallel.microbatches={microbatches * dp}"], 1)[0]
    compiled = run_compiled(corpus, tmp_path / "compiled", base + overrides + [f"parallel.microbatches={microbatches}"],
                            world)
    assert all(not any("block_sparse_moe" in u for u in r["units"]) for r in compiled)
    _assert_close(compiled, eager)


@pytest.mark.slow
def test_compiled_dropout_draws_the_eager_masks_under_tensor_parallelism(corpus, tmp_path):
    """Residual and attention dropout under TP=2 + SP (the per-TP-rank stream on sharded activations)
    with full checkpointing (recomputation replays it): compiled equals eager."""
    items = BASE + ["parallel.tp=2", "parallel.sequence_parallel=true", "model.hidden_dropout=0.1",
                    "model.attention_dropout=0.1", "train.activation_checkpointing=full", "parallel.microbatches=2"]
    eager = _eager(corpus, tmp_path, items, 2)
    compiled = run_compiled(corpus, tmp_path / "compiled", items, 2)
    # a run whose masks differ from eager's has a different loss from the first step on
    assert compiled[0]["losses"][0] == pytest.approx(eager[0]["losses"][0], rel=1e-6)
    _assert_close(compiled, eager[0])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=1"], ["parallel.tp=2", "parallel.sequence_parallel=true"]],
                         ids=["tp1", "tp2-sp"])
def test_compiled_lora_with_adapter_dropout_matches_eager(corpus, tmp_path, layout):
    """LoRA adapters (with their input dropout) inside compiled blocks (tp=1) and beside them (tp=2)."""
    items = BASE + layout + ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "parallel.microbatches=2",
                             "optimizer.lr=1e-2"]
    world = 2 if "parallel.tp=2" in layout else 1
    eager = run_recipe(corpus, tmp_path / "eager", items, world, STEPS)
    compiled = run_compiled(corpus, tmp_path / "compiled", items, world)
    assert eager[0]["losses"][-1] < eager[0]["losses"][0] - 0.05, "the adapters must learn"
    for rank, r in enumerate(compiled):
        rel = max_relative(r["losses"], eager[rank]["losses"])
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{eager[rank]['losses']}"
    for key, err in weight_errors(merged_weights(compiled), merged_weights(eager)).items():
        assert err <= 1e-4, f"{key}: relative weight difference {err:.2e}"


def _fit_worker(rank, world, recipe_yaml, prepared):
    import yaml

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    trainer.fit()
    return str(trainer.run.out), compile_seconds()


@pytest.mark.slow
def test_compile_time_is_logged_apart_from_the_throughput(corpus, tmp_path):
    import json

    import yaml

    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data
    from plait.train.report import summary_table

    items = BASE + ["train.compile=true", "train.steps=4", "train.log_every=2", "train.eval_every=4",
                    "scheduler.warmup_steps=1", "parallel.microbatches=2", "train.sample_tokens=0",
                    "parallel.pp=2", f"data.source={corpus}", f"run.output_dir={tmp_path / 'run'}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    ranks = run_distributed(_fit_worker, 2, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared)
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "tokens_per_s" in r]
    assert len(train) == 2 and train[0]["compile_s"] > 0
    assert train[1]["compile_s"] == train[0]["compile_s"]  # compiled once, at the first step
    # the slowest stage's compile: the last stage compiling stalls rank 0's step too
    assert train[0]["compile_s"] >= max(seconds for _, seconds in ranks) > 0
    # the first interval holds the compile; its throughput counts only the training time
    assert train[0]["elapsed_s"] - train[0]["compile_s"] > 0 and train[0]["tokens_per_s"] > 0
    assert "compile time" in summary_table(metrics)
