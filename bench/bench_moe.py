"""Mixture-of-Experts training speed: plait's Mixtral vs transformers', and EP=2 vs EP=1 on two ranks.

1. One process (``--threads`` intra-op threads, default 2): a full training step (zero_grad,
   forward with the mean next-token loss, backward, AdamW) of plait's ``MixtralForCausalLM``
   and transformers' on the same config, weights (plait's, written as a Hugging Face directory
   and read by transformers) and batch, fp32, dropless, no auxiliary loss on either side. The
   first-step losses are printed and must agree. Implementations alternate for ``--rounds``
   rounds of ``--steps`` steps; the table gives median and best tokens/s and the
   plait/transformers ratios. ``--adamw fused`` (default) steps both models with
   ``torch.optim.AdamW(fused=True)``, one kernel per parameter (plait's trainer steps one fused
   kernel over flat buffers); ``--adamw loop`` uses torch's CPU default, about ten operations
   per parameter, where plait's per-expert parameters (3 per expert, Hugging Face's names) count
   three times as many tensors as transformers' fused ``[E, 2I, H]`` ones. ``--profile`` adds
   each side's operator table (one step, by self CPU time) and its operator count.
2. Two gloo ranks, one thread each, data parallel over 2: forward + backward of the same model
   with every expert on both ranks (EP=1) and with the experts split (EP=2: 4 of 8 per rank,
   tokens exchanged by all-to-all in static slots, then with ``moe.dispatch=exact``'s
   variable-split exchange). The gradient all-reduce and the optimizer are left out (they
   differ only by the expert parameters' share). The all-to-all share is the time spent inside
   plait's exchanges (forward and backward) over the step time, measured on rank 0.

On a busy machine, read the *best* rounds and prefer ``--threads 1``: a step is a few thousand
operations, and with two threads each parallel operation waits for both threads to be scheduled,
so under load the step time grows with the operation count rather than with the work.

Run (from the repository root, venv active)::

    python bench/bench_moe.py             # 8 experts, top-2: 14.4M parameters (5.0M active)
    python bench/bench_moe.py --part single --threads 1 --profile
    python bench/bench_moe.py --smoke     # tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import free_port, gloo_rank_entry, markdown_table  # noqa: E402
from plait.materialize import build_model  # noqa: E402
from plait.mesh import ParallelMesh, single_process_mesh  # noqa: E402
from plait.models.hf_io import save_hf_checkpoint  # noqa: E402
from plait.models.mixtral import MixtralConfig  # noqa: E402
from plait.moe import all_to_all as a2a_module  # noqa: E402
from plait.moe import exact_dispatch, expert_parallel, moe_layers  # noqa: E402

DEFAULTS = dict(vocab=2048, hidden=256, intermediate=512, layers=4, experts=8, top_k=2, batch=4, seq=256,
                rounds=5, steps=3, warmup=1)
SMOKE = dict(vocab=256, hidden=64, intermediate=32, layers=2, experts=4, top_k=2, batch=2, seq=32,
             rounds=2, steps=1, warmup=1)


def config_of(a: argparse.Namespace) -> MixtralConfig:
    return MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=a.experts, num_experts_per_tok=a.top_k, max_position_embeddings=a.seq,
                         tie_word_embeddings=False)


def batch_of(a: argparse.Namespace, config: MixtralConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    fused = {"fused": {"fused": True}, "loop": {"foreach": False}}[kind]
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **fused)


def _profile(step, name: str) -> str:
    """One step under ``torch.profiler``: the operator table by self CPU time and the operator count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = prof.key_averages()
    count = sum(e.count for e in ops if e.key.startswith("aten::"))
    return f"### {name}: {count} aten operators in one step\n\n" + ops.table(sort_by="self_cpu_time_total",
                                                                              row_limit=20)


def single_process(a: argparse.Namespace) -> str:
    import transformers

    config = config_of(a)
    ids = batch_of(a, config)
    ours = build_model(config, single_process_mesh(), seed=0).train()
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(ours, d, single_process_mesh().info("tp"))
        theirs = transformers.MixtralForCausalLM.from_pretrained(d, dtype=torch.float32).train()
    steps = {}
    for name, model, fwd in (("plait", ours, lambda m: m(ids, ids)),
                             ("transformers", theirs, lambda m: m(input_ids=ids, labels=ids).loss)):
        opt = _optimizer(model, a.adamw)

        def step(model=model, fwd=fwd, opt=opt) -> float:
            opt.zero_grad(set_to_none=True)
            loss = fwd(model)
            loss.backward()
            opt.step()
            return float(loss.detach())

        steps[name] = step
    first = {name: step() for name, step in steps.items()}
    print(f"first-step loss: plait {first['plait']:.6f}, transformers {first['transformers']:.6f}", flush=True)
    for _ in range(a.warmup - 1):
        for step in steps.values():
            step()
    tokens = a.batch * a.seq
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(a.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            t = time.perf_counter()
            for _ in range(a.steps):
                steps[name]()
            rates[name].append(tokens * a.steps / (time.perf_counter() - t))
    med = {name: statistics.median(v) for name, v in rates.items()}
    best = {name: max(v) for name, v in rates.items()}
    rows = [[f"{med['plait']:.0f}", f"{med['transformers']:.0f}", f"{med['plait'] / med['transformers']:.2f}",
             f"{best['plait']:.0f}", f"{best['transformers']:.0f}", f"{best['plait'] / best['transformers']:.2f}",
             f"{min(rates['plait']):.0f}-{max(rates['plait']):.0f}",
             f"{min(rates['transformers']):.0f}-{max(rates['transformers']):.0f}"]]
    table = markdown_table(["plait tok/s (median)", "transformers tok/s (median)", "ratio of medians",
                            "plait best", "transformers best", "ratio of bests", "plait range",
                            "transformers range"], rows)
    if a.profile:
        table += "".join(f"\n\n{_profile(step, name)}" for name, step in steps.items())
    return table


def _ep_worker(rank: int, world: int, a: argparse.Namespace) -> None:
    """Times both layouts on this rank; rank 0 prints the table."""
    config = config_of(a)
    ids = batch_of(a, config)[rank::world]  # each DP rank its half of the batch
    spent = [0.0]
    real = a2a_module.exchange

    def timed(x, group):
        t = time.perf_counter()
        out = real(x, group)
        spent[0] += time.perf_counter() - t
        return out

    def timed_variable(x, send, receive, group):
        t = time.perf_counter()
        out = real_variable(x, send, receive, group)
        spent[0] += time.perf_counter() - t
        return out

    real_variable = exact_dispatch._exchange
    a2a_module.exchange = timed  # type: ignore[assignment]  # the forward and backward exchanges
    expert_parallel.exchange = timed  # type: ignore[assignment]  # the count exchange
    exact_dispatch.exchange = timed  # type: ignore[assignment]  # moe.dispatch=exact: its count exchange
    exact_dispatch._exchange = timed_variable  # type: ignore[assignment]  # and its variable-split rows
    res = {}
    layouts = {"EP=1": (1, None), "EP=2 (static slots)": (2, None),
               "EP=2 (moe.dispatch=exact)": (2, exact_dispatch.ExactAllToAllDispatcher)}
    for name, (ep, dispatcher) in layouts.items():
        mesh = ParallelMesh(world, rank, dp=world, ep=ep)
        model = build_model(config, mesh, seed=0).train()
        expert_parallel.apply_expert_parallel([model], mesh.info("ep"))
        if dispatcher is not None:
            for _, layer in moe_layers([model]):
                layer.dispatcher = dispatcher(mesh.info("ep"))
        for _ in range(a.warmup):
            model(ids, ids).backward()
        times, shares = [], []
        for _ in range(a.rounds * a.steps):
            model.zero_grad(set_to_none=True)
            spent[0] = 0.0
            torch.distributed.barrier()
            t = time.perf_counter()
            model(ids, ids).backward()
            dt = time.perf_counter() - t
            times.append(dt)
            shares.append(spent[0] / dt)
        res[name] = (statistics.median(times), statistics.median(shares))
    if rank != 0:
        return
    tokens = a.batch * a.seq
    rows = [[name, f"{t * 1000:.0f}", f"{tokens / t:.0f}", f"{100 * share:.1f}%"] for name, (t, share) in res.items()]
    one = res["EP=1"][0]
    rows += [[f"{name} / EP=1", f"{res[name][0] / one:.2f}x time", f"{one / res[name][0]:.2f}x", ""]
             for name in list(layouts)[1:]]
    table = markdown_table(["layout (2 ranks, DP=2)", "ms per fwd+bwd (rank 0)", "tok/s (2 ranks)",
                            "all-to-all share"], rows)
    print(f"\n## two ranks (1 thread each), forward + backward, median of {a.rounds * a.steps}\n\n{table}\n",
          flush=True)


def expert_parallel_pair(a: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=gloo_rank_entry, args=(r, 2, port, _ep_worker, (a,))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit("a rank failed (see its traceback above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--part", choices=["single", "ep", "both"], default="both")
    parser.add_argument("--adamw", choices=["fused", "loop"], default="fused",
                        help="one process: torch AdamW with fused=True (default) or its per-tensor loop")
    parser.add_argument("--profile", action="store_true", help="one process: add each side's operator table")
    a = parser.parse_args()
    for key, value in (SMOKE if a.smoke else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    torch.set_num_threads(a.threads)
    config = config_of(a)
    active = config.num_parameters() - a.layers * (a.experts - a.top_k) * 3 * a.hidden * a.intermediate
    print(f"Mixtral: {a.layers} layers, hidden {a.hidden}, {a.experts} experts of {a.intermediate} (top-{a.top_k}),"
          f" vocab {a.vocab}; {config.num_parameters() / 1e6:.1f}M parameters ({active / 1e6:.1f}M active); "
          f"batch {a.batch} x {a.seq}; torch {torch.__version__}, {platform.processor() or platform.machine()}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if a.part in ("single", "both"):
        table = single_process(a)
        print(f"\n## one process, {a.threads} threads, fp32 training step, AdamW {a.adamw}, {a.rounds} rounds of "
              f"{a.steps} steps (load average after: {os.getloadavg()[0]:.1f})\n\n{table}\n", flush=True)
    if a.part in ("ep", "both"):
        expert_parallel_pair(a)


if __name__ == "__main__":
    main()
