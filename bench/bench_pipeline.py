"""Pipeline-parallel (PP=2, 1F1B) training throughput: plait vs ``torch.distributed.pipelining``.

What is measured: wall time of a full fp32 training step (``zero_grad``, one 1F1B pipeline
schedule over ``--microbatches`` micro-batches with the mean next-token loss, ``torch.optim.AdamW``
step; the optimizer step **is included** on both sides) on 2 gloo ranks on the CPU, one intra-op
thread per rank, for

* **plait**: :func:`plait.materialize.build_stages` on ``ParallelMesh(2, rank, pp=2)`` driven by
  :class:`plait.pipeline.runtime.PipelineRuntime` with ``schedule="1f1b"`` (``--schedule zb-h1``: the
  zero-bubble schedule, B and W split; ``--schedule interleaved-zb``: that split over ``--vpp`` chunks
  per rank; the torch side stays ``Schedule1F1B``, what a user would run);
* **torch.pipelining**: ``torch.distributed.pipelining.PipelineStage`` + ``Schedule1F1B`` around
  :class:`TorchStageModule`, a thin module that runs *the same* plait ``LlamaStage`` (same layers,
  same weights: built by the same ``build_stages`` call) with the signature pipelining wants
  (one tensor in, one tensor out). The last stage returns logits and ``loss_fn`` is plait's own
  ``CausalLMOutput`` (label-shifting mean cross-entropy); ``scale_grads=True`` divides the
  gradients by the number of micro-batches, as plait does by dividing each micro-batch loss.
  ``return_outputs=False``, so the last stage does not concatenate the logits of all micro-batches.

Both sides split the model at the same decoder-layer boundary (``--split``: ``balanced`` by FLOPs,
plait's default, or ``even`` by layer count; the embedding is on stage 0, the final norm, head and
loss on stage 1), use the same micro-batches (the same fixed random batch every step) and
identically configured AdamW. The first-step losses of both (and of the unsplit single-process
model) are printed and must agree, as must the losses after the last step. After ``--warmup``
untimed steps each, the implementations alternate (the one going first alternates too) for
``--rounds`` rounds of ``--steps`` steps; a round's time is the slowest rank's (a barrier precedes
each run). Table: medians over rounds, the plait/torch ratio (> 1: plait faster), CPU time per
step summed over both ranks, per-round range.

``--compare-receives`` adds a third contestant, **plait blocking**: the same runtime with receives
waited on where the task list has them (``prepost_receives = 0``) and a fresh buffer per receive
(``reuse_receive_buffers = False``), i.e. the runtime before pre-posting and pooling; its rows
give the before/after of those two changes in one interleaved run. ``--profile`` instead profiles
one step of each side per rank (torch profiler: top operators, point-to-point calls) and stops.

The output starts with the commit, the CPU (and whether it has native bf16) and the load average,
and ends with one verdict line per ratio. The load average is read again at the end: on a machine
busier than its core count the wall-time ratios mostly measure the other load (compare the
paired ratio and the CPU ms/step columns, and re-run on a quiet machine).

Run (from the repository root, venv active)::

    python bench/bench_pipeline.py                 # spawns the 2 ranks itself
    python bench/bench_pipeline.py --smoke         # tiny end-to-end check
    python bench/bench_pipeline.py --schedule zb-h1
    python bench/bench_pipeline.py --schedule interleaved-zb   # 2 chunks per rank
    python bench/bench_pipeline.py --compare-receives   # + plait with blocking receives, fresh buffers
    python bench/bench_pipeline.py --profile            # where one step's time goes, per rank
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    Result,
    adamw,
    add_model_args,
    comparison_header,
    comparison_row,
    describe,
    gloo_rank_entry,
    make_config,
    markdown_table,
    random_batch,
    resolve_args,
    spawn_gloo_ranks,
    time_steps,
)
from plait.materialize import build_model, build_stages  # noqa: E402
from plait.mesh import ParallelMesh, single_process_mesh  # noqa: E402
from plait.pipeline.runtime import PipelineRuntime  # noqa: E402
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES  # noqa: E402
from plait.plan.pipeline_split import plan_partition  # noqa: E402

PP = 2
#: Pipeline-specific defaults (the model size is ``_common.DEFAULTS``).
PP_DEFAULTS = dict(microbatches=8, micro_batch_size=1, rounds=5, steps=2, warmup=2)
PP_SMOKE = dict(microbatches=4, micro_batch_size=1, rounds=2, steps=1, warmup=1)
#: the issue's goal for the plait/torch wall-time ratio at PP=2
GOAL = 1.15


def environment() -> str:
    """Commit (``+dirty`` with uncommitted changes under src/ or bench/), CPU, bf16 support, load."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = (git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if git("status", "--porcelain", "src",
                                                                                   "bench") else "")
    cpu, bf16 = "unknown CPU", False
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        bf16 = "avx512_bf16" in info
    except OSError:
        pass
    return (f"commit {commit}; {cpu}, {os.cpu_count()} cores, native bf16 (avx512_bf16) {'yes' if bf16 else 'no'}; "
            f"{_load()}")


def _busy() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def _load() -> str:
    one, five, _ = os.getloadavg()
    busy = _busy()
    return (f"load average {one:.1f} (1 min) / {five:.1f} (5 min)"
            + (" -- BUSY machine: more runnable work than cores, wall times are unreliable" if busy else ""))


class TorchStageModule(nn.Module):
    """A plait ``LlamaStage`` with the one-tensor signature ``torch.distributed.pipelining`` wants.

    Runs exactly ``LlamaStage.forward`` except the loss: the last stage returns logits, and the
    schedule's ``loss_fn`` (:meth:`loss`) applies the stage's own ``CausalLMOutput``.
    """

    def __init__(self, stage: nn.Module, seq_len: int) -> None:
        super().__init__()
        self.stage, self.seq_len = stage, seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        h = s.model.embed_tokens(x) if s.first else x
        cos, sin = s.model.rotary_emb(h, self.seq_len)
        for layer in s.model.layers.values():
            h = layer(h, cos, sin)
        if not s.last:
            return h
        return s.lm_head(s.model.norm(h))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.stage.output(logits, labels)


def _step_fn(run: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = run()
        opt.step()
        return loss

    return step


def _last_stage_loss(loss: torch.Tensor | float) -> float:
    """The loss (held by the last rank, zero elsewhere) on every rank."""
    t = torch.tensor(float(loss), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(args.seed)
    config = make_config(args)
    m, mbs, seq = args.microbatches, args.micro_batch_size, args.seq
    ids = random_batch(config, m * mbs, seq, args.seed)  # [m * mbs, seq]
    batch = ids.view(m, mbs, seq)
    layers = plan_partition(config, PP, seq, method=args.split, cost="flops").stage_layers()
    vpp = args.vpp if args.schedule in INTERLEAVED_SCHEDULES else 1  # plait's chunks per rank (torch: one stage)
    plait_layers = layers if vpp == 1 else plan_partition(config, PP * vpp, seq, method=args.split,
                                                          cost="flops").stage_layers()
    log = print if rank == 0 else (lambda *a, **k: None)
    log(environment(), flush=True)
    busy_at_start = _busy()
    log(describe(config, args) + f"; PP={world} gloo ranks x 1 thread, plait {args.schedule} vs torch 1F1B, "
        f"{m} micro-batches of {mbs} x {seq}; "
        f"split {args.split}: stage layers {layers} (plait: {plait_layers}); "
        f"AdamW {'foreach' if args.foreach else 'for-loop'} "
        f"step included", flush=True)

    ref_loss = float("nan")
    if rank == 0:  # unsplit single-process model, same init: mean loss over the micro-batches
        reference = build_model(config, single_process_mesh(), seed=args.seed)
        with torch.no_grad():
            ref_loss = statistics.fmean(reference(batch[i], batch[i]).item() for i in range(m))
        del reference

    # plait: the pipeline runtime over this rank's stage.
    mesh = ParallelMesh(world, rank, pp=world)
    plait_stages = build_stages(config, mesh, plait_layers, seed=args.seed)
    for s in plait_stages:
        s.train()
    runtime = PipelineRuntime(plait_stages, mesh, schedule=args.schedule, microbatches=m, micro_batch_size=mbs,
                              seq_len=seq, hidden_size=config.hidden_size, sequence_parallel=False,
                              dtype=torch.float32)
    plait_opt = adamw([[p for s in plait_stages for p in s.parameters()]], args.foreach)
    runs = {"plait": (_step_fn(lambda: runtime.run(batch, train=True), plait_opt), Result("plait"))}
    if args.compare_receives:  # the same runtime with blocking receives into fresh buffers
        blocking_stages = build_stages(config, mesh, plait_layers, seed=args.seed)
        for s in blocking_stages:
            s.train()
        blocking = PipelineRuntime(blocking_stages, mesh, schedule=args.schedule, microbatches=m,
                                   micro_batch_size=mbs, seq_len=seq, hidden_size=config.hidden_size,
                                   sequence_parallel=False, dtype=torch.float32)
        blocking.prepost_receives, blocking.reuse_receive_buffers = 0, False
        blocking_opt = adamw([[p for s in blocking_stages for p in s.parameters()]], args.foreach)
        runs["plait blocking"] = (_step_fn(lambda: blocking.run(batch, train=True), blocking_opt),
                                  Result("plait blocking"))

    # torch.distributed.pipelining: the same stage (a second copy, same weights), 1F1B.
    (torch_inner,) = build_stages(config, mesh, layers, seed=args.seed)
    torch_module = TorchStageModule(torch_inner, seq).train()
    pipe_stage = PipelineStage(torch_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(pipe_stage, m, loss_fn=torch_module.loss)
    torch_opt = adamw([list(torch_module.parameters())], args.foreach)
    last = rank == world - 1

    def torch_run() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids, return_outputs=False)
        else:
            schedule.step(target=ids, losses=losses, return_outputs=False)
        return torch.stack(losses).mean().detach() if last else torch.zeros(())

    runs["torch.pipelining"] = (_step_fn(torch_run, torch_opt), Result("torch.pipelining"))
    for step, result in runs.values():
        result.first_loss = _last_stage_loss(step())
        for _ in range(args.warmup - 1):
            step()
    first = {n: res.first_loss for n, (_, res) in runs.items()}
    log(f"first-step loss (mean over micro-batches): plait PP {first['plait']:.6f}  torch.pipelining PP "
        f"{first['torch.pipelining']:.6f}  (unsplit reference {ref_loss:.6f}); |diff| "
        f"{abs(first['plait'] - first['torch.pipelining']):.2e}", flush=True)

    if args.profile:
        for name, (step, _) in runs.items():
            _profile_step(name, step, rank, world)
        return

    tokens = args.steps * m * mbs * seq
    order = list(runs)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            step, result = runs[name]
            dist.barrier()
            wall, cpu = time_steps(step, args.steps)
            stats = torch.tensor([wall, cpu], dtype=torch.float64)
            slowest = stats.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)  # sum: CPU time of both ranks
            result.add(tokens, args.steps, slowest[0].item(), stats[1].item())
        log(f"round {r + 1}/{args.rounds}: "
            + "  ".join(f"{n} {1e3 * m * mbs * seq / res.tokens_per_s[-1]:.0f} ms/step"
                        for n, (_, res) in runs.items()), flush=True)

    final = {n: _last_stage_loss(step()) for n, (step, _) in runs.items()}
    log(f"loss after {args.warmup + args.rounds * args.steps + 1} steps: "
        + "  ".join(f"{n} PP {v:.6f}" for n, v in final.items()), flush=True)
    log()
    torch_result = runs["torch.pipelining"][1]
    rows = [[f"{n} {args.schedule}, m={m} x {mbs}x{seq}"] + comparison_row(res, torch_result, m * mbs * seq)
            for n, (_, res) in runs.items() if n != "torch.pipelining"]
    log(markdown_table(comparison_header(f"PP=2 plait vs torch 1F1B, fp32 ({args.schedule})", "torch"), rows),
        flush=True)
    log()
    log(f"after the run: {_load()}")
    busy = busy_at_start or _busy()

    def judged(met: bool) -> str:
        return "not judged, the machine was busy" if busy else "met" if met else "not met"

    for n, (_, res) in runs.items():
        if n == "torch.pipelining":
            continue
        ratio = res.median / torch_result.median
        log(f"verdict: {n} ({args.schedule}) / torch.pipelining Schedule1F1B, wall-time ratio {ratio:.3f} "
            f"(> 1: plait faster; goal >= {GOAL}: {judged(ratio >= GOAL)}); CPU time per step "
            f"{res.median_cpu_ms / torch_result.median_cpu_ms:.3f} of torch's", flush=True)
    if "plait blocking" in runs:
        ours, before = runs["plait"][1], runs["plait blocking"][1]
        paired = statistics.median(a / b for a, b in zip(ours.tokens_per_s, before.tokens_per_s, strict=True))
        log(f"verdict: pre-posted receives + pooled buffers vs blocking receives + fresh buffers: "
            f"{ours.median / before.median:.3f} (paired {paired:.3f}; > 1: faster with them)", flush=True)


def _profile_step(name: str, step: Callable[[], torch.Tensor], rank: int, world: int) -> None:
    """One step of ``name`` under the torch profiler on every rank; the ranks print in turn: where
    the step's wall time goes (top operators by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    dist.barrier()
    for r in range(world):
        if r == rank:
            print(f"\n== {name}, rank {rank}: one step, operators by self CPU time ==", flush=True)
            averages = prof.key_averages()
            print(averages.table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
            p2p = [e for e in averages if e.key.startswith(("c10d::", "gloo:", "nccl:"))]
            print("point-to-point operators (calls, self CPU ms): " + ", ".join(
                f"{e.key} {e.count} {e.self_cpu_time_total / 1e3:.1f}" for e in p2p), flush=True)
        dist.barrier()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    p = parser.add_argument_group("pipeline")
    p.add_argument("--microbatches", type=int, help=f"micro-batches per step (default {PP_DEFAULTS['microbatches']})")
    p.add_argument("--micro-batch-size", type=int,
                   help=f"sequences per micro-batch (default {PP_DEFAULTS['micro_batch_size']})")
    p.add_argument("--split", choices=("balanced", "even"), default="balanced",
                   help="layer split: plait's FLOP-balanced partition (default) or even by layer count")
    p.add_argument("--schedule", choices=("1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb"), default="1f1b",
                   help="plait's schedule (torch.distributed.pipelining runs Schedule1F1B either way)")
    p.add_argument("--vpp", type=int, default=2, help="chunks per rank of plait's interleaved schedules (default 2)")
    p.add_argument("--compare-receives", action="store_true",
                   help="also run plait with blocking receives into fresh buffers (the runtime before pre-posting)")
    p.add_argument("--profile", action="store_true",
                   help="after the warm-up, profile one step of each side (torch profiler, per rank) and stop")
    args = parser.parse_args(argv)
    if args.batch is not None:
        parser.error("--batch does not apply here: use --microbatches and --micro-batch-size")
    base = PP_SMOKE if args.smoke else PP_DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args = resolve_args(args)
    args.batch = args.microbatches * args.micro_batch_size  # for describe(): sequences per step
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world != PP:
            raise SystemExit(f"run with exactly {PP} ranks (got WORLD_SIZE={world})")
        gloo_rank_entry(int(os.environ["RANK"]), world, None, worker, (args,))
    spawn_gloo_ranks(PP, worker, (args,))


if __name__ == "__main__":
    main()
