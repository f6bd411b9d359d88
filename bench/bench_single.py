"""Single-process training throughput: plait's Llama vs transformers' ``LlamaForCausalLM``.

What is measured: tokens per second of a full training step (``zero_grad``, forward with the
mean next-token loss, backward, ``torch.optim.AdamW`` step) on one process with ``--threads``
intra-op threads (default 2), for fp32 and for bf16 autocast (``torch.autocast("cpu",
dtype=torch.bfloat16)`` around the forward and loss; backward and optimizer outside it).

How: both models are built from the same :class:`plait.models.llama.config.LlamaConfig`; plait's
comes from :func:`plait.materialize.build_model` (seeded init) and the HF model (SDPA attention,
no KV cache) is loaded with plait's state dict, so both start from identical weights and train on
the same fixed random batch with identically configured AdamW. The losses of the first step are
printed (they must agree) together with the losses after the last step (same trajectory). After
``--warmup`` untimed steps each, the two implementations alternate for ``--rounds`` rounds (the
one that goes first alternates too), each round timing ``--steps`` consecutive steps. The table
gives the median tokens/s over rounds, the per-round range, and the plait/HF ratio of medians
(> 1 means plait is faster).

With ``--compile`` a third implementation joins the alternation: plait's model with its decoder
blocks and loss head compiled by :func:`plait.train.compile.compile_stages` (what
``train.compile: true`` does). Its compile time (dynamo + inductor, measured by
:func:`plait.train.compile.compile_seconds`) is printed separately and is not in any timed round
(the warm-up steps include it). The compile cache is plait's (``<plait cache>/compile``): the first
run on a machine generates and builds the kernels, a second run loads them; ``--cold-cache``
compiles into a fresh temporary directory to measure a first run. The tables then give plait
eager vs HF, plait compiled vs HF, and plait compiled vs plait eager. A table of MFU (model FLOPs
per second over the matmul peak measured on this machine, :func:`plait.devices.peak_flops`) of
every contestant comes first.

``--device cuda`` runs the same comparison on a GPU (models, batch and optimizer states there,
``torch.autocast("cuda")`` for bf16, a device synchronisation closing every timed round); MFU is
then against the GPU's matmul peak measured the same way (:func:`measured_peak`). ``--no-hf``
leaves transformers out (plait eager and, with ``--compile``, compiled only). ``--json FILE``
also writes the medians, first-step losses, peaks and MFU as JSON (``bench/device_check.py``
reads it).

Run (from the repository root, venv active)::

    python bench/bench_single.py            # default ~22M-parameter model
    python bench/bench_single.py --compile  # also plait compiled
    python bench/bench_single.py --smoke    # tiny end-to-end check
    python bench/bench_single.py --compile --profile --dtypes bf16-autocast   # where a step's time goes
    python bench/bench_single.py --device cuda --dtypes bf16-autocast --threads 8   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    Result,
    adamw,
    add_model_args,
    comparison_header,
    comparison_row,
    describe,
    device_sync,
    hf_twin,
    make_config,
    markdown_table,
    random_batch,
    resolve_args,
    time_steps,
)
from plait.devices import detect_device, measure_matmul_flops, peak_flops  # noqa: E402
from plait.materialize import build_model  # noqa: E402
from plait.mesh import single_process_mesh  # noqa: E402
from plait.models.flops import mfu, model_flops_per_token  # noqa: E402
from plait.models.llama.config import LlamaConfig  # noqa: E402
from plait.train.compile import compile_seconds, compile_stages, use_compile_cache  # noqa: E402

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16-autocast": torch.bfloat16}


#: square-matmul probe size of the measured peak on a GPU: at devices.PROBE_SIZE (2048) one product
#: takes some 20 us on a Hopper GPU, as long as its launch and synchronisation, and the probe would
#: read about half the peak; at 8192 (1.1 TFLOP per product) the overhead is a few per cent
GPU_PROBE_SIZE = 8192


def measured_peak(device: str, dtype: str, threads: int) -> float:
    """The matmul peak measured on ``device``: :func:`plait.devices.peak_flops` of the CPU at
    ``threads`` threads (cached per machine), or the square-matmul probe of
    :func:`plait.devices.measure_matmul_flops` on a GPU at :data:`GPU_PROBE_SIZE` (the device table's
    datasheet figure is not a measurement)."""
    if torch.device(device).type == "cpu":
        return peak_flops("cpu", dtype, threads=threads)
    return measure_matmul_flops(dtype, device=device, n=GPU_PROBE_SIZE)


def make_step(forward: Callable[[], torch.Tensor], params: list[torch.nn.Parameter],
              autocast_dtype: torch.dtype | None, foreach: bool,
              device_type: str = "cpu") -> Callable[[], torch.Tensor]:
    """One training step (zero_grad, forward+loss under optional autocast, backward, AdamW)."""
    opt = adamw([params], foreach)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        ctx = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            loss = forward()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def bench_dtype(args: argparse.Namespace, label: str, autocast_dtype: torch.dtype | None) -> dict[str, Result]:
    config = make_config(args)
    device = torch.device(args.device)
    ids = random_batch(config, args.batch, args.seq, args.seed).to(device)
    plait_model = build_model(config, single_process_mesh(), seed=args.seed, device=device).train()

    plait_step = make_step(lambda: plait_model(ids, ids), list(plait_model.parameters()), autocast_dtype,
                           args.foreach, device.type)
    runs = {"plait": (plait_step, Result("plait"))}
    if not args.no_hf:
        hf_model = hf_twin(config, plait_model.state_dict(), device)
        hf_step = make_step(lambda: hf_model(input_ids=ids, labels=ids).loss, list(hf_model.parameters()),
                            autocast_dtype, args.foreach, device.type)
        runs["HF"] = (hf_step, Result("HF"))
    if args.compile:
        compiled_model = build_model(config, single_process_mesh(), seed=args.seed, device=device).train()
        compile_stages([compiled_model], args.compile_mode)
        compiled_step = make_step(lambda: compiled_model(ids, ids), list(compiled_model.parameters()),
                                  autocast_dtype, args.foreach, device.type)
        runs["plait-compiled"] = (compiled_step, Result("plait-compiled"))

    for name, (step, result) in runs.items():
        before, start = compile_seconds(), time.perf_counter()
        result.first_loss = step().item()
        for _ in range(args.warmup - 1):
            step()
        if name == "plait-compiled":
            result.compile_s = compile_seconds() - before
            print(f"[{label}] compile time {result.compile_s:.1f} s (warm-up of {args.warmup} steps: "
                  f"{time.perf_counter() - start:.1f} s, not timed)", flush=True)
    print(f"[{label}] first-step loss: " + "  ".join(f"{n} {res.first_loss:.6f}" for n, (_, res) in runs.items()),
          flush=True)

    tokens = args.steps * args.batch * args.seq
    order = list(runs)
    sync = device_sync(device)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            step, result = runs[name]
            result.add(tokens, args.steps, *time_steps(step, args.steps, sync))
        print(f"[{label}] round {r + 1}/{args.rounds}: "
              + "  ".join(f"{n} {res.tokens_per_s[-1]:,.0f} tok/s" for n, (_, res) in runs.items()), flush=True)

    if args.profile:
        for name, (step, _) in runs.items():
            print(f"\n[{label}] {profile_step(step, name)}", flush=True)
    last = {n: step().item() for n, (step, _) in runs.items()}
    for n, (_, res) in runs.items():
        res.last_loss = last[n]
    print(f"[{label}] loss after {args.warmup + args.rounds * args.steps + 1} steps: "
          + "  ".join(f"{n} {v:.6f}" for n, v in last.items()), flush=True)
    return {n: res for n, (_, res) in runs.items()}


#: how --profile groups operators: matmul kernels, attention, dtype casts and copies, the rest
OP_GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"),
    "attention": ("aten::_scaled_dot_product", "aten::_flash_attention"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous"),
}


def profile_step(step: Callable[[], torch.Tensor], name: str) -> str:
    """One step under ``torch.profiler``: where the self CPU time goes by operator group (matmul,
    attention, casts and copies, the rest, and inductor's compiled kernels), then the top operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    groups: dict[str, float] = {}
    for e in ops:
        group = next((g for g, prefixes in OP_GROUPS.items() if e.key.startswith(prefixes)),
                     "compiled kernels" if "Torch-Compiled Region" in e.key or e.key.startswith("cpp_fused")
                     else "other")
        groups[group] = groups.get(group, 0.0) + e.self_cpu_time_total
    shares = ", ".join(f"{g} {100 * t / total:.1f}%" for g, t in sorted(groups.items(), key=lambda kv: -kv[1]))
    count = sum(e.count for e in ops if e.key.startswith("aten::"))
    return (f"profile of one {name} step: self CPU {total / 1e3:.0f} ms, {count} aten operators; {shares}\n"
            + ops.table(sort_by="self_cpu_time_total", row_limit=15))


def mfu_table(config: LlamaConfig, args: argparse.Namespace, results: dict[str, dict[str, Result]]) -> str:
    """Model FLOPs utilisation of every contestant against the matmul peak measured on this machine.

    The peak is :func:`plait.devices.peak_flops` (a square-matmul probe at ``--threads`` threads,
    cached per machine): fp32 for the fp32 runs, bf16 for bf16 autocast, so MFU says how close a
    step comes to what the cores' matmul units do on their best shape, not to a datasheet figure.
    Model FLOPs are :func:`plait.models.flops.model_flops_per_token` (6N + attention).
    """
    per_token = model_flops_per_token(config, args.seq)
    where = "at these threads" if torch.device(args.device).type == "cpu" else f"on {args.device}"
    lines = [f"MFU (model FLOPs / measured matmul peak {where}; median tokens/s):",
             "| dtype | peak TFLOP/s | " + " | ".join(next(iter(results.values())).keys()) + " |",
             "|---|---|" + "---|" * len(next(iter(results.values())))]
    for label, res in results.items():
        peak = measured_peak(args.device, peak_dtype(label), args.threads)
        cells = [f"{mfu(r.median, per_token, peak):.1%}" for r in res.values()]
        lines.append(f"| {label} | {peak / 1e12:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peak_dtype(label: str) -> str:
    """The matmul dtype whose peak a ``--dtypes`` label is measured against."""
    return "fp32" if DTYPES[label] is None else "bf16"


def json_report(config: LlamaConfig, args: argparse.Namespace, results: dict[str, dict[str, Result]]) -> dict:
    """What ``--json`` writes: per dtype and contestant the median tokens/s, MFU and losses, and the
    peak they are measured against."""
    per_token = model_flops_per_token(config, args.seq)
    out: dict = {"device": args.device, "parameters": config.num_parameters(), "batch": args.batch, "seq": args.seq,
                 "flops_per_token": per_token, "dtypes": {}}
    if torch.device(args.device).type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(torch.device(args.device))
        spec = detect_device()
        out["datasheet_peak_bf16"] = spec.peak_flops.get("bf16")  # None for a GPU the table does not know
    for label, res in results.items():
        peak = measured_peak(args.device, peak_dtype(label), args.threads)
        out["dtypes"][label] = {"peak_flops": peak, "contestants": {
            name: {"tokens_per_s": r.median, "mfu": mfu(r.median, per_token, peak), "first_loss": r.first_loss,
                   "last_loss": r.last_loss, "compile_s": r.compile_s,
                   "finite": all(math.isfinite(v) for v in (r.first_loss, r.last_loss) if v is not None)}
            for name, r in res.items()}}
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, Result]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--device", default="cpu",
                        help="where the models train: cpu (default) or a CUDA device (cuda, cuda:0)")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers out (plait eager and compiled only)")
    parser.add_argument("--json", metavar="FILE", help="also write the medians, losses, peaks and MFU as JSON")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="precisions to measure (default: both)")
    parser.add_argument("--compile", action="store_true",
                        help="also measure plait with compiled blocks and loss head (train.compile: true)")
    parser.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                        help="torch.compile mode with --compile (train.compile_mode)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, profile one step of each contestant (operator groups and "
                             "top operators by self CPU time)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="with --compile: compile into a fresh temporary cache (a first run's compile time)")
    args = resolve_args(parser.parse_args(argv))
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    if args.compile:
        if args.cold_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="plait-compile-")
        cache = use_compile_cache()
        kind = "fresh: a first run's compile" if args.cold_cache else "plait's: a second run loads the first's kernels"
        print(f"compile cache: {cache} ({kind})", flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = make_config(args)
    where = (platform.machine() if torch.device(args.device).type == "cpu"
             else torch.cuda.get_device_name(torch.device(args.device)))
    print(describe(config, args) + f"; {args.threads} threads; AdamW {'foreach' if args.foreach else 'for-loop'}; "
          f"{where}", flush=True)

    rows, compiled_rows = [], []
    results: dict[str, dict[str, Result]] = {}
    tokens = args.batch * args.seq
    for label in args.dtypes:
        res = bench_dtype(args, label, DTYPES[label])
        results[label] = res
        if "HF" in res:
            rows.append([f"{label}, plait eager"] + comparison_row(res["plait"], res["HF"], tokens))
        if args.compile:
            if "HF" in res:
                rows.append([f"{label}, plait compiled"] + comparison_row(res["plait-compiled"], res["HF"], tokens))
            compiled_rows.append([label] + comparison_row(res["plait-compiled"], res["plait"], tokens))
    print()
    print(mfu_table(config, args, results))
    if rows:
        print()
        print("plait vs transformers (ratio > 1: plait faster):")
        print(markdown_table(comparison_header("dtype, plait", "HF"), rows))
    if compiled_rows:
        print()
        print("plait compiled vs plait eager (ratio > 1: compiled faster; compile time excluded, printed above):")
        print(markdown_table([h.replace("plait", "compiled") for h in comparison_header("dtype", "eager")],
                             compiled_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_report(config, args, results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
