"""Fully sharded data parallelism: plait ZeRO-3 vs PyTorch FSDP2, plait ZeRO-2 vs DDP + ZeroRedundancyOptimizer.

What is measured, on ``--ranks`` gloo ranks (2 and 4 in the recorded tables) on the CPU, one
intra-op thread per rank, fp32, for a full training step (forward with the mean next-token loss,
backward with the data-parallel reduction, gradient-norm clipping at 1.0, AdamW):

* **plait ZeRO-3**: :class:`plait.data_parallel.optimizer.DistributedOptimizer` with ``zero=3``
  driven by :func:`plait.train.step.train_step`, as the trainer runs it: each decoder block's
  weights gathered before its forward and again before its backward (reshard after forward), the
  next block prefetched, gradients reduce-scattered per bucket during backward, fused AdamW on
  the owned chunks;
* **FSDP2**: ``torch.distributed.fsdp.fully_shard`` on every decoder block and on the model
  (``reshard_after_forward=True``) over a 1-D CPU device mesh, ``torch.optim.AdamW`` over the
  sharded DTensor parameters and ``torch.nn.utils.clip_grad_norm_``;
* **plait ZeRO-2**: the same optimizer with ``zero=2`` (whole weights, gradients and optimizer
  state sharded);
* **DDP + ZeroRedundancyOptimizer**: the peer of ``bench/bench_dp.py``.

Same model on every side (plait's Llama, built unsharded with the same seed); each rank trains on
its own fixed random batch. Timing: after ``--warmup`` steps each, the sides take turns for
``--rounds`` rounds (order rotating), each turn timing ``--steps`` steps after a barrier; a turn's
time is the slowest rank's. Ratios are **peer ms / plait ms (> 1: plait faster)**.

Peak memory per rank: each side is also run alone in a fresh group of processes (so that one
side's freed memory cannot hide another's peak): the process's peak resident set
(``ru_maxrss``) after ``--warmup`` steps minus its resident set just before the model was built,
the largest over ranks. That includes the gathered blocks, gradients, optimizer state and
activations of the side, on the same footing for both; glibc is told to map every tensor above
64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set.

Run (from the repository root, venv active)::

    python bench/bench_fsdp.py --ranks 2
    python bench/bench_fsdp.py --ranks 4
    python bench/bench_fsdp.py --smoke          # tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    Result,
    add_model_args,
    comparison_header,
    comparison_row,
    describe,
    make_config,
    markdown_table,
    random_batch,
    resolve_args,
    spawn_gloo_ranks,
    time_steps,
)
from bench_dp import BETAS, CLIP, EPS, LR, mean_over_ranks, plait_side, torch_side  # noqa: E402
from plait.activation_checkpointing import decoder_blocks  # noqa: E402
from plait.materialize import build_model  # noqa: E402
from plait.mesh import ParallelMesh  # noqa: E402

MiB = 1024**2
SIDES = ("plait ZeRO-3", "FSDP2", "plait ZeRO-2", "DDP + ZeroRedundancyOptimizer")
PAIRS = (("plait ZeRO-3", "FSDP2"), ("plait ZeRO-2", "DDP + ZeroRedundancyOptimizer"))


def fsdp2_side(config, mesh: ParallelMesh, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One FSDP2 training step: ``fully_shard`` per decoder block and on the root, AdamW, clipping."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(config, mesh, seed=seed).train()
    dmesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for _, block in decoder_blocks(model):
        fully_shard(block, mesh=dmesh, reshard_after_forward=True)
    fully_shard(model, mesh=dmesh, reshard_after_forward=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)

    def run(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        return loss.detach()

    return run


def build_side(name: str, config, mesh: ParallelMesh, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "plait ZeRO-3":
        return plait_side(config, mesh, seed, zero=3, overlap=True)[0]
    if name == "plait ZeRO-2":
        return plait_side(config, mesh, seed, zero=2, overlap=True)[0]
    if name == "FSDP2":
        return fsdp2_side(config, mesh, seed)
    return torch_side(config, mesh, seed, zero=True)[0]


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timing_worker(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    config = make_config(args)
    ids = random_batch(config, args.batch, args.seq, args.seed + 1000 * rank)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(describe(config, args) + f" per rank; {world} gloo ranks x 1 thread; fp32; AdamW lr {LR}, grad clip {CLIP}",
        flush=True)
    mesh = ParallelMesh(world, rank, dp=world)
    sides = {name: build_side(name, config, mesh, args.seed) for name in SIDES}
    results = {name: Result(name) for name in sides}
    for name, run in sides.items():
        results[name].first_loss = mean_over_ranks(run(ids))
        for _ in range(args.warmup - 1):
            run(ids)
    log("first-step loss (mean over ranks): " + "  ".join(f"{n} {r.first_loss:.6f}" for n, r in results.items()),
        flush=True)
    tokens = args.steps * args.batch * args.seq * world
    order = list(sides)
    for r in range(args.rounds):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            dist.barrier()
            wall, cpu = time_steps(lambda run=sides[name]: run(ids), args.steps)
            stats = torch.tensor([wall, cpu], dtype=torch.float64)
            slowest = stats.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            results[name].add(tokens, args.steps, slowest[0].item(), stats[1].item())
        log(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{n} {1e3 * tokens / res.tokens_per_s[-1] / args.steps:.0f} ms" for n, res in results.items()), flush=True)
    last = {name: mean_over_ranks(run(ids)) for name, run in sides.items()}
    tokens_per_step = args.batch * args.seq * world
    rows = [[name, f"{statistics.median(1e3 * tokens_per_step / t for t in res.tokens_per_s):.0f}",
             f"{res.first_loss:.6f}", f"{last[name]:.6f}"] for name, res in results.items()]
    log(markdown_table(["implementation", "median ms/step", "first loss", "last loss"], rows))
    log()
    for ours, theirs in PAIRS:
        log(markdown_table(comparison_header(f"{ours} vs {theirs}", "peer"),
                           [["fp32"] + comparison_row(results[ours], results[theirs], tokens_per_step)]))
        log()
    log("(plait/peer = peer ms / plait ms, > 1 means plait is faster; goals: ZeRO-3 >= 1.0 vs FSDP2, "
        "ZeRO-2 >= 1.05 vs DDP + ZeroRedundancyOptimizer)", flush=True)


def memory_worker(rank: int, world: int, args: argparse.Namespace, name: str, queue) -> None:
    torch.manual_seed(args.seed)
    config = make_config(args)
    ids = random_batch(config, args.batch, args.seq, args.seed + 1000 * rank)
    mesh = ParallelMesh(world, rank, dp=world)
    before = rss_bytes()
    run = build_side(name, config, mesh, args.seed)
    for _ in range(args.warmup):
        run(ids)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    t = torch.tensor([float(peak)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(int(t.item()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (data-parallel degree), default 2")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the per-side peak-memory runs")
    args = resolve_args(parser.parse_args(argv))
    spawn_gloo_ranks(args.ranks, timing_worker, (args,))
    if args.skip_memory:
        return
    # every tensor above 64 KiB its own mapping, returned to the OS when freed, so that RSS tracks
    # live tensors and not what glibc's heap kept (as bench/measure_memory.py does)
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    queue = mp.get_context("spawn").Queue()
    peaks = {}
    for name in SIDES:
        spawn_gloo_ranks(args.ranks, memory_worker, (args, name, queue))
        peaks[name] = queue.get(timeout=60)
    config = make_config(args)
    meta = build_model(config, ParallelMesh(1, 0, create_groups=False), seed=args.seed, device="meta", init=False)
    n = sum(p.numel() for p in meta.parameters())
    print(f"\nparameters: {n:,} ({n * 4 / MiB:.1f} MiB fp32); peak resident-set growth per rank "
          f"(max over {args.ranks} ranks), each side alone:")
    rows = [[name, f"{peaks[name] / MiB:.1f}"] for name in SIDES]
    rows += [[f"{a} / {b}", f"{peaks[a] / peaks[b]:.2f}"] for a, b in PAIRS]
    print(markdown_table(["implementation", "peak MiB/rank"], rows), flush=True)


if __name__ == "__main__":
    main()
