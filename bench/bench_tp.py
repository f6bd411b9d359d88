"""Tensor-parallel (TP=2) training throughput: plait vs PyTorch DTensor TP on HF's Llama.

What is measured: tokens per second of a full fp32 training step (``zero_grad``, forward with the
mean next-token loss, backward, ``torch.optim.AdamW`` step) on 2 gloo ranks on the CPU, one
intra-op thread per rank, for

* **plait**: :func:`plait.materialize.build_model` on ``ParallelMesh(2, rank, tp=2)`` (vocab-parallel
  embedding, column-parallel q/k/v and gate/up sharing one input, row-parallel o/down,
  column-parallel output head with vocab-parallel cross-entropy);
* **DTensor**: transformers' ``LlamaForCausalLM`` (SDPA attention) parallelised with
  ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D CPU ``DeviceMesh``:
  q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, the embedding
  ``RowwiseParallel(input_layouts=Replicate())`` (vocab-sharded, like plait's) and the output
  head ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` with the loss
  computed under ``loss_parallel()`` (vocab-parallel cross-entropy, like plait's). No sequence
  parallelism on either side. HF's attention reshapes q/k/v with ``-1`` heads and keeps only the
  q/kv head *ratio*, so the local shard needs no head-count adjustment (the PyTorch TP examples
  divide ``n_heads``/``n_kv_heads`` by the TP degree because their attention uses them);
  :func:`localize_heads` still does that for any such attribute an attention module has.

With ``--compile`` a third contestant joins: plait with ``train.compile: true`` (the modules between
its TP collectives compiled by :func:`plait.train.compile.compile_stages`; compile time printed apart
and spent in the warm-up).

How: both sides start from the same weights (plait's init is layout-invariant; the DTensor model
is loaded from the unsharded plait model's state dict and sharded by ``parallelize_module``), train
on the same fixed random batch (replicated on both ranks) with identically configured AdamW. The
first-step losses of both (and of the unsharded single-process model) are printed and must agree,
as must the losses after the last step. After ``--warmup`` untimed steps each, the
implementations alternate (the one going first alternates too) for ``--rounds`` rounds of
``--steps`` steps; a round's time is the slowest rank's (a barrier precedes each run). The table
gives medians over rounds, the plait/DTensor ratio of median tokens/s (> 1: plait faster), the
per-step CPU time summed over both ranks, and the per-round range.

The DTensor parameters mix ``DTensor`` (sharded layers) and plain tensors (norms); with
``--foreach`` they are put in separate AdamW parameter groups, because a foreach step rejects
mixed lists.

Run (from the repository root, venv active)::

    python bench/bench_tp.py                          # spawns the 2 ranks itself
    python bench/bench_tp.py --smoke                  # tiny end-to-end check
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/bench_tp.py   # same, via torchrun
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    hf_twin,
    make_config,
    markdown_table,
    random_batch,
    resolve_args,
    spawn_gloo_ranks,
    time_steps,
)
from plait.materialize import build_model  # noqa: E402
from plait.mesh import ParallelMesh, single_process_mesh  # noqa: E402
from plait.models.llama.config import LlamaConfig  # noqa: E402
from plait.models.llama.parallelize import kv_replication_for  # noqa: E402
from plait.train.compile import compile_seconds, compile_stages, use_compile_cache  # noqa: E402

TP = 2


def localize_heads(attn: nn.Module, tp: int) -> None:
    """Divide explicit head counts of an attention module by ``tp`` (a no-op for transformers 5's Llama)."""
    for name in ("num_heads", "num_key_value_heads", "n_heads", "n_kv_heads"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, getattr(attn, name) // tp)


def dtensor_llama(config: LlamaConfig, state_dict: dict[str, torch.Tensor], device_mesh) -> nn.Module:
    """HF ``LlamaForCausalLM`` with these (full) weights, tensor-parallelised with DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = device_mesh.size()
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        raise ValueError(f"the DTensor plan needs query heads ({config.num_attention_heads}) and K/V heads "
                         f"({config.num_key_value_heads}) divisible by tp={tp}")
    model = hf_twin(config, state_dict)
    plan: dict[str, object] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[prefix + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[prefix + name] = RowwiseParallel()
        localize_heads(layer.self_attn, tp)
    return parallelize_module(model, device_mesh, plan)


def make_step(forward: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
              context: Callable[[], object] | None = None) -> Callable[[], torch.Tensor]:
    """One training step; ``context()`` (e.g. ``loss_parallel``) wraps forward and backward."""

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with context() if context is not None else contextlib.nullcontext():
            loss = forward()
            loss.backward()
        opt.step()
        return loss.detach()

    return step


def _full(loss: torch.Tensor) -> float:
    """A loss value as a float (DTensor losses are replicated; take the local value)."""
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    """Runs on every rank: build both models, check the losses, time alternating rounds, print (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(args.seed)
    config = make_config(args)
    ids = random_batch(config, args.batch, args.seq, args.seed)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(describe(config, args) + f"; TP={world} gloo ranks x 1 thread; "
        f"AdamW {'foreach' if args.foreach else 'for-loop'}", flush=True)

    # plait: every rank builds only its shard.
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
    plait_model = build_model(config, mesh, seed=args.seed).train()
    plait_opt = adamw([list(plait_model.parameters())], args.foreach)

    # DTensor: the full model (same init), sharded by parallelize_module.
    reference = build_model(config, single_process_mesh(), seed=args.seed)
    with torch.no_grad():
        ref_loss = reference(ids, ids).item()
    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    hf_model = dtensor_llama(config, reference.state_dict(), device_mesh)
    del reference
    params = list(hf_model.parameters())
    hf_opt = adamw([[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]],
                   args.foreach)

    runs = {
        "plait": (make_step(lambda: plait_model(ids, ids), plait_opt), Result("plait")),
        "DTensor": (make_step(lambda: hf_model(input_ids=ids, labels=ids).loss, hf_opt, loss_parallel),
                    Result("DTensor")),
    }
    if args.compile:
        # train.compile: true on a second plait replica (same init): its TP-free modules are compiled
        compiled_model = build_model(config, mesh, seed=args.seed).train()
        compile_stages([compiled_model])
        compiled_opt = adamw([list(compiled_model.parameters())], args.foreach)
        runs["plait-compiled"] = (make_step(lambda: compiled_model(ids, ids), compiled_opt), Result("plait-compiled"))
        before = compile_seconds()
    for step, result in runs.values():
        result.first_loss = _full(step())
        for _ in range(args.warmup - 1):
            step()
    if args.compile:
        log(f"compile time {compile_seconds() - before:.1f} s (in the warm-up, not in any timed round); "
            f"first-step loss compiled {runs['plait-compiled'][1].first_loss:.6f}", flush=True)
    log(f"first-step loss: plait TP {runs['plait'][1].first_loss:.6f}  DTensor TP "
        f"{runs['DTensor'][1].first_loss:.6f}  (unsharded reference {ref_loss:.6f})", flush=True)

    tokens = args.steps * args.batch * args.seq
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
            + "  ".join(f"{n} {res.tokens_per_s[-1]:,.0f} tok/s" for n, (_, res) in runs.items()), flush=True)

    last = {n: _full(step()) for n, (step, _) in runs.items()}
    log(f"loss after {args.warmup + args.rounds * args.steps + 1} steps: plait TP {last['plait']:.6f}  "
        f"DTensor TP {last['DTensor']:.6f}", flush=True)
    plait_res, dt_res = runs["plait"][1], runs["DTensor"][1]
    log()
    rows = [["fp32, plait eager"] + comparison_row(plait_res, dt_res, args.batch * args.seq)]
    if args.compile:
        rows.append(["fp32, plait compiled"] + comparison_row(runs["plait-compiled"][1], dt_res, args.batch * args.seq))
    log(markdown_table(comparison_header("TP=2, fp32", "DTensor"), rows), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--compile", action="store_true",
                        help="also time plait with train.compile: true (compiled modules between the TP collectives)")
    args = resolve_args(parser.parse_args(argv))
    if args.compile:
        use_compile_cache()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if world != TP:
            raise SystemExit(f"run with exactly {TP} ranks (got WORLD_SIZE={world})")
        gloo_rank_entry(int(os.environ["RANK"]), world, None, worker, (args,))
    spawn_gloo_ranks(TP, worker, (args,))


if __name__ == "__main__":
    main()
