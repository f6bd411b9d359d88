"""Data-parallel (DP=2) training step time: plait vs PyTorch DDP, and plait ZeRO-1 vs ZeroRedundancyOptimizer.

What is measured: wall time of a full fp32 training step (forward with the mean next-token loss,
backward with the data-parallel gradient reduction, global gradient-norm clipping at 1.0, AdamW
update) on 2 gloo ranks on the CPU, one intra-op thread per rank, for

* **plait DP**: :class:`plait.data_parallel.optimizer.DistributedOptimizer` (flat parameter and
  gradient buffers, 25 MB buckets all-reduced asynchronously during backward, fused AdamW) driven
  by :func:`plait.train.step.train_step` over a one-stage runtime, exactly as the trainer does;
* **plait ZeRO-1**: the same with ``zero=True`` (AdamW state for the owned half only), with the
  collectives plait picks for the backend (:mod:`plait.data_parallel.collectives`): on gloo each
  bucket is all-reduced in place during backward and each owner broadcasts its updated shard,
  bucket by bucket as the update proceeds;
* **plait ZeRO-1, prefetch** (unless ``--skip-prefetch``): the same with ``prefetch_params=True``:
  the broadcasts are left in flight after the step and each module's forward waits for its own
  buckets (overlap with the next forward);
* **plait ZeRO-1, reduce-scatter + all-gather** (unless ``--skip-rs-ag``): forced to the
  collectives plait uses on NCCL (reduce-scatter into a shard buffer, all-gather of the updated
  shards): on gloo this is how plait ran before the per-backend choice;
* **plait DP, overlap off** (unless ``--skip-no-overlap``): ``overlap=False``, every reduction
  starts after backward (``parallel.overlap_grad_reduce: false``);
* **DDP**: ``torch.nn.parallel.DistributedDataParallel`` (default 25 MB buckets, its own
  overlap with backward) + ``torch.optim.AdamW(fused=True)`` + ``clip_grad_norm_``;
* **DDP + ZeroRedundancyOptimizer**: the same DDP model with
  ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW,
  fused=True)`` (parameters assigned whole to ranks; owners broadcast their updated
  parameters after the step).

Same model on every side: plait's Llama built unsharded on every rank by
:func:`plait.materialize.build_model` (``tp = 1``) with the same seed, so all start from the same
weights; each rank trains on its own fixed random batch, the same for every implementation.
AdamW: lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay (plait exempts norms from decay
and the peers would not; with none, the update is identical). The script prints the first-step
loss of each implementation (averaged over the ranks; they must agree) and the loss after the
last step (same number of steps on every side, so the trajectories should agree closely).

Method: after ``--warmup`` untimed steps each, the implementations take turns for ``--rounds``
rounds (the order rotates every round); each turn times ``--steps`` consecutive steps after a
barrier, and a turn's time is the slower rank's. Reported: median ms/step over rounds, CPU
ms/step summed over both ranks, and the ratio of medians written **plait/peer as a speed ratio,
peer ms / plait ms (> 1 means plait is faster)**; "paired" is the median of per-round ratios.
Last, each gloo collective the implementations use is timed alone on one fp32 buffer the
size of the model (all-reduce, reduce-scatter, all-gather, broadcast from one rank, one
broadcast per owner; median of 5): what a step's data-parallel communication costs here, and
why plait picks all-reduce + per-owner broadcasts for ZeRO-1 on gloo.
Optimizer-state bytes per rank: plait's ``memory_report()`` (``exp_avg`` + ``exp_avg_sq`` of the
owned elements; the master column is plait's separate fp32 master shard, which ZeRO-1 keeps
for every preset), the tensors of ``ZeroRedundancyOptimizer``'s local optimizer, and the full
AdamW state for DDP.

Run (from the repository root, venv active)::

    python bench/bench_dp.py                          # spawns the 2 ranks itself
    python bench/bench_dp.py --smoke                  # tiny end-to-end check
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/bench_dp.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    Result,
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
from plait.materialize import build_model  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402

DP = 2
LR, BETAS, EPS, CLIP = 1e-4, (0.9, 0.999), 1e-8, 1.0
MiB = 1024**2


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensor states (not the scalar step counters) of a torch optimizer."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def plait_side(config, mesh: ParallelMesh, seed: int, *, zero: bool, overlap: bool, collectives=None,
               prefetch: bool = False):
    """(step, optimizer-state bytes fn, master bytes fn) of plait's DP / ZeRO-1 path; ``collectives``
    forces ZeRO-1's strategy (default: plait's choice for the backend)."""
    from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
    from plait.materialize import build_stages
    from plait.precision import policy_for
    from plait.train.build_run import build_runtime
    from plait.train.step import train_step

    policy = policy_for("fp32")
    stages = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=seed)  # what the trainer runs
    opt = DistributedOptimizer(stages, policy, OptimizerHyper(lr=LR, weight_decay=0.0, betas=BETAS, eps=EPS),
                               dp=mesh.info("dp"), tp=mesh.info("tp"), zero=zero, bucket_mb=25.0, overlap=overlap,
                               collectives=collectives, prefetch_params=prefetch)
    runtimes: dict[tuple[int, int], object] = {}

    def run(ids: torch.Tensor) -> torch.Tensor:
        key = tuple(ids.shape)
        if key not in runtimes:
            runtimes[key] = build_runtime(stages, mesh, policy, opt, schedule="1f1b", microbatches=1,
                                          micro_batch_size=ids.shape[0], seq_len=ids.shape[1],
                                          sequence_parallel=False)
        loss, _ = train_step(runtimes[key], opt, ids[None], grad_clip=CLIP)
        return loss

    return run, lambda: opt.memory_report()["optimizer_state_bytes"], lambda: opt.memory_report()["master_bytes"]


def torch_side(config, mesh: ParallelMesh, seed: int, *, zero: bool):
    """(step, optimizer-state bytes fn, master bytes fn) of DDP + AdamW or DDP + ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(config, mesh, seed=seed).train()
    ddp = DistributedDataParallel(model)  # default bucket_cap_mb=25, like plait's parallel.bucket_mb
    params = list(ddp.parameters())
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    if zero:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
        states = lambda: state_bytes(opt.optim)  # noqa: E731 - the local (owned) partition's optimizer
    else:
        opt = torch.optim.AdamW(params, **kw)
        states = lambda: state_bytes(opt)  # noqa: E731

    def run(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = ddp(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        return loss.detach()

    return run, states, lambda: 0


def time_collectives(numel: int, repeats: int = 5) -> list[list[str]]:
    """Median wall time of each gloo collective the implementations use, on one fp32 buffer of
    ``numel`` elements (the whole model): what a step's data-parallel communication costs here."""
    world = dist.get_world_size()
    full = torch.randn(numel - numel % world)
    shard = torch.empty(full.numel() // world)
    gathered = torch.empty_like(full)
    ops = {
        "all-reduce (plait DP, DDP; plait ZeRO-1 on gloo, in place)": lambda: dist.all_reduce(full),
        "reduce-scatter (plait ZeRO-1 on NCCL)": lambda: dist.reduce_scatter_tensor(shard, full),
        "all-gather (plait ZeRO-1 on NCCL)": lambda: dist.all_gather_into_tensor(gathered, shard),
        "broadcast from one rank (ZeroRedundancyOptimizer's parameter sync, all owners together)":
            lambda: dist.broadcast(full, 0),
        "one broadcast per owner of its 1/n, in place (plait ZeRO-1 on gloo)": lambda: [
            w.wait() for w in [dist.broadcast(c, r, async_op=True) for r, c in enumerate(full.chunk(world))]],
    }
    rows = []
    for name, op in ops.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        rows.append([name, f"{full.numel() * 4 / MiB:.1f}", f"{1e3 * statistics.median(times):.1f}"])
    return rows


def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    config = make_config(args)
    ids = random_batch(config, args.batch, args.seq, args.seed + 1000 * rank)  # each rank its own batch
    log = print if rank == 0 else (lambda *a, **k: None)
    log(describe(config, args) + f" per rank; DP={world} gloo ranks x 1 thread; fp32; AdamW fused, lr {LR}, "
        f"no weight decay, grad clip {CLIP}", flush=True)
    mesh = ParallelMesh(world, rank, dp=world)

    sides: dict[str, tuple[Callable, Callable, Callable]] = {
        "plait DP": plait_side(config, mesh, args.seed, zero=False, overlap=True),
        "DDP": torch_side(config, mesh, args.seed, zero=False),
        "plait ZeRO-1": plait_side(config, mesh, args.seed, zero=True, overlap=True),
        "DDP + ZeroRedundancyOptimizer": torch_side(config, mesh, args.seed, zero=True),
    }
    if not args.skip_prefetch:
        sides["plait ZeRO-1, prefetch"] = plait_side(config, mesh, args.seed, zero=True, overlap=True, prefetch=True)
    if not args.skip_rs_ag:
        from plait.data_parallel.collectives import ShardCollectives

        sides["plait ZeRO-1, reduce-scatter + all-gather"] = plait_side(config, mesh, args.seed, zero=True,
                                                                       overlap=True, collectives=ShardCollectives())
    if not args.skip_no_overlap:
        sides["plait DP, overlap off"] = plait_side(config, mesh, args.seed, zero=False, overlap=False)
    from plait.data_parallel.collectives import collectives_for

    chosen = collectives_for(mesh.info("dp"))
    log(f"plait ZeRO-1 on {dist.get_backend()}: {type(chosen).__name__} (gradients: "
        f"{'all-reduce in place' if chosen.reduces_in_place else 'reduce-scatter'}; parameters: "
        f"{'one broadcast per owner' if chosen.reduces_in_place else 'all-gather'})", flush=True)
    results = {name: Result(name) for name in sides}
    for name, (run, _, _) in sides.items():
        results[name].first_loss = mean_over_ranks(run(ids))
        for _ in range(args.warmup - 1):
            run(ids)
    log("first-step loss (mean over ranks): " + "  ".join(f"{n} {r.first_loss:.6f}" for n, r in results.items()),
        flush=True)

    tokens = args.steps * args.batch * args.seq * world  # global tokens per turn
    order = list(sides)
    for r in range(args.rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            run = sides[name][0]
            dist.barrier()
            wall, cpu = time_steps(lambda run=run: run(ids), args.steps)
            stats = torch.tensor([wall, cpu], dtype=torch.float64)
            slowest = stats.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)  # sum: CPU time of both ranks
            results[name].add(tokens, args.steps, slowest[0].item(), stats[1].item())
        log(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{n} {1e3 * tokens / res.tokens_per_s[-1] / args.steps:.0f} ms" for n, res in results.items()), flush=True)

    last = {name: mean_over_ranks(run(ids)) for name, (run, _, _) in sides.items()}
    n_steps = args.warmup + args.rounds * args.steps + 1
    log(f"loss at step {n_steps} (mean over ranks): " + "  ".join(f"{n} {v:.6f}" for n, v in last.items()),
        flush=True)

    # optimizer-state bytes per rank (every rank reports; rank 0 prints the max over ranks)
    states = {}
    for name, (_, state_fn, master_fn) in sides.items():
        t = torch.tensor([state_fn(), master_fn()], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        states[name] = (int(t[0].item()), int(t[1].item()))
    n_params = sum(p.numel() for p in build_model(config, mesh, seed=args.seed, device="meta", init=False).parameters())
    log(f"\nparameters: {n_params:,} ({n_params * 4 / MiB:.1f} MiB fp32); full AdamW state "
        f"{2 * n_params * 4 / MiB:.1f} MiB\n")

    tokens_per_step = args.batch * args.seq * world
    rows = []
    for name, res in results.items():
        ms = statistics.median(1e3 * tokens_per_step / t for t in res.tokens_per_s)
        st, master = states[name]
        rows.append([name, f"{ms:.0f}", f"{res.median_cpu_ms:.0f}",
                     f"{1e3 * tokens_per_step / max(res.tokens_per_s):.0f}-"
                     f"{1e3 * tokens_per_step / min(res.tokens_per_s):.0f}",
                     f"{st / MiB:.1f}", f"{master / MiB:.1f}", f"{res.first_loss:.6f}", f"{last[name]:.6f}"])
    log(markdown_table(["implementation", "median ms/step", "CPU ms/step (2 ranks)", "ms/step range",
                        "optimizer state MiB/rank", "separate master MiB/rank", "first loss",
                        f"loss at step {n_steps}"], rows))
    pairs = [("plait DP", "DDP"), ("plait ZeRO-1", "DDP + ZeroRedundancyOptimizer")]
    if not args.skip_no_overlap:
        pairs.append(("plait DP, overlap off", "DDP"))
    if not args.skip_prefetch:
        pairs.append(("plait ZeRO-1, prefetch", "DDP + ZeroRedundancyOptimizer"))
    if not args.skip_rs_ag:
        pairs.append(("plait ZeRO-1, reduce-scatter + all-gather", "DDP + ZeroRedundancyOptimizer"))
    log()
    for ours, theirs in pairs:
        log(markdown_table(comparison_header(f"{ours} vs {theirs}", "peer"),
                           [["fp32"] + comparison_row(results[ours], results[theirs], tokens_per_step)]))
        log()
    log("(tok/s are global: both ranks' tokens; plait/peer = peer ms / plait ms, > 1 means plait is faster; "
        "'paired' is the median of the per-round ratios, the figure least disturbed by other load; "
        "goal of issue 15: >= 1.05 for plait DP vs DDP and plait ZeRO-1 vs DDP + ZeroRedundancyOptimizer)", flush=True)
    if not args.skip_collectives:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the *_tensor names are deprecated aliases
            rows = time_collectives(n_params)
        log()
        log(markdown_table(["gloo collective, 2 ranks", "buffer MiB", "median ms (of 5)"], rows), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--skip-no-overlap", action="store_true",
                        help="leave out the plait DP run with overlap_grad_reduce=false")
    parser.add_argument("--skip-prefetch", action="store_true",
                        help="leave out plait ZeRO-1 with prefetch_params=True (parameter gathers left in flight, "
                             "awaited per module by the next forward)")
    parser.add_argument("--skip-rs-ag", action="store_true",
                        help="leave out plait ZeRO-1 forced to reduce-scatter + all-gather (NCCL's collectives; "
                             "on gloo plait all-reduces in place and broadcasts per owner instead)")
    parser.add_argument("--skip-collectives", action="store_true",
                        help="leave out the timing of each gloo collective on a model-sized buffer")
    args = resolve_args(parser.parse_args(argv))
    if args.foreach:
        parser.error("--foreach does not apply: every side uses the fused AdamW")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world != DP:
            raise SystemExit(f"run with exactly {DP} ranks (got WORLD_SIZE={world})")
        gloo_rank_entry(int(os.environ["RANK"]), world, None, worker, (args,))
    spawn_gloo_ranks(DP, worker, (args,))


if __name__ == "__main__":
    main()
