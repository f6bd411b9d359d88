"""plait's CUDA paths on one GPU: packed-sequence equivalence, and training runs through `plait train`.

Run on a machine with one CUDA GPU (from the repository root, ``PYTHONPATH=src``)::

    python bench/cuda_smoke.py --data PREPARED_TEXT_DIR --out OUT_DIR

1. Packed rows on the GPU: a tiny Llama in fp32 gives each packed sample the logits and weight
   gradients it gets alone (the CPU test's check, on CUDA's SDPA kernels).
2. ``plait train`` of the default model on one GPU (one process, NCCL world of 1) on a prepared
   text directory: fp32 and bf16-mixed, tokens/s and MFU from the run's metrics.
3. ``plait train`` SFT with packing and LoRA (bf16-mixed) on the arithmetic task with a small
   ChatML BPE, then DPO with the ``frozen`` reference: they must run and learn (loss falls).

Prints one line per check and a table; writes the runs' metrics under ``--out``.

``--smoke`` (an end-to-end check of this script, on the CPU when there is no GPU): check 1 on the
available device, one 3-step ``plait train`` of a tiny model, and the other runs' recipes only
validated (:func:`plait.config.validate_recipe`), not trained. ``--json FILE`` also writes the
results as JSON (``bench/device_check.py`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from plait.data.tasks import write_task_files
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.llama.config import LlamaConfig


def packed_equivalence(device: str = "cuda") -> dict[str, float]:
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = build_model(config, single_process_mesh(), seed=3, device=device)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 9, 7]
    samples = [torch.randint(1, 97, (n,), generator=gen).to(device) for n in lengths]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(device)
    worst_logits, worst_grad = 0.0, 0.0
    at = 0
    for s in samples:
        labels = torch.full_like(ids, -100)
        labels[0, at + 1:at + len(s)] = ids[0, at + 1:at + len(s)]
        model.zero_grad()
        packed = model(ids, labels, position_ids=positions, segment_ids=segments, loss_normalizer=1.0)
        packed.backward()
        packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            packed_logits = model(ids, position_ids=positions, segment_ids=segments)[0, at:at + len(s)]
        model.zero_grad()
        alone = model(s[None], s[None], loss_normalizer=1.0)
        alone.backward()
        with torch.no_grad():
            alone_logits = model(s[None])[0]
        worst_logits = max(worst_logits, float((packed_logits - alone_logits).abs().max()))
        worst_grad = max(worst_grad, max(float((packed_grads[n] - p.grad).abs().max())
                                         for n, p in model.named_parameters()))
        at += len(s)
    return {"max_logit_diff": worst_logits, "max_grad_diff": worst_grad}


def plait_train(name: str, out: Path, items: list[str], timeout: int) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "plait.cli", "train", "--nproc", "1", f"run.output_dir={run_dir}",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false", *items]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    metrics = []
    if (run_dir / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "loss" in m]
    return {"name": name, "status": proc.returncode, "wall_s": round(wall, 1),
            "first_loss": train[0]["loss"] if train else None, "last_loss": train[-1]["loss"] if train else None,
            "tokens_per_s": max((m.get("tokens_per_s", 0) for m in train), default=None),
            "mfu": max((m.get("mfu", 0) for m in train), default=None),
            "peak_memory_gb": max((m.get("peak_memory_gb", 0) for m in train), default=None),
            "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None)}


def chat_tokenizer(path: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


#: ``--smoke``: a tiny model and 3 steps (the last of these overrides win over the runs' own)
SMOKE_ITEMS = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.intermediate_size=64",
               "model.num_attention_heads=2", "model.num_key_value_heads=1", "data.micro_batch_size=2",
               "data.seq_len=32", "train.steps=3", "train.eval_every=3", "train.log_every=1",
               "train.sample_tokens=2", "scheduler.warmup_steps=0"]


def validate_only(name: str, items: list[str]) -> dict:
    """``--smoke``: the run's recipe checked as ``plait train`` checks it (one process), not trained."""
    from plait.config import recipe_data, validate_recipe
    from plait.config.load import DEFAULT_RECIPE

    try:
        validate_recipe(recipe_data(DEFAULT_RECIPE, items), 1)
        return {"name": name, "validated": True}
    except (ValueError, FileNotFoundError) as e:  # RecipeError is a ValueError
        return {"name": name, "validated": False, "error": " ".join(str(e).split())[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a prepared text directory (plait data prepare)")
    parser.add_argument("--out", required=True, help="where the runs and logs go")
    parser.add_argument("--smoke", action="store_true",
                        help="end-to-end check: tiny sizes, CPU without a GPU, one run trained, the others validated")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PLAIT_CACHE", str(out / "cache"))
    device = "cuda" if not args.smoke or torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}", flush=True)
    packed = packed_equivalence(device)
    print(f"packed rows on {'CUDA' if device == 'cuda' else 'the CPU'} (fp32):", packed, flush=True)
    base = [f"data.source={args.data}", "parallel.tp=1", "parallel.sequence_parallel=false", "train.steps=200",
            "train.eval_every=200", "train.log_every=20", "data.micro_batch_size=32", "data.seq_len=256",
            "train.sample_tokens=16"]
    smoke = SMOKE_ITEMS if args.smoke else []
    results = [plait_train("default-fp32", out, base + ["precision.preset=fp32"] + smoke, 300)]
    validated = []
    if args.smoke:
        validated.append(validate_only("default-bf16-mixed", base + ["precision.preset=bf16-mixed"] + smoke))
    else:
        results.append(plait_train("default-bf16-mixed", out, base + ["precision.preset=bf16-mixed"], 300))
    task = write_task_files(out / "task", seed=0, train=2000, heldout=50)
    chat_tokenizer(out / "task" / "tokenizer.json", task["sft_train"].read_text())
    tiny = ["model.hidden_size=256", "model.num_hidden_layers=4", "model.num_attention_heads=8",
            "model.num_key_value_heads=4", "model.intermediate_size=768", "model.max_position_embeddings=512",
            "parallel.tp=1", "parallel.sequence_parallel=false", f"data.tokenizer={out / 'task' / 'tokenizer.json'}",
            "data.seq_len=512", "data.micro_batch_size=16", "train.steps=150", "train.eval_every=150",
            "train.log_every=10", "precision.preset=bf16-mixed", "train.sample_tokens=0", "scheduler.warmup_steps=10"]
    fine_tuning = {
        "sft-packed-lora": tiny + [
            f"data.source={task['sft_train']}", "data.format=sft", "train.objective=sft", "lora.rank=16",
            "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "optimizer.lr=3e-3"],
        "dpo-frozen": tiny + [
            f"data.source={task['preference_train']}", "data.format=preference", "train.objective=dpo",
            "preference.reference=frozen", "optimizer.lr=1e-4", "train.steps=60", "train.eval_every=60"]}
    for name, items in fine_tuning.items():
        if args.smoke:
            validated.append(validate_only(name, items))
        else:
            results.append(plait_train(name, out, items, 300))
    for r in results + validated:
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "packed": packed, "runs": results,
                                               "validated": validated}, indent=1))


if __name__ == "__main__":
    main()
