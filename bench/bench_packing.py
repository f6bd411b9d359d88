"""Fine-tuning throughput with and without packing, on a realistic sample-length distribution.

What is measured: *real* (non-padding) tokens trained per second by a full SFT training step of
plait's model in one process (forward with the masked loss, backward, AdamW), for the same
samples laid out two ways by :func:`plait.data.packing.pack`: one sample per row (padded to
``--seq``; the common default of fine-tuning stacks) and packed (several samples per row,
document mask and restarting positions). The peer is therefore the unpacked layout, run side by
side in this script.

Sample lengths are drawn from a log-normal distribution (``--median`` tokens, ``--sigma``)
clipped to ``[--min-len, --seq]``, the long-tailed shape of instruction datasets (most answers
short, a few near the limit); the loss covers the last 70% of each sample (a prompt of 30%).
Both layouts train on the same samples in the same order; each round times ``--steps`` steps of
each layout (alternating which goes first), and the table gives medians over rounds.

Run (from the repository root)::

    python bench/bench_packing.py            # ~22M-parameter model, seq 512
    python bench/bench_packing.py --smoke    # tiny end-to-end check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_model_args, describe, make_config, markdown_table, resolve_args  # noqa: E402
from plait.data.packing import PackedRows, pack  # noqa: E402
from plait.data.sft_tokenize import Sample  # noqa: E402
from plait.materialize import build_model  # noqa: E402
from plait.mesh import single_process_mesh  # noqa: E402


def samples(n: int, vocab: int, seq: int, median: float, sigma: float, min_len: int, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(np.log(median), sigma, n)).astype(int), min_len, seq)
    out = []
    for i, n_tok in enumerate(lengths):
        ids = rng.integers(1, vocab, n_tok).astype(np.int32)
        mask = np.zeros(n_tok, dtype=bool)
        mask[int(0.3 * n_tok):] = True
        out.append(Sample(ids, mask, f"sample {i}"))
    return out


def batches(rows: PackedRows, batch: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for start in range(0, rows.num_rows - batch + 1, batch):
        part = {k: torch.from_numpy(getattr(rows, k)[start:start + batch].astype(np.int64))
                for k in ("input_ids", "labels", "position_ids", "segment_ids")}
        out.append(part)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--samples", type=int, default=400, help="samples drawn (default 400)")
    parser.add_argument("--median", type=float, default=120, help="median sample length in tokens (default 120)")
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the lengths (default 0.8)")
    parser.add_argument("--min-len", type=int, default=16, help="shortest sample (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    args = parser.parse_args()
    if args.seq is None and not args.smoke:
        args.seq = 512
    if args.batch is None and not args.smoke:
        args.batch = 4
    args = resolve_args(args)
    torch.set_num_threads(args.threads)
    config = make_config(args)
    if args.smoke:
        args.median, args.min_len = 12, 4
    data = samples(args.samples, config.vocab_size, args.seq, args.median, args.sigma, min(args.min_len, args.seq),
                   args.seed)
    layouts = {"unpacked (one sample per row)": pack(data, args.seq, pad_id=0, packed=False),
               "packed": pack(data, args.seq, pad_id=0, packed=True)}
    models = {name: build_model(config, single_process_mesh(), seed=args.seed) for name in layouts}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    feeds = {name: batches(rows, args.batch) for name, rows in layouts.items()}
    cursor = dict.fromkeys(layouts, 0)

    def step(name: str) -> int:
        b = feeds[name][cursor[name] % len(feeds[name])]
        cursor[name] += 1
        model, opt = models[name], optims[name]
        opt.zero_grad(set_to_none=True)
        loss = model(b["input_ids"], b["labels"], position_ids=b["position_ids"], segment_ids=b["segment_ids"])
        loss.backward()
        opt.step()
        return int((b["segment_ids"] >= 0).sum())

    for name in layouts:
        for _ in range(args.warmup):
            step(name)
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
        for name in order:
            real, start = 0, time.perf_counter()
            for _ in range(args.steps):
                real += step(name)
            rates[name].append(real / (time.perf_counter() - start))
    print(describe(config, args))
    print(f"{args.samples} samples, lengths log-normal (median {args.median:g}, sigma {args.sigma:g}) clipped to "
          f"[{args.min_len}, {args.seq}]; batch {args.batch} rows of {args.seq}; {args.threads} threads")
    rows = []
    base = statistics.median(rates["unpacked (one sample per row)"])
    for name, rows_of in layouts.items():
        med = statistics.median(rates[name])
        rows.append([name, str(rows_of.num_rows), f"{rows_of.efficiency:.1%}", f"{med:,.0f}",
                     f"{min(rates[name]):,.0f}-{max(rates[name]):,.0f}", f"{med / base:.2f}"])
    print(markdown_table(["layout", "rows", "real tokens / row tokens", "median real tokens/s", "range",
                          "ratio to unpacked"], rows))


if __name__ == "__main__":
    main()
