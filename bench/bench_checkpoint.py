"""Checkpoint costs: the training-loop stall of an asynchronous save against a synchronous save of
the same state, save and load throughput, and the peak host memory of ``plait convert``.

One process, a Llama built with plait and one AdamW step taken (so the checkpoint holds weights
and both moments, 12 bytes per parameter in fp32):

* ``sync``: snapshot (host copy) + write + commit, all on the training thread;
* ``async``: the training thread only snapshots; the write runs on the background thread
  (timed separately until it has committed);
* ``load``: every tensor read back through the manifest (checksums verified);
* ``convert``: ``plait convert`` in a fresh process each way (plait -> HF, HF -> plait) on the
  model's checkpoint; peak RSS above the process's RSS after imports, against the model's size and
  its largest tensor.

    python bench/bench_checkpoint.py                 # ~300M parameters (1.2 GB of fp32 weights)
    python bench/bench_checkpoint.py --smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import markdown_table  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=256, tie_word_embeddings=False)
SMOKE = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)

CONVERT_CHILD = r"""
import json, sys, time
import tqdm, safetensors.torch
import plait.models.hf_io  # imported before the baseline: only the conversion's own memory counts
from plait.checkpoint.convert import hf_to_plait, plait_to_hf
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
base = rss()
t = time.perf_counter()
(plait_to_hf if sys.argv[1] == "hf" else hf_to_plait)(sys.argv[2], sys.argv[3], progress=False)
seconds = time.perf_counter() - t
with open("/proc/self/status") as f:  # VmHWM: this process's peak (ru_maxrss survives exec from the parent)
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))
print(json.dumps({"base": base, "peak": peak, "seconds": seconds}))
"""


def build(config_kw: dict):
    from plait.comm.primitives import GroupInfo
    from plait.data_parallel import DistributedOptimizer, OptimizerHyper
    from plait.materialize import build_model
    from plait.mesh import ParallelMesh
    from plait.models.llama.config import LlamaConfig
    from plait.precision import policy_for

    mesh = ParallelMesh(1, 0, create_groups=False)
    model = build_model(LlamaConfig(**config_kw), mesh)
    solo = GroupInfo(None, 0, 1)
    opt = DistributedOptimizer([model], policy_for("fp32"), OptimizerHyper(1e-4, 0.1, (0.9, 0.95), 1e-8),
                               dp=solo, tp=solo)
    ids = torch.randint(0, config_kw["vocab_size"], (1, 32))
    opt.grads.mark_final()
    model(ids, ids).backward()
    opt.grads.finish()
    opt.step()
    return mesh, model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    from plait.checkpoint.contents import model_config_dict
    from plait.checkpoint.reader import CheckpointReader
    from plait.checkpoint.writer import CheckpointWriter
    from plait.models.llama.config import LlamaConfig

    config_kw = SMOKE if args.smoke else MODEL
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="plait-bench-ckpt-"))
    torch.set_num_threads(2)
    mesh, model, opt = build(config_kw)
    params = sum(p.numel() for p in model.parameters())
    meta = {"train_step": 1, "optimizer_step": 1, "model_config": model_config_dict(LlamaConfig(**config_kw))}
    stalls, sync_times, async_writes, loads, first_snapshot = [], [], [], [], None
    nbytes = 0
    root = scratch / "checkpoints"
    writer = CheckpointWriter(root, rank=0, world=1, keep=2)
    for r in range(args.rounds):
        t = time.perf_counter()
        snap = writer.snapshot(2 * r + 1, [model], opt, mesh, meta, {"cpu": torch.get_rng_state()})
        if first_snapshot is None:  # the first snapshot allocates the staging buffers
            first_snapshot = time.perf_counter() - t
        writer.write(snap)
        sync_times.append(time.perf_counter() - t)
        nbytes = snap.nbytes
        del snap
        t = time.perf_counter()
        snap = writer.snapshot(2 * r + 2, [model], opt, mesh, meta, {"cpu": torch.get_rng_state()})
        writer.write_async(snap)
        stalls.append(time.perf_counter() - t)
        del snap
        writer.wait()
        async_writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        with CheckpointReader(root / f"step-{2 * r + 2:08d}") as reader:
            for key, info in reader.tensors.items():
                kind, name = key.split("/", 1)
                out = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
                reader.read_into(kind, name, out)
        loads.append(time.perf_counter() - t)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    mb = nbytes / 2**20
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint state {mb:.0f} MiB (weights + 2 AdamW moments, fp32); "
          f"{args.rounds} rounds, medians")
    rows = [["synchronous save (snapshot + write + commit)", f"{med(sync_times):.2f}", f"{mb / med(sync_times):.0f}"],
            ["asynchronous save: training-loop stall (snapshot)", f"{med(stalls):.2f}", "—"],
            ["asynchronous save: until committed", f"{med(async_writes):.2f}", f"{mb / med(async_writes):.0f}"],
            ["load (every tensor, checksums verified)", f"{med(loads):.2f}", f"{mb / med(loads):.0f}"]]
    print(markdown_table(["operation", "seconds", "MiB/s"], rows))
    print(f"\nstall of the asynchronous save / synchronous save: {med(stalls) / med(sync_times):.3f} "
          f"(the very first snapshot, which allocates the reused host staging buffers: {first_snapshot:.2f} s; "
          f"staging memory {mb:.0f} MiB, held for the run)")

    ckpt = root / f"step-{2 * args.rounds:08d}"
    hf = scratch / "hf"
    back = scratch / "back"
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    del model, opt
    results = {}
    for direction, src, dst in (("hf", ckpt, hf), ("plait", hf, back)):
        out = subprocess.run([sys.executable, "-c", CONVERT_CHILD, direction, str(src), str(dst)], check=True,
                             capture_output=True, text=True)
        results[direction] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nplait convert, model weights {model_bytes / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB")
    rows = []
    for direction, res in results.items():
        extra = res["peak"] - res["base"]
        rows.append(["plait -> HF" if direction == "hf" else "HF -> plait", f"{res['seconds']:.1f}",
                     f"{extra / 2**20:.0f}", f"{extra / model_bytes:.2f}", f"{extra / largest:.2f}"])
    print(markdown_table(["direction", "seconds", "peak RSS above start (MiB)", "/ model size", "/ largest tensor"],
                         rows))
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
