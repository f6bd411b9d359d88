"""Measured per-rank peak memory of real training steps vs :func:`plait.plan.memory.estimate_memory`.

What is measured: for each layout, precision preset and activation-checkpointing mode, ``world``
spawned gloo ranks on the CPU (one intra-op thread each) build the model exactly as the trainer
does (:func:`plait.materialize.build_model`, or :func:`~plait.materialize.build_stages`
driven by :class:`~plait.pipeline.runtime.PipelineRuntime` with the balanced FLOP split), apply
:func:`plait.activation_checkpointing.apply_activation_checkpointing` (``--ckpt``), build the
optimizer (:class:`plait.data_parallel.optimizer.DistributedOptimizer`: flat buffers, fused
AdamW, ZeRO level ``--zero N``, the preset's dtypes) and run ``--steps`` optimizer steps with
:func:`plait.train.step.train_step` (one path for every layout) on random
tokens. Three numbers per rank, each relative to its RSS just before the model is built (the
bare runtime: interpreter, torch, gloo groups):

* **peak**: peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) at the end, against the estimate's
  ``total``;
* **model states**: RSS after the last step, when no activation is alive (parameters, gradient
  buffers, master weights, optimizer states), against the estimate's ``model_states``;
* **activations** (``--probe``, layouts without pipeline parallelism): RSS after one extra
  forward (loss computed, graph alive, nothing freed yet) minus RSS just before it, against the
  bytes one micro-batch keeps for backward (:func:`plait.plan.memory.chunk_cost`: saved
  activations + autocast weight copies + saved softmax);
* **activation peak** (``--probe``, same layouts): the peak RSS of one more forward + backward
  (``runtime.run``, as a training step runs it) minus the RSS just before it, when parameters,
  gradient buffer and optimizer states are already allocated. The kernel's high-water mark
  ``VmHWM`` is reset to the current RSS first (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)
  and read after the backward, so the figure includes every transient (the ring kernel's piece
  scores, the loss's working set), not only saved tensors. It is compared with the estimate's
  activation phase above the gradient buffer (``activations + weight_copies + logits +
  comm_buffers + workspace``). The fixed per-process cost (interpreter, torch, gloo: the baseline
  RSS) and the model states are reported beside it, so that the activation figure alone shows
  how it scales with ``cp``.

Context parallelism (``--cp``): layouts ``cp1, cp2, cp4`` (``cp2-allgather``, ``cp4-allgather``
with ``parallel.cp_mode: allgather``) of the long-context demo model (docs/context_parallel.md) at
``seq_len`` 8192, micro-batch 1, fp32; the stages are switched to cp attention and loss
(:func:`plait.context_parallel.apply.apply_context_parallel`), gradients averaged over dp x cp and
every batch cut to the rank's zigzag chunks, exactly as :func:`plait.train.build_run.build_run` does.

At least two steps are needed: AdamW allocates its states in the first ``optimizer.step()``, so
only the second step's forward/backward runs with every model state live.

glibc's allocator: by default glibc serves blocks up to a *dynamic* threshold (growing to 32 MiB
after the first large free) from its heap and keeps freed heap memory mapped, so RSS would also
count freed tensors the allocator kept (measured: 100-150 MiB per rank here). The script pins
``MALLOC_MMAP_THRESHOLD_`` (default 64 KiB; ``--mmap-threshold 0`` leaves glibc's defaults) and
``MALLOC_TRIM_THRESHOLD_`` (128 KiB) so every tensor above 64 KiB is its own mapping, returned to
the OS when freed: RSS then tracks live tensors, which is what the model estimates.

Run (repository root, venv active; ~5 minutes on 2 cores)::

    python bench/measure_memory.py
    python bench/measure_memory.py --smoke                      # tiny end-to-end check
    python bench/measure_memory.py --layouts tp2-sp,pp2 --precisions fp32
    python bench/measure_memory.py --layouts dp1,dp2,dp4 --zero 1 --precisions fp32,bf16-mixed
    python bench/measure_memory.py --layouts dp2,dp4 --zero 3 --precisions fp32
    python bench/measure_memory.py --layouts tp1,tp2,tp2-sp --ckpt off,selective,full --probe
    python bench/measure_memory.py --cp                        # cp=1/2/4 at seq 8192 (~3 minutes)
    python bench/measure_memory.py --cp --layouts cp1,cp2,cp4,cp2-allgather,cp4-allgather
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
import traceback
from functools import partial

import torch
import torch.multiprocessing as mp

MiB = 1024**2

#: name -> (ParallelDegrees kwargs, microbatches). Pipeline layouts use more micro-batches than stages so
#: the 1F1B steady state (gradients already accumulated) is reached.
LAYOUTS = {
    "tp1": (dict(), 2),
    "tp2": (dict(tp=2), 2),
    "tp2-sp": (dict(tp=2, sequence_parallel=True), 2),
    "dp1": (dict(), 2),
    "dp2": (dict(dp=2), 2),
    "dp4": (dict(dp=4), 2),
    "pp2": (dict(pp=2), 4),
    "pp2-gpipe": (dict(pp=2, schedule="gpipe"), 4),
    "tp2xpp2": (dict(tp=2, pp=2, sequence_parallel=True), 4),
    # context parallelism (``--cp``): one micro-batch per step, the sequence split over cp ranks
    "cp1": (dict(), 1),
    "cp2": (dict(cp=2), 1),
    "cp4": (dict(cp=4), 1),
    "cp2-allgather": (dict(cp=2), 1),
    "cp4-allgather": (dict(cp=4), 1),
}
#: layouts whose attention runs as ``parallel.cp_mode: allgather`` (the others: ring)
ALLGATHER = {"cp2-allgather", "cp4-allgather"}
DEFAULT_LAYOUTS = "tp1,tp2,tp2-sp,dp2,pp2,pp2-gpipe,tp2xpp2"
CP_LAYOUTS = "cp1,cp2,cp4"
#: ~56M parameters (32.8M of them in the untied embedding and head), GQA 8 query / 4 K/V heads.
MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
#: the long-context demo of docs/context_parallel.md (``plait train`` on the Bible at seq_len 8192):
#: ~0.9M parameters, hidden 128, 2 layers, 4 query / 2 K/V heads of dim 32, the default BPE's 2048 tokens.
CP_MODEL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                max_position_embeddings=8192)
SMOKE_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak_rss() -> None:
    """Lower the kernel's resident-set high-water mark (``VmHWM``) to the current RSS (Linux >= 4.0:
    ``echo 5 > /proc/PID/clear_refs``), so :func:`hwm_bytes` reads the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(rank: int, world: int, model_kw: dict, layout_kw: dict, precision: str, micro_batch_size: int,
           seq_len: int, microbatches: int, steps: int, warmup: bool = True, probe: bool = False) -> dict:
    """Warm up the runtime on a tiny model (optional), then measure ``steps`` steps of the real one."""
    import gc

    if warmup:
        tiny = dict(model_kw, vocab_size=256, hidden_size=8 * model_kw["num_attention_heads"],
                    intermediate_size=32, num_hidden_layers=max(2, layout_kw.get("pp", 1)))
        _train(rank, world, tiny, layout_kw, precision, 1, 16, microbatches, 2, probe)
        gc.collect()
    return _train(rank, world, model_kw, layout_kw, precision, micro_batch_size, seq_len, microbatches, steps,
                  probe)


def _train(rank: int, world: int, model_kw: dict, layout_kw: dict, precision: str, micro_batch_size: int,
           seq_len: int, microbatches: int, steps: int, probe: bool = False) -> dict:
    import gc

    import torch.distributed as dist

    from plait.activation_checkpointing import apply_activation_checkpointing
    from plait.context_parallel.apply import apply_context_parallel
    from plait.context_parallel.attention import ContextParallel
    from plait.context_parallel.batch import split_token_batch
    from plait.data.batch import as_token_batch
    from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
    from plait.materialize import build_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama.config import LlamaConfig
    from plait.models.llama.parallelize import kv_replication_for
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.pipeline_split import plan_partition
    from plait.precision import policy_for
    from plait.train.build_run import build_runtime
    from plait.train.step import train_step

    layout_kw = dict(layout_kw)
    cp_mode = layout_kw.pop("cp_mode", "ring")
    config = LlamaConfig(**model_kw)
    kv = kv_replication_for(config, layout_kw.get("tp", 1))
    layout = ParallelDegrees(kv_replication=kv, **layout_kw)
    mesh = ParallelMesh(world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, kv_replication=kv)
    sp = layout.sequence_parallel and layout.tp > 1
    gen = torch.Generator().manual_seed(1234 + mesh.dp_rank)
    batches = [torch.randint(0, config.vocab_size, (microbatches, micro_batch_size, seq_len), generator=gen)
               for _ in range(steps)]
    device = torch.device("cpu")
    policy = policy_for(precision)
    dist.barrier()
    before = rss_bytes()
    peak_before = peak_rss_bytes()
    t0 = time.perf_counter()
    split = plan_partition(config, layout.pp * layout.vpp, seq_len).stage_layers() if layout.pp > 1 else \
        [list(range(config.num_hidden_layers))]
    stages = build_stages(config, mesh, split, device=device, sequence_parallel=sp)
    n_params = sum(p.numel() for stage in stages for p in stage.parameters())  # before ZeRO-3 frees them
    context = ContextParallel(mesh.info("cp"), tuple(mesh.my_group_ranks("cp")), mode=cp_mode)
    apply_context_parallel(stages, context, seq_len)  # as the trainer does (a no-op at cp=1)
    if layout.activation_checkpointing != "none":  # last, after the TP swap and the pipeline split
        apply_activation_checkpointing(stages, layout.activation_checkpointing)
    # gradients are averaged over dp x cp (the dp group at cp=1), as plait.train.build_run does
    optimizer = DistributedOptimizer(stages, policy, OptimizerHyper(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                                                    eps=1e-8),
                                     dp=mesh.info("dp_cp"), tp=mesh.info("tp"), pp=mesh.info("pp"),
                                     tied=mesh.info("tied") if layout.pp > 1 else None, zero=layout.zero)
    # under cp every batch is cut to this rank's zigzag chunks, as the trainer does
    split = partial(split_token_batch, split=context.split(seq_len), rank=context.info.rank) if layout.cp > 1 else None
    runtime = build_runtime(stages, mesh, policy, optimizer, schedule=layout.schedule, microbatches=microbatches,
                            micro_batch_size=micro_batch_size, seq_len=seq_len // layout.cp, sequence_parallel=sp,
                            split_batch=split)
    for batch in batches:
        loss, _ = train_step(runtime, optimizer, batch, grad_clip=1.0)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    gc.collect()
    dist.barrier()
    states = rss_bytes() - before  # no activation alive: parameters, gradient buffers, master, AdamW
    activations = act_peak = None
    if probe and layout.pp == 1:  # one forward; what it leaves alive is what backward would use
        tokens = as_token_batch(batches[0])
        if split is not None:  # under cp: this rank's chunks, targets and positions
            tokens = split(tokens)
        ids, kw = tokens.input_ids[0], tokens.stage_inputs(0, last=True, normalizer=None)
        dist.barrier()
        at = rss_bytes()
        with policy.compute_context(device):
            out = stages[0](ids, ids.shape[1], **kw)  # the single stage holds the whole model
        activations = rss_bytes() - at
        del out
        dist.barrier()
    if probe and layout.pp == 1:  # the peak of one more forward + backward above the model states
        gc.collect()
        dist.barrier()
        at = rss_bytes()
        reset_peak_rss()
        runtime.run(batches[0], train=True)
        act_peak = hwm_bytes() - at
        optimizer.grads.finish()  # the data-parallel reduction the last backward started
        dist.barrier()
    return {"rank": rank, "pp_rank": mesh.pp_rank, "tp_rank": mesh.tp_rank, "dp_rank": mesh.dp_rank,
            "before": before, "peak": peak, "peak_before": peak_before, "measured": peak - before,
            "states": states, "activations": activations, "act_peak": act_peak,
            "params": n_params,
            "seconds": seconds, "loss": float(loss),
            "report": optimizer.memory_report()}


# ------------------------------------------------------------------------------ process launch
def _entry(rank, world, port, args, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = worker(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            queue.close()
            queue.join_thread()
            sys.stdout.flush()
            os._exit(0)


def run_ranks(world: int, args: tuple, timeout: float = 1800.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


# ------------------------------------------------------------------------------ main
CKPT_MODES = {"off": "none", "none": "none", "selective": "selective", "full": "full"}


def _ratio(estimate: int, measured: int) -> str:
    return f"{estimate / measured:.3f}" if measured > 0 else "n/a (nothing measured)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--precisions", default="fp32,autocast",
                    help="comma list of precision presets: fp32, autocast, bf16-mixed, bf16-pure")
    ap.add_argument("--ckpt", default="off", help="comma list of activation-checkpointing modes: off, selective, full")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                    help="ZeRO level on every layout (a no-op, with a warning, at dp=1)")
    ap.add_argument("--zero1", action="store_true", help="the same as --zero 1")
    ap.add_argument("--probe", action="store_true",
                    help="also measure one forward's activation bytes (layouts without pipeline parallelism)")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch size (sequences)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=64 << 10,
                    help="MALLOC_MMAP_THRESHOLD_ for the ranks in bytes (0: glibc's dynamic defaults)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the tiny-model warm-up steps that load kernels and lazily initialised libraries "
                         "before the baseline RSS is read")
    ap.add_argument("--smoke", action="store_true", help="tiny model, short sequences")
    ap.add_argument("--cp", action="store_true",
                    help=f"context parallelism: the long-context demo model, --layouts {CP_LAYOUTS} (unless given), "
                         f"--seq 8192 --batch 1 --precisions fp32 --probe (unless given)")
    ap.add_argument("--details", action="store_true", help="also print each estimate's components")
    args = ap.parse_args()
    if args.cp:  # defaults of the context-parallel measurement; explicit flags win
        given = set(sys.argv[1:])
        args.probe = True
        for flag, attr, value in (("--layouts", "layouts", CP_LAYOUTS), ("--seq", "seq", 8192), ("--batch", "batch", 1),
                                  ("--precisions", "precisions", "fp32")):
            if not any(g == flag or g.startswith(flag + "=") for g in given):
                setattr(args, attr, value)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (AdamW allocates its states in the first step)")
    from plait.plan.memory import PRECISIONS

    precisions = args.precisions.split(",")
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            ap.error(f"--layouts: unknown layout {name!r}; valid: {', '.join(LAYOUTS)}")
    for precision in precisions:
        if precision not in PRECISIONS:
            ap.error(f"--precisions: unknown preset {precision!r}; valid: {', '.join(PRECISIONS)}")
    ckpts = args.ckpt.split(",")
    for mode in ckpts:
        if mode not in CKPT_MODES:
            ap.error(f"--ckpt: unknown mode {mode!r}; valid: off, selective, full")
    if args.mmap_threshold > 0:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by the spawned ranks
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(128 << 10)
    model_kw = SMOKE_MODEL if args.smoke else CP_MODEL if args.cp else MODEL
    seq = 32 if args.smoke else args.seq

    from plait.models.llama.config import LlamaConfig
    from plait.models.llama.parallelize import kv_replication_for
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import chunk_cost, estimate_memory, rank_chunks

    config = LlamaConfig(**model_kw)
    print(f"model: {config.num_parameters() / 1e6:.1f}M parameters ({model_kw}); micro-batch {args.batch} x {seq} "
          f"tokens, {args.steps} steps; torch {torch.__version__}; MALLOC_MMAP_THRESHOLD_="
          f"{os.environ.get('MALLOC_MMAP_THRESHOLD_', 'glibc default')}", flush=True)
    rows, probes, peaks, details = [], [], [], {}
    for name in args.layouts.split(","):
        base_kw, m = LAYOUTS[name]
        for mode in ckpts:
            for precision in precisions:
                level = max(args.zero, 1 if args.zero1 else 0)
                layout_kw = dict(base_kw, zero=level, activation_checkpointing=CKPT_MODES[mode])
                layout = ParallelDegrees(kv_replication=kv_replication_for(config, layout_kw.get("tp", 1)), **layout_kw)
                label = f"{name}{f' zero{level}' if level else ''} (m={m})"
                start = time.perf_counter()
                rank_kw = dict(layout_kw, cp_mode="allgather" if name in ALLGATHER else "ring")
                results = run_ranks(layout.world, (model_kw, rank_kw, precision, args.batch, seq, m, args.steps,
                                                   not args.no_warmup, args.probe))
                for res in results:
                    est = estimate_memory(config, layout, precision=precision, micro_batch_size=args.batch,
                                          seq_len=seq, microbatches=m, stage=res["pp_rank"])
                    assert est.parameter_count == res["params"], (name, est.parameter_count, res["params"])
                    rows.append(f"| {label} | {precision} | {mode} | {res['rank']} (pp {res['pp_rank']}) | "
                                f"{est.model_states / MiB:.1f} | {res['states'] / MiB:.1f} | "
                                f"{est.total / MiB:.1f} | {res['measured'] / MiB:.1f} | "
                                f"{_ratio(est.total, res['measured'])} |")
                    details[(label, precision, mode, res["pp_rank"])] = est.table_row().replace(
                        f"| {layout.short()} |", f"| {label} {mode} |", 1)
                    if res["activations"] is not None:
                        local = seq // layout.cp  # the rank's tokens under context parallelism
                        (chunk,) = rank_chunks(config, layout, local, 0)
                        cost = chunk_cost(config, layout, precision, chunk, args.batch, local)
                        act = cost.activations + cost.weight_copies + cost.logits_saved
                        probes.append(f"| {label} | {precision} | {mode} | {res['rank']} | {act / MiB:.1f} | "
                                      f"{res['activations'] / MiB:.1f} | {_ratio(act, res['activations'])} |")
                    if res["act_peak"] is not None:
                        # the planner's activation phase above the gradient buffer (alive before the forward)
                        act = est.activation_phase - est.gradients_at_peak
                        peaks.append(f"| {label} | {precision} | {mode} | {res['rank']} | {res['before'] / MiB:.0f} | "
                                     f"{res['states'] / MiB:.1f} | {res['act_peak'] / MiB:.1f} | {act / MiB:.1f} | "
                                     f"{_ratio(act, res['act_peak'])} |")
                    print(rows[-1] + f"  <!-- {time.perf_counter() - start:.0f}s, baseline {res['before'] / MiB:.0f}"
                          f" MiB, optimizer state {res['report']['optimizer_state_bytes'] / MiB:.1f} MiB, master "
                          f"{res['report']['master_bytes'] / MiB:.1f} MiB -->", flush=True)
    print("\n| layout | precision | ckpt | rank | model states estimate MiB | model states measured MiB | "
          "peak estimate MiB | peak measured MiB | peak estimate / measured |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if probes:
        print("\n| layout | precision | ckpt | rank | activations estimate MiB (1 micro-batch) | measured MiB | "
              "estimate / measured |")
        print("|---|---|---|---|---:|---:|---:|")
        print("\n".join(probes))
    if peaks:
        print("\n| layout | precision | ckpt | rank | fixed per-process RSS MiB | model states measured MiB | "
              "activation peak measured MiB (forward + backward) | planner estimate MiB | estimate / measured |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|")
        print("\n".join(peaks))
    if args.details:
        from plait.plan.memory import MemoryBreakdown

        print("\n" + MemoryBreakdown.table_header())
        print("\n".join(details.values()))


if __name__ == "__main__":
    main()
