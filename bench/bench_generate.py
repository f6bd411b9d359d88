"""Generation speed: plait's KV-cache engine vs transformers ``generate(use_cache=True)``.

What is measured: wall time to generate exactly ``--new-tokens`` tokens greedily after each of
``--batch`` prompts (prefill included), on the same model, from the same Hugging Face directory
(default: the packaged SmolLM2-135M-Instruct), with the same prompts (the arithmetic task's
held-out questions in the model's chat template, different lengths, left-padded on both sides).
End-of-sequence stopping is off on both sides, so both produce the same number of tokens; with
it off the greedy tokens of both are compared and the share of equal rows is printed (fp32: all
equal is expected).

Contestants, alternated (the one going first alternates too) for ``--rounds`` rounds after one
untimed warm-up each:

* **plait**: :func:`plait.inference.generate_tokens` on :func:`plait.materialize.load_from_hf`;
* **transformers**: ``AutoModelForCausalLM.from_pretrained(dir).generate(ids, attention_mask=...,
  do_sample=False, use_cache=True, max_new_tokens=N, min_new_tokens=N)``;
* **plait uncached** (batch 1 only, ``--uncached``): :func:`plait.inference.generate_uncached`, the
  full-recompute path every command used before the engine.

Rows: batch 1 and ``--batch`` (default 16) in ``--dtypes`` (default fp32 and bf16). Table:
median tokens/s (new tokens of all rows / wall time), the plait/transformers ratio (> 1: plait
faster) and the per-round range. The header gives the commit, the CPU and whether it has native
bf16 (without it bf16 matmuls are emulated and slow on both sides), and the load average.

Run (from the repository root, venv active)::

    python bench/bench_generate.py
    python bench/bench_generate.py --smoke          # one short round, to check it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch


def _header() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "src", "bench"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
               "unknown CPU")
    bf16 = "avx512_bf16" in info
    return (f"commit {commit}{'+dirty' if dirty else ''}; {cpu}, {os.cpu_count()} cores, torch threads "
            f"{torch.get_num_threads()}, native bf16 (avx512_bf16) {'yes' if bf16 else 'no'}; load average "
            f"{os.getloadavg()[0]:.2f}")


def _prompts(model_dir: Path, count: int) -> list[list[int]]:
    """The chat-templated held-out questions of the arithmetic task, tokenized (lengths differ)."""
    from plait.data.chat_template import load_chat_template
    from plait.data.tasks import SYSTEM, Problem
    from plait.data.tokenizer import load_tokenizer_file

    tokenizer = load_tokenizer_file(model_dir / "tokenizer.json")
    template = load_chat_template(model_dir / "tokenizer.json", tokenizer)
    problems = [Problem(a, op, b) for a, op, b in [(48, "+", 17), (7, "*", 12), (93, "-", 5), (2, "+", 2)]]
    out = []
    for i in range(count):
        p = problems[i % len(problems)]
        question = p.question + " Show your work." * (i % 3)  # lengths differ: padding matters
        text = template.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                               add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def _plait(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from plait.inference import generate_tokens

    return [c.tokens for c in generate_tokens(model, prompts, new)]


def _hf(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, use_cache=True, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    return out[:, length:].tolist()


def _uncached(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    from plait.inference import generate_uncached

    return [generate_uncached(model, p, new) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="HF directory or packaged model name")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--uncached", action="store_true", help="also time the full-recompute path (batch 1)")
    parser.add_argument("--smoke", action="store_true", help="one round of 8 tokens, fp32, batch 1 and 2")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = parser.parse_args()
    if a.smoke:
        a.rounds, a.new_tokens, a.dtypes, a.batch = 1, 8, "fp32", 2
    from transformers import AutoModelForCausalLM

    from plait.materialize import load_from_hf
    from plait.mesh import single_process_mesh
    from plait.models.packaged import model_directory

    model_dir = model_directory(a.model)
    print(_header(), flush=True)
    print(f"model {model_dir}, {a.new_tokens} new tokens per row, greedy, {a.rounds} rounds\n", flush=True)
    rows = []
    for dtype_name in a.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        plait = load_from_hf(model_dir, single_process_mesh(), dtype=dtype).eval()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        for batch in (1, a.batch):
            prompts = _prompts(model_dir, batch)
            sides = {"plait": (_plait, plait), "transformers": (_hf, hf)}
            if a.uncached and batch == 1:
                sides["plait uncached"] = (_uncached, plait)
            outputs = {name: fn(m, prompts, a.new_tokens) for name, (fn, m) in sides.items()}  # warm-up
            same = sum(x == y for x, y in zip(outputs["plait"], outputs["transformers"], strict=True)) / batch
            times: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(a.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for name in order:
                    fn, m = sides[name]
                    start = time.perf_counter()
                    fn(m, prompts, a.new_tokens)
                    times[name].append(time.perf_counter() - start)
            tokens = batch * a.new_tokens
            med = {name: tokens / statistics.median(t) for name, t in times.items()}
            row = {"dtype": dtype_name, "batch": batch, "tokens_per_s": med,
                   "ratio_plait_vs_transformers": med["plait"] / med["transformers"],
                   "range_s": {name: [min(t), max(t)] for name, t in times.items()}, "same_tokens": same}
            if "plait uncached" in med:
                row["ratio_plait_vs_uncached"] = med["plait"] / med["plait uncached"]
            rows.append(row)
            extra = (f", vs uncached {row['ratio_plait_vs_uncached']:.2f}x ({med['plait uncached']:.1f} tok/s)"
                     if "ratio_plait_vs_uncached" in row else "")
            print(f"{dtype_name} batch {batch:>2}: plait {med['plait']:7.1f} tok/s, transformers "
                  f"{med['transformers']:7.1f} tok/s, plait/transformers {row['ratio_plait_vs_transformers']:.2f}x"
                  f"{extra}; rows with identical tokens {same:.0%} (load {os.getloadavg()[0]:.2f})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
