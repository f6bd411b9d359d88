"""Zero-bubble pipelines: deferred weight gradients (B/W split) and zb-h1 against 1F1B.

Unit level (one process, tp=1 groups): a backward run under ``WeightGradQueue.collect`` leaves the
column/row-parallel weights (and plain ``nn.Linear`` weights, switched to ``DeferrableLinear``)
without gradient and every other parameter with its usual one; the W
(``queue.run``) then produces exactly (bitwise) the gradients of an unsplit backward, through the
parameters' own accumulators (post-accumulate hooks fire in W, not in B).

Trainer level: ``parallel.schedule=zb-h1`` against ``1f1b`` over 20 steps on real text, fp32, the
same layout otherwise. Both accumulate each weight's microbatch gradients in the same order, so
losses and weights must agree to round-off (relative 1e-6 loss, 1e-5 weights).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from builders import build_llama_stages
from plait.comm.primitives import GroupInfo
from plait.config import RecipeError, check_recipe
from plait.data_parallel import DistributedOptimizer, OptimizerHyper
from plait.mesh import single_process_mesh
from plait.models.llama.config import LlamaConfig
from plait.pipeline.hooks import RuntimeHooks
from plait.pipeline.runtime import PipelineRuntime
from plait.precision import policy_for
from plait.tensor_parallel.attention import ParallelSelfAttention
from plait.tensor_parallel.heads import HeadLayout
from plait.tensor_parallel.linear import ColumnParallelLinear, DeferrableLinear, RowParallelLinear
from plait.tensor_parallel.mlp import ParallelGatedMLP
from plait.tensor_parallel.weight_grad import WeightGradQueue
from plait.tensor_parallel.weight_grad_attach import attach_weight_grad_queue
from test_pipeline_schedules import _parse
from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, weight_errors

SOLO = GroupInfo(None, 0, 1)


class _Block(nn.Module):
    """column -> norm -> row, plus a gated MLP: every deferrable path and a non-deferred parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(8, 12, SOLO, bias=True)
        self.norm = nn.LayerNorm(12)
        self.down = RowParallelLinear(12, 8, SOLO, bias=True)
        self.mlp = ParallelGatedMLP(8, 16, SOLO)
        self.plain = nn.Linear(8, 8)  # a model without TP keeps nn.Linear projections
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)

    def forward(self, x):
        h = self.down(self.norm(self.up(x)))
        return self.plain(self.mlp(h) + h)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_split_backward_gives_the_unsplit_gradients(autocast):
    torch.manual_seed(0)
    model = _Block()
    xs = [torch.randn(2, 5, 8, requires_grad=True) for _ in range(3)]

    def loss_of(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(x).float().square().mean()

    for x in xs:
        loss_of(x).backward()
    ref, ref_dx = _grads(model), [x.grad.clone() for x in xs]
    model.zero_grad(set_to_none=True)
    for x in xs:
        x.grad = None

    queue = WeightGradQueue()
    attached = attach_weight_grad_queue(model, queue)
    deferred = {id(p) for p in attached}
    assert deferred == {id(m.weight) for m in (model.up, model.down, model.mlp.gate_proj, model.mlp.up_proj,
                                               model.mlp.down_proj, model.plain)}
    assert isinstance(model.plain, DeferrableLinear)
    fired: list[str] = []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        # autograd also calls the hook of a weight that got no gradient (grad None): only count real ones
        p.register_post_accumulate_grad_hook(lambda p: fired.extend([names[id(p)]] if p.grad is not None else []))
    for i, x in enumerate(xs):  # B of every microbatch first, then the Ws (a zb-h1 rank's tail)
        fired.clear()
        with queue.collect(i):
            loss_of(x).backward()
        assert fired and not {names[d] for d in deferred} & set(fired), "B must not touch deferred weights"
        for n, p in model.named_parameters():
            assert (p.grad is None) == (id(p) in deferred), n
    assert sorted(queue.pending()) == [0, 1, 2]
    for i in range(3):
        fired.clear()
        queue.run(i)
        assert set(fired) == {names[d] for d in deferred}
    assert queue.pending() == []
    got = _grads(model)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    for x, dx in zip(xs, ref_dx, strict=True):
        assert torch.equal(x.grad, dx)


def test_queue_outside_collect_computes_in_backward_and_errors_are_clear():
    torch.manual_seed(0)
    model = _Block()
    queue = WeightGradQueue()
    attach_weight_grad_queue(model, queue)
    model(torch.randn(2, 3, 8)).sum().backward()  # not collecting: nothing deferred
    assert all(p.grad is not None for p in model.parameters()) and queue.pending() == []
    with pytest.raises(RuntimeError, match="no weight gradients deferred under 5"):
        queue.run(5)
    with queue.collect(0), pytest.raises(RuntimeError, match="do not nest"), queue.collect(1):
        pass
    with pytest.raises(RuntimeError, match="already deferred"), queue.collect(0):
        pass


def test_tied_and_frozen_weights_are_not_deferred():
    lin = ColumnParallelLinear(4, 6, SOLO)
    holder = nn.Module()
    holder.head, holder.embed = lin, nn.Embedding(6, 4)
    holder.embed.weight = lin.weight  # a weight used twice in the stage keeps its gradient in B
    assert attach_weight_grad_queue(holder, WeightGradQueue()) == []
    frozen = RowParallelLinear(4, 3, SOLO)
    nn.init.normal_(frozen.weight)
    frozen.weight.requires_grad_(False)
    queue = WeightGradQueue()
    attach_weight_grad_queue(frozen, queue)
    x = torch.randn(2, 4, requires_grad=True)
    with queue.collect(0):
        frozen(x).sum().backward()
    queue.run(0)  # nothing was queued for a weight that needs no gradient
    assert frozen.weight.grad is None and x.grad is not None


def test_attention_projections_are_attached():  # the fused q/k/v matmul and o_proj defer too
    layout = HeadLayout.plan(4, 2, 4, 1)
    attn = ParallelSelfAttention(16, layout, SOLO, SOLO, None)
    queue = WeightGradQueue()
    got = attach_weight_grad_queue(attn, queue)
    assert {id(p) for p in got} == {id(attn.q_proj.weight), id(attn.k_proj.weight), id(attn.v_proj.weight),
                                   id(attn.o_proj.weight)}


# ---- recipe rules -----------------------------------------------------------------------------

def test_recipe_accepts_zb_h1_and_names_the_field_when_it_cannot_run():
    ok = check_recipe(None, ["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=3",
                             "train.activation_checkpointing=full"], 2)
    assert ok.recipe.parallel.schedule == "zb-h1"
    with pytest.raises(RecipeError, match=r"parallel.schedule: 'zb-h1' .*vpp=2 needs an interleaved schedule"):
        check_recipe(None, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-h1",
                            "parallel.microbatches=2"], 4)
    ok = check_recipe(None, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-zb",
                             "parallel.microbatches=4"], 2)
    assert ok.recipe.parallel.schedule == "interleaved-zb"
    with pytest.raises(RecipeError, match=r"parallel.microbatches: 3 .*'interleaved-zb' needs microbatches divisible"):
        check_recipe(None, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved-zb",
                            "parallel.microbatches=3"], 2)
    with pytest.raises(RecipeError, match="parallel.schedule: 'zb-v'"):
        check_recipe(None, ["parallel.pp=2", "parallel.schedule=zb-v"], 2)


# ---- the runtime: W tasks after the last B, and the data-parallel "last gradient" marking ---------

def _runtime_and_optimizer(schedule: str, wire: str):
    """One pp=1 stage (2 layers) with its optimizer's GradSync wired as the trainer wires it."""

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    mesh = single_process_mesh()
    (stage,) = build_llama_stages(config, mesh, [[0, 1]], seed=0)
    # small buckets: several of them, some holding only B parameters, some only deferred weights
    opt = DistributedOptimizer([stage], policy_for("fp32"), OptimizerHyper(lr=1e-3, weight_decay=0.0,
                               betas=(0.9, 0.95), eps=1e-8), dp=SOLO, tp=SOLO, bucket_mb=0.01)
    hooks = RuntimeHooks()
    if wire == "modules":
        hooks = RuntimeHooks(before_last_backward=lambda chunk: opt.grads.mark_final([stage]))
    if wire == "params":
        hooks = RuntimeHooks(mark_final_params=opt.grads.mark_final_params)
    runtime = PipelineRuntime([stage], mesh, schedule=schedule, microbatches=3, micro_batch_size=2, seq_len=8,
                              hidden_size=32, sequence_parallel=False, dtype=torch.float32, hooks=hooks)
    return runtime, opt, stage


#: a late rank's tail: every B of the step, then the Ws (the Ws after the last B are what the
#: data-parallel marking must wait for)
LATE_TAIL = "F0 B0 F1 B1 F2 B2 W0 W1 W2 R"


@pytest.mark.parametrize("wire", ["params", "modules"])
def test_buckets_start_after_the_last_w(wire):
    batch = torch.randint(0, 64, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    ref, ref_opt, _ = _runtime_and_optimizer("1f1b", "modules")
    ref.run(batch)
    ref_opt.grads.finish()
    runtime, opt, _ = _runtime_and_optimizer("zb-h1", wire)
    runtime.use_tasks(_parse(LATE_TAIL))
    launched_at: list[int] = []
    launch = opt.grads._launch
    opt.grads._launch = lambda bucket: (launched_at.append(bucket.index), launch(bucket))[-1]
    runtime.run(batch)  # a gradient arriving after its bucket started would raise here
    started = set(launched_at)
    opt.grads.finish()
    assert torch.equal(opt.grads.data, ref_opt.grads.data), "zb-h1 must give 1F1B's gradients bit for bit"
    buckets = len(opt.grads.bucket_plan.buckets)
    assert buckets >= 3
    if wire == "modules":  # fallback: buckets with a B-only parameter wait for finish()
        assert started != set(range(buckets))
    else:  # every bucket started during the schedule (overlapped), none twice
        assert sorted(launched_at[:len(started)]) == list(range(buckets))


def test_marking_before_the_last_b_would_be_caught():
    # the negative control of the test above: marking every parameter before the last B (1F1B's
    # timing) makes a deferred weight's W after it arrive at a started bucket, which GradSync refuses
    runtime, opt, stage = _runtime_and_optimizer("zb-h1", "none")
    runtime.use_tasks(_parse(LATE_TAIL))
    original = runtime._before_last
    runtime._before_last = lambda chunk, weights: opt.grads.mark_final([stage]) if not weights else None
    batch = torch.randint(0, 64, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="arrived after its bucket was reduced"):
        runtime.run(batch)
    assert original is not None


# ---- zb-h1 against 1F1B through the trainer ----------------------------------------------------

STEPS = 20
BASE = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "data.vocab_size=320", "data.seq_len=32", "data.micro_batch_size=2",
        "parallel.microbatches=4", "parallel.sequence_parallel=false", "optimizer.grad_clip=1.0",
        "scheduler.warmup_steps=2", "optimizer.lr=3e-3", "parallel.tp=1", "logging.progress_bar=false",
        "logging.tensorboard=false", "model.tie_word_embeddings=false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_dir(tmp_path_factory)


#: every layout trains twice for 20 steps (~35 s on 2 cores even at PP=2): all in `make test-slow`;
#: the default suite has the unit tests above and the schedules' tests (tests/test_pipeline_schedules.py)
LAYOUTS = {
    "pp2": pytest.param((["parallel.pp=2", "model.num_hidden_layers=4"], 2), marks=pytest.mark.slow),
    "pp4": pytest.param((["parallel.pp=4", "model.num_hidden_layers=4", "parallel.microbatches=8"], 4),
                        marks=pytest.mark.slow),
    "pp2xtp2-sp": pytest.param((["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "model.num_hidden_layers=4"], 4), marks=pytest.mark.slow),
    "pp2xdp2-zero1": pytest.param((["parallel.pp=2", "parallel.zero1=true", "model.num_hidden_layers=4",
                                    "data.global_batch_size=16"], 4), marks=pytest.mark.slow),
    "pp2-ckpt-tied": pytest.param((["parallel.pp=2", "model.num_hidden_layers=4", "model.tie_word_embeddings=true",
                                    "train.activation_checkpointing=full"], 2), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=getattr(v, "marks", ())) for n, v in LAYOUTS.items()])
def test_zb_h1_matches_1f1b(corpus, tmp_path, name):
    case = LAYOUTS[name]
    overrides, world = case.values[0] if hasattr(case, "values") else case
    _assert_same_training(corpus, tmp_path, overrides, world, "1f1b", "zb-h1")


def _assert_same_training(corpus, tmp_path, overrides: list[str], world: int, reference: str, split: str) -> None:
    """20 steps of schedule ``split`` equal those of ``reference`` (same chunks, same accumulation order)."""
    ref = run_recipe(corpus, tmp_path / reference, BASE + overrides + [f"parallel.schedule={reference}"], world,
                     STEPS)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0] - 0.3, "the reference must learn"
    got = run_recipe(corpus, tmp_path / split, BASE + overrides + [f"parallel.schedule={split}"], world, STEPS)
    for rank, (g, r) in enumerate(zip(got, ref, strict=True)):
        rel = max_relative(g["losses"], r["losses"])
        assert rel <= 1e-6, f"rank {rank}: relative loss difference {rel:.2e}\n{g['losses']}\n{r['losses']}"
    for key, err in weight_errors(merged_weights(got), merged_weights(ref)).items():
        assert err <= 1e-5, f"{key}: relative weight difference {err:.2e}"


#: interleaved-zb against interleaved 1F1B (same chunks, same accumulation order), 20 steps each
INTERLEAVED = {
    "pp2-vpp2": (["parallel.pp=2", "parallel.vpp=2", "model.num_hidden_layers=4"], 2),
    "pp2-vpp2xdp2-zero1": (["parallel.pp=2", "parallel.vpp=2", "parallel.zero1=true", "model.num_hidden_layers=4",
                            "data.global_batch_size=16"], 4),
    "pp4-vpp2": (["parallel.pp=4", "parallel.vpp=2", "model.num_hidden_layers=8", "parallel.microbatches=8"], 4),
}


@pytest.mark.slow  # two 20-step runs per layout
@pytest.mark.parametrize("name", list(INTERLEAVED))
def test_interleaved_zb_matches_interleaved_1f1b(corpus, tmp_path, name):
    overrides, world = INTERLEAVED[name]
    _assert_same_training(corpus, tmp_path, overrides, world, "interleaved-1f1b", "interleaved-zb")
