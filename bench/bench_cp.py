"""Context parallelism: ring attention with and without overlap, the all-gather variant, the step
time of cp=2 against cp=1 at the same global tokens, and the attention imbalance of packed rows.

What is measured:

1. *Attention* (2 gloo ranks, one thread each): forward + backward of this rank's share of causal
   GQA attention over ``--attn-seq`` tokens, for the ring with transfers overlapped with compute,
   the ring waiting for each transfer before computing (``overlap=False``), and the all-gather
   variant; the same kernel at cp=1 on the whole sequence (rank 0 alone, one thread, while rank 1
   waits) is the baseline. Variants alternate within each round; medians over rounds.
2. *Step* (model forward + backward, no optimizer): the benchmark model on ``--batch`` sequences
   of ``--seq`` tokens at cp=1 (rank 0 alone) and at cp=2 (two ranks, each holding half of every
   sequence, with the gradient all-reduce over cp that the data-parallel reduction does), in the
   same alternating rounds. Same global tokens; the ratio is cp=2 time over cp=1 time (0.5 would
   be perfect scaling: cp=2 uses twice the cores).
3. *Imbalance* (no processes): attention work (query-key pairs, proportional to FLOPs) per cp
   rank, ``max / mean``, for rows packed from log-normal document lengths (``--median``,
   ``--sigma``) at ``--pack-seq`` tokens: the fixed zigzag split, plait's work-balanced split of
   packed rows, and contiguous chunks; one-document rows for contrast.

Run (from the repository root)::

    python bench/bench_cp.py            # all three
    python bench/bench_cp.py --smoke    # tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_model_args, make_config, markdown_table, resolve_args, spawn_gloo_ranks  # noqa: E402
from plait.comm.primitives import GroupInfo  # noqa: E402
from plait.context_parallel import RingExchange, SequenceSplit, allgather_attention, ring_attention  # noqa: E402
from plait.context_parallel.apply import apply_context_parallel  # noqa: E402
from plait.context_parallel.attention import ContextParallel  # noqa: E402
from plait.context_parallel.balance import attention_work, balanced_split, imbalance  # noqa: E402
from plait.context_parallel.batch import split_token_batch  # noqa: E402
from plait.data.batch import TokenBatch  # noqa: E402
from plait.materialize import build_model  # noqa: E402
from plait.mesh import ParallelMesh, single_process_mesh  # noqa: E402

CP = 2
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


# ------------------------------------------------------------------ 1. attention
def _qkv(seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g), torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g),
            torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g), torch.randn(1, HEADS, seq, HEAD_DIM, generator=g))


def _attention_step(fn, q, k, v, dout) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(dout)


def _time(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def _attention_variants(rank: int, world: int, seq: int):
    info = GroupInfo(dist.group.WORLD, rank, world)
    split = SequenceSplit(seq, world)
    q, k, v, dout = (split.split(t, rank, dim=2) for t in _qkv(seq))
    ring = RingExchange(info, list(range(world)), overlap=True)
    serial = RingExchange(info, list(range(world)), overlap=False)
    return {
        "ring (overlap)": lambda: _attention_step(lambda a, b, c: ring_attention(a, b, c, split, ring), q, k, v, dout),
        "ring (no overlap)": lambda: _attention_step(lambda a, b, c: ring_attention(a, b, c, split, serial),
                                                     q, k, v, dout),
        "allgather": lambda: _attention_step(lambda a, b, c: allgather_attention(a, b, c, split, info), q, k, v, dout),
    }


def _rounds(variants: dict, rounds: int, steps: int, warmup: int, rank: int, solo: frozenset = frozenset()
            ) -> dict[str, float]:
    """Median seconds per step of each variant; variants alternate within each round (the first one
    rotates). A ``solo`` variant runs on rank 0 alone while the other ranks wait (the cp=1 baseline,
    timed in the same rounds as the cp=2 variants)."""
    def run(name: str) -> float | None:
        dist.barrier()
        t = _time(variants[name], steps) if (name not in solo or rank == 0) else None
        dist.barrier()
        return t

    for name in variants:
        for _ in range(warmup):
            if name not in solo or rank == 0:
                variants[name]()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = run(name)
            if t is not None:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items() if t}


# ------------------------------------------------------------------ 2. step
def _batch(args, seed: int = 1) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    return TokenBatch(input_ids=torch.randint(0, args.vocab, (1, args.batch, args.seq), generator=g))


def _model_step(model, tb: TokenBatch, reduce=None) -> None:
    loss = model(tb.input_ids[0], tb.labels[0] if tb.labels is not None else tb.input_ids[0],
                 position_ids=None if tb.position_ids is None else tb.position_ids[0])
    loss.backward()
    if reduce is not None:
        reduce(model)
    model.zero_grad(set_to_none=True)


def _cp_model_step(rank: int, world: int, args):
    config = make_config(args)
    mesh = ParallelMesh(world, rank, cp=world)
    model = build_model(config, mesh, seed=args.seed)
    cp = ContextParallel(mesh.info("cp"), tuple(mesh.my_group_ranks("cp")))
    apply_context_parallel([model], cp, args.seq)
    tb = split_token_batch(_batch(args), cp.split(args.seq), rank)

    def reduce(m):
        flat = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])
        dist.all_reduce(flat)

    return lambda: _model_step(model, tb, reduce)


# ------------------------------------------------------------------ workers
def _single_attention(seq: int):
    split = SequenceSplit(seq, 1)
    q, k, v, dout = _qkv(seq)
    one = RingExchange(GroupInfo.single(), [0])
    return lambda: _attention_step(lambda a, b, c: ring_attention(a, b, c, split, one), q, k, v, dout)


def _single_model_step(args):
    model = build_model(make_config(args), single_process_mesh(), seed=args.seed)
    tb = _batch(args)
    return lambda: _model_step(model, tb)


def worker(rank: int, world: int, args) -> None:
    attn = _attention_variants(rank, world, args.attn_seq)
    attn["cp=1 (same kernel, 1 rank)"] = _single_attention(args.attn_seq) if rank == 0 else None
    solo = frozenset({"cp=1 (same kernel, 1 rank)", "cp=1 model step (1 rank)"})
    attn_t = _rounds(attn, args.rounds, args.steps, args.warmup, rank, solo)
    steps = {"cp=2 model step": _cp_model_step(rank, world, args),
             "cp=1 model step (1 rank)": _single_model_step(args) if rank == 0 else None}
    step_t = _rounds(steps, args.rounds, args.steps, args.warmup, rank, solo)
    if rank == 0:
        torch.save({"attention": attn_t, "step": step_t}, args.out)


# ------------------------------------------------------------------ 3. imbalance
def packed_rows(rows: int, seq: int, median: float, sigma: float, seed: int = 0) -> torch.Tensor:
    """Segment ids of ``rows`` rows filled in order with log-normal document lengths (clipped to
    ``[16, seq]``); a document that does not fit starts the next row; the tail is padding (-1)."""
    rng = np.random.default_rng(seed)
    out = torch.full((rows, seq), -1, dtype=torch.long)
    row = at = seg = 0
    while row < rows:
        n = int(np.clip(rng.lognormal(np.log(median), sigma), 16, seq))
        if at + n > seq:
            row, at, seg = row + 1, 0, 0
            continue
        out[row, at:at + n] = seg
        at, seg = at + n, seg + 1
    return out


def imbalance_table(args) -> str:
    rows = packed_rows(args.pack_rows, args.pack_seq, args.median, args.sigma)
    one_doc = torch.zeros(1, args.pack_seq, dtype=torch.long)
    table = []
    for cp in (2, 4, 8):
        zigzag, contiguous = SequenceSplit(args.pack_seq, cp), SequenceSplit(args.pack_seq, cp, zigzag=False)
        cells = [str(cp), f"{imbalance(attention_work(one_doc, zigzag)):.3f}",
                 f"{imbalance(attention_work(one_doc, contiguous)):.3f}"]
        for kind in ("zigzag", "balanced", "contiguous"):
            per_row = []
            for i in range(rows.shape[0]):
                row = rows[i:i + 1]
                split = {"zigzag": zigzag, "contiguous": contiguous}.get(kind) or balanced_split(row, cp)
                per_row.append(imbalance(attention_work(row, split)))
            cells += [f"{statistics.mean(per_row):.3f}", f"{max(per_row):.3f}"]
        table.append(cells)
    header = ["cp", "1 doc/row: zigzag", "1 doc/row: contiguous", "packed: zigzag mean", "zigzag worst",
              "packed: balanced mean", "balanced worst", "packed: contiguous mean", "contiguous worst"]
    docs = int((rows.max(dim=1).values + 1).sum())
    return (f"attention work max/mean over cp ranks, rows of {args.pack_seq} tokens; packed: {args.pack_rows} rows "
            f"holding {docs} documents (log-normal lengths, median {args.median}, sigma {args.sigma}); "
            f"balanced = plait's split of packed rows (chunk pairs by work)\n\n" + markdown_table(header, table))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--attn-seq", type=int, default=None, help="tokens of the attention benchmark (default 4096)")
    parser.add_argument("--pack-seq", type=int, default=8192, help="row length of the imbalance table")
    parser.add_argument("--pack-rows", type=int, default=64, help="packed rows of the imbalance table")
    parser.add_argument("--median", type=float, default=600.0, help="median document length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of document lengths")
    parser.add_argument("--imbalance-only", action="store_true", help="print the imbalance table and stop")
    args = resolve_args(parser.parse_args(argv))
    if args.attn_seq is None:
        args.attn_seq = 256 if args.smoke else 4096
    if args.smoke:
        args.pack_seq, args.pack_rows = 512, 8
    print(imbalance_table(args), flush=True)
    if args.imbalance_only:
        return
    args.out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_cp_{os.getpid()}.pt")
    spawn_gloo_ranks(CP, worker, (args,))
    ranks = torch.load(args.out)
    os.remove(args.out)
    attention = ranks["attention"]
    base = attention.pop("cp=1 (same kernel, 1 rank)")
    rows = [[name, f"{t * 1e3:.1f}", f"{t / base:.2f}"] for name, t in
            [("cp=1 (same kernel, 1 rank)", base), *attention.items()]]
    print(f"\nattention forward+backward, {args.attn_seq} tokens, {HEADS} heads / {KV_HEADS} kv heads of dim "
          f"{HEAD_DIM}, one thread per rank, medians of {args.rounds} rounds x {args.steps} steps\n", flush=True)
    print(markdown_table(["variant", "ms per step", "vs cp=1"], rows), flush=True)
    one, two = ranks["step"]["cp=1 model step (1 rank)"], ranks["step"]["cp=2 model step"]
    config = make_config(args)
    print(f"\nmodel forward+backward, {config.num_parameters() / 1e6:.1f}M params, batch {args.batch} x seq "
          f"{args.seq} (same global tokens at cp=1 and cp=2), one thread per rank\n", flush=True)
    print(markdown_table(["layout", "ms per step", "cp=2 / cp=1"],
                         [["cp=1 (1 rank)", f"{one * 1e3:.1f}", "1.00"],
                          ["cp=2 (2 ranks)", f"{two * 1e3:.1f}", f"{two / one:.2f}"]]), flush=True)

if __name__ == "__main__":
    main()
