"""Context parallelism through the real trainer against one process: 20 AdamW steps, fp32.

The cp ranks of a layout hold the same weights and the zigzag chunks of the same sequences
(``parallel.cp``); the losses must equal the single-process run within a relative 1e-5, the first
step's gradient norm within 2e-6 (every gradient entry counted once: a cp rank's partial gradient
lost or counted twice is off by O(1)), and the final weights norm-relative per tensor (see
tests/test_dp_parity.py for the tolerances). Each run takes longer than the default suite allows
(spawned ranks, 20 steps), so all are in ``make test-slow``; the attention and model parity of cp
run by default (tests/test_ring_attention.py, tests/test_context_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from distributed import run_distributed
from trainer_runs import (
    corpus_dir,
    max_relative,
    merged_weights,
    run_checkpointed,
    run_recipe,
    train_and_gather,
    weight_errors,
)

STEPS = 20
BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=48",
        "data.micro_batch_size=2", "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0",
        "scheduler.warmup_steps=2", "optimizer.lr=1.5e-3", "parallel.tp=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "parallel.bucket_mb=0.05", "train.sample_tokens=0",
        "model.tie_word_embeddings=false"]

#: name: (overrides, world, microbatches per dp rank, dp)
LAYOUTS = {
    "cp2": (["parallel.cp=2"], 2, 2, 1),
    "cp2-allgather": (["parallel.cp=2", "parallel.cp_mode=allgather"], 2, 2, 1),
    "cp4": (["parallel.cp=4"], 4, 2, 1),
    "cp2xtp2-sp": (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, 2, 1),
    "cp2xdp2": (["parallel.cp=2", "parallel.dp=2"], 4, 1, 2),
    "cp2xdp2-zero1": (["parallel.cp=2", "parallel.dp=2", "parallel.zero1=true"], 4, 1, 2),
    "cp2xpp2": (["parallel.cp=2", "parallel.pp=2"], 4, 2, 1),
}
WEIGHT_TOL = {"cp2xtp2-sp": 5e-5}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


_REFERENCES: dict[int, dict] = {}


def _cp_worker(rank, world, recipe_yaml, prepared, steps):
    """As trainer_runs' worker, plus what shows cp is really on (a run that ignored parallel.cp and
    gave every rank whole sequences would match one process too)."""
    from plait.config import validate_recipe
    from plait.context_parallel.attention import ContextParallelAttention
    from plait.nn.attention import AttentionCore
    from plait.tensor_parallel.attention import ParallelAttentionCore
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world)
    trained = train_and_gather(trainer, steps)
    kinds = (AttentionCore, ParallelAttentionCore)
    cores = [m for s in trainer.state.stages for m in s.modules() if isinstance(m, kinds)]
    switched = [isinstance(getattr(m, "context_parallel", None) or getattr(m, "attention_fn", None),
                           ContextParallelAttention) for m in cores]
    runtime = trainer.state.runtime
    return {**trained, "switched": switched,
            "split": runtime.hooks.split_batch is not None, "local_seq": runtime.act_shape[1]}


def _run(corpus, out_dir, items, world):
    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = items + [f"data.source={corpus}", f"run.output_dir={out_dir}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    return run_distributed(_cp_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(corpus, tmp_path, name):
    overrides, world, microbatches, dp = LAYOUTS[name]
    total = microbatches * dp
    if total not in _REFERENCES:
        _REFERENCES[total] = run_recipe(corpus, tmp_path / "ref", BASE + [f"parallel.microbatches={total}"], 1,
                                        STEPS)[0]
    ref = _REFERENCES[total]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, "the reference must learn for the comparison to mean anything"
    results = _run(corpus, tmp_path / "run", BASE + overrides + [f"parallel.microbatches={microbatches}"], world)
    cp = int(next(o for o in overrides if o.startswith("parallel.cp=")).split("=")[1])
    sp = 2 if "parallel.sequence_parallel=true" in overrides else 1
    for rank, r in enumerate(results):
        assert r["split"] and r["switched"] and all(r["switched"]), f"rank {rank}: cp is not wired"
        assert r["local_seq"] == 48 // cp // sp
        rel = max_relative(r["losses"], ref["losses"])
        assert rel <= 1e-5, f"rank {rank}: relative loss difference {rel:.2e}\n{r['losses']}\n{ref['losses']}"
        first = abs(r["norms"][0] - ref["norms"][0]) / ref["norms"][0]
        assert first <= 2e-6, f"rank {rank}: first-step grad norm {r['norms'][0]} vs {ref['norms'][0]}"
        rel = max_relative(r["norms"], ref["norms"])
        assert rel <= 5e-5, f"rank {rank}: relative grad-norm difference {rel:.2e}\n{r['norms']}\n{ref['norms']}"
    for key, err in weight_errors(merged_weights(results), ref["weights"]).items():
        assert err <= WEIGHT_TOL.get(name, 1e-5), f"{key}: relative weight difference {err:.2e}"


N, AFTER = 3, 6
CP_ZERO = ["parallel.cp=2", "parallel.dp=2", "parallel.zero1=true", "parallel.microbatches=1"]


@pytest.mark.slow
def test_cp_checkpoint_resumes_bitwise_and_loads_without_cp(corpus, tmp_path):
    """cp does not change parameter shapes: a cp=2 x dp=2 ZeRO-1 checkpoint (optimizer state sharded
    over the four dp x cp ranks) resumes bit for bit, and loads at cp=1 on one process with the losses
    of the run that never stopped (the data position and RNG resume exactly)."""
    items = BASE + ["checkpoint.async_save=false", f"train.steps={N + AFTER}"]
    straight = run_checkpointed(corpus, tmp_path / "a", items + CP_ZERO, 4, N + AFTER, save_at=N)
    resumed = run_checkpointed(corpus, tmp_path / "a", items + CP_ZERO + ["checkpoint.resume=auto"], 4, AFTER)
    for a, b in zip(straight, resumed, strict=True):
        assert b["start"] == N and b["losses"] == a["losses"][N:]
    ref, got = merged_weights(straight), merged_weights(resumed)
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    ckpt = tmp_path / "a" / "checkpoints" / f"step-{N:08d}"
    single = run_checkpointed(corpus, tmp_path / "b", items + ["parallel.microbatches=2", f"checkpoint.resume={ckpt}"],
                              1, AFTER)[0]
    assert single["start"] == N
    rel = max_relative(single["losses"], straight[0]["losses"][N:])
    assert rel <= 1e-5, f"relative loss difference {rel:.2e}"


@pytest.mark.slow
def test_packed_sft_rows_at_cp2_equal_one_process(tmp_path_factory, tmp_path):
    """Packed fine-tuning rows (several chat samples per row, document masks, restarting positions,
    loss on assistant tokens only) through the trainer at cp=2 equal one process over 6 steps: the
    documents cut by chunk and rank borders keep to themselves under the ring."""
    from chat_task import task_with_tokenizer

    root, paths = task_with_tokenizer(tmp_path_factory.mktemp("sft"), seed=3, train=120, heldout=10)
    items = ["data.format=sft", "train.objective=sft", f"data.tokenizer={root / 'tokenizer.json'}",
             "data.seq_len=256", "data.val_fraction=0.1", "model.hidden_size=64", "model.num_hidden_layers=2",
             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.intermediate_size=128",
             "model.max_position_embeddings=256", "precision.preset=fp32", "optimizer.lr=3e-3",
             "scheduler.warmup_steps=0", "train.steps=6", "logging.progress_bar=false", "parallel.tp=1",
             "parallel.sequence_parallel=false", "train.sample_tokens=0", "data.micro_batch_size=2",
             "parallel.microbatches=2"]
    single = run_recipe(paths["sft_train"], tmp_path / "one", items, 1, 6)[0]["losses"]
    assert single[-1] < single[0]
    for r in run_recipe(paths["sft_train"], tmp_path / "cp", items + ["parallel.cp=2"], 2, 6):
        rel = max_relative(r["losses"], single)
        assert rel <= 1e-5, f"relative loss difference {rel:.2e}\n{r['losses']}\n{single}"
