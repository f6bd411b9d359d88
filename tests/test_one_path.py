"""One training path for every layout: a rank always holds a list of stages driven by a schedule.

What used to differ between pipeline and non-pipeline runs and is checked here:

* ``model.hf_path`` is read under every layout, each stage reading only its tensors (it was ignored
  under pipeline parallelism, so a fine-tune silently restarted from random weights);
* the end-of-run sample exists for pipeline runs too: the stages seen as one causal LM give the
  full model's logits on every rank;
* the learning-rate schedule is positioned on resume through the scheduler's public constructor.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from distributed import run_distributed
from plait.config import load_recipe, recipe_data
from plait.config.load import DEFAULT_RECIPE
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.pipeline.stages_lm import StagesCausalLM
from plait.train.entry import prepare_data
from trainer_runs import corpus_dir, max_relative, run_recipe

ARCH = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=4",
        "model.num_attention_heads=4", "model.num_key_value_heads=2"]
BASE = ARCH + ["data.vocab_size=320", "data.seq_len=32", "data.micro_batch_size=2", "parallel.microbatches=2",
               "parallel.sequence_parallel=false", "scheduler.warmup_steps=1", "logging.progress_bar=false",
               "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(corpus, tmp_path_factory):
    """A Hugging Face directory of the recipe's architecture with weights unlike any seed's
    initialisation (seed 7, then scaled), and the prepared data's tokenizer."""
    items = BASE + [f"data.source={corpus}", "parallel.tp=1"]
    recipe = load_recipe(DEFAULT_RECIPE, items)
    prepared = prepare_data(recipe)
    config = recipe.model.to_model_config(320)
    model = build_model(config, single_process_mesh(), seed=7)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    out = tmp_path_factory.mktemp("hf") / "model"
    save_hf_checkpoint(model, out, single_process_mesh().info("tp"))
    shutil.copy(prepared / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.parametrize("layout,world", [(["parallel.tp=1", "parallel.pp=2"], 2),
                                          pytest.param(["parallel.tp=2", "parallel.pp=2"], 4,
                                                       marks=pytest.mark.slow)])  # 4 ranks: make test-slow
def test_hf_path_is_read_under_pipeline_parallelism(corpus, hf_model, tmp_path, layout, world):
    """PP=2 and TP=2 x PP=2 from a Hugging Face directory start from its weights: the same first
    loss as one process, and not the loss of a fresh initialisation (the negative control)."""
    # the model's tokenizer file sets the vocabulary: no BPE size (refused as a key without effect)
    hf = [i for i in BASE if not i.startswith("data.vocab_size=")] + [f"model.hf_path={hf_model}",
                                                                      f"data.tokenizer={hf_model / 'tokenizer.json'}"]
    single = run_recipe(corpus, tmp_path / "one", hf + ["parallel.tp=1"], 1, 2)[0]["losses"]
    fresh = run_recipe(corpus, tmp_path / "fresh", BASE + ["parallel.tp=1"], 1, 1)[0]["losses"]
    results = run_recipe(corpus, tmp_path / "pp", hf + layout, world, 2)
    losses = results[-1]["losses"]  # the last rank holds the last stage, where the loss lives
    assert max_relative(losses, single) <= 1e-5, (losses, single)
    assert abs(single[0] - fresh[0]) > 0.05, "the checkpoint's weights must change the first loss"


def _logits_worker(rank, world, config, pp, tp, ids):
    mesh = ParallelMesh(world, rank, tp=tp, pp=pp)
    stages = build_stages(config, mesh, [[0, 1], [2, 3]] if pp > 1 else [[0, 1, 2, 3]], seed=3)
    return StagesCausalLM(stages, mesh)(ids)


@pytest.mark.parametrize("pp,tp,vpp", [(2, 1, 1), (2, 1, 2), (2, 2, 1)])
def test_stages_give_the_full_models_logits_on_every_rank(pp, tp, vpp):
    """The sample of a pipeline run is drawn from these logits: every rank must hold the full
    model's, so every rank samples the same token."""
    recipe = load_recipe(DEFAULT_RECIPE, BASE)
    config = recipe.model.to_model_config(320)
    ids = torch.randint(0, 320, (1, 11))
    reference = build_model(config, single_process_mesh(), seed=3)(ids)
    world = pp * tp
    for logits in run_distributed(_logits_worker, world, config, pp, tp, ids) if vpp == 1 else \
            run_distributed(_logits_worker_vpp, world, config, pp, ids):
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def _logits_worker_vpp(rank, world, config, pp, ids):
    mesh = ParallelMesh(world, rank, pp=pp)
    stages = build_stages(config, mesh, [[0], [1], [2], [3]], seed=3)  # two chunks per rank
    return StagesCausalLM(stages, mesh)(ids)


@pytest.mark.slow  # two `plait train` launches at PP=2 (the sample of a TP run: tests/test_trainer.py)
def test_pipeline_run_ends_with_a_sample(corpus, tmp_path):
    """plait train under PP=2 writes a sample like any other run (it printed a note before)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "plait.cli", "train", *BASE, "parallel.tp=1", "parallel.pp=2",
           f"data.source={corpus}", f"run.output_dir={out}", "train.steps=4", "train.eval_every=4",
           "train.eval_batches=1", "train.sample_tokens=6", "--nproc", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "sample.txt").read_text().strip()
    assert "generates no sample" not in proc.stdout
    assert (out / "final" / "model.safetensors").is_file()
    # the checkpoint the final model was converted from was private: a run that asked for no
    # checkpoints leaves none, and the same command runs again in its own directory
    assert not [p for p in (out / "checkpoints").iterdir() if not p.name.startswith(".plait-")]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


def _resume_lr_worker(rank, world, recipe_yaml, prepared, steps):
    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    batches, lrs = iter(trainer.run.loader), []
    for _ in range(steps):
        lrs.append(trainer.run_step(next(batches)))
        if trainer.state.start_step == 0 and len(lrs) == 2:
            trainer.save_checkpoint(2, sync=True)
    trainer.run.loader.close()
    return {"start": trainer.state.start_step, "lrs": lrs}


def test_resumed_learning_rate_schedule_continues(corpus, tmp_path):
    """The scheduler is rebuilt at the resumed step (no private attributes): the learning rates
    after a resume are those of the unbroken run."""
    items = BASE + ["parallel.tp=1", f"data.source={corpus}", f"run.output_dir={tmp_path}", "train.steps=6",
                    "scheduler.warmup_steps=2", "checkpoint.async_save=false"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    unbroken = run_distributed(_resume_lr_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared,
                               5)[0]
    resumed = run_distributed(_resume_lr_worker, 1,
                              yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items + ["checkpoint.resume=auto"])),
                              prepared, 3)[0]
    assert resumed["start"] == 2
    assert resumed["lrs"] == unbroken["lrs"][2:5]


@pytest.mark.slow  # 20 s; the families' numerics are checked against transformers in test_families.py
@pytest.mark.parametrize("family,extra", [("qwen3", ["model.head_dim=16"]),
                                          ("mistral", ["model.sliding_window=12"])])
def test_family_trains_identically_under_tp2_x_pp2(corpus, tmp_path, family, extra):
    """Each model family through the one training path: 20 steps of TP=2 x PP=2 follow one process
    (fp32, relative 1e-5). Mistral's window (12) is shorter than the sequence (32), so it matters."""
    items = BASE + [f"model.family={family}", *extra, "train.steps=20"]
    single = run_recipe(corpus, tmp_path / "one", items + ["parallel.tp=1"], 1, 20)[0]["losses"]
    layout = run_recipe(corpus, tmp_path / "tp2pp2", items + ["parallel.tp=2", "parallel.pp=2"], 4, 20)
    assert max_relative(layout[-1]["losses"], single) <= 1e-5
    assert single[-1] < single[0], "the run must train"
