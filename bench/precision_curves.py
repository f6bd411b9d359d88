"""Loss curves of the precision presets on real text: why bf16-pure needs stochastic rounding.

Runs ``plait train`` (the real command, one process each) with the same small model, data and
constant low learning rate under:

* ``bf16-mixed`` - bf16 weights and compute, fp32 master weights and optimizer state;
* ``bf16-pure`` - bf16 weights and optimizer state, stochastic rounding of the update;
* ``bf16-pure`` without stochastic rounding (the ``manual`` preset with the same knobs);
* optionally ``fp32`` (``--with-fp32``).

At a learning rate where most AdamW updates are below half the bf16 spacing of the weights
they change, round-to-nearest drops them and training stalls; stochastic rounding keeps them in
expectation. Prints the final losses and their gaps to ``bf16-mixed`` and writes a plot.

    python bench/precision_curves.py --out docs/precision_curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUNS = {
    "bf16-mixed": ["precision.preset=bf16-mixed"],
    "bf16-pure (stochastic rounding)": ["precision.preset=bf16-pure"],
    "bf16-pure, round to nearest": ["precision.preset=manual", "precision.param_dtype=bf16",
                                    "precision.grad_dtype=bf16", "precision.master_weights=false",
                                    "precision.stochastic_rounding=false"],
}


def run(name: str, overrides: list[str], common: list[str], out_root: Path) -> list[dict]:
    out = out_root / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    cmd = [sys.executable, "-m", "plait.cli", "train", *common, *overrides, f"run.output_dir={out}"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, records in curves.items():
        pts = [(r["step"], r["loss"]) for r in records if "loss" in r]
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=name, linewidth=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-4, help="constant learning rate (default 1e-4)")
    parser.add_argument("--out", type=Path, default=Path("runs/precision_curves.png"), help="plot file")
    parser.add_argument("--work", type=Path, default=Path("runs/precision_curves"), help="run directories")
    parser.add_argument("--with-fp32", action="store_true", help="also run the fp32 preset")
    parser.add_argument("--smoke", action="store_true", help="6 steps (end-to-end check only)")
    args = parser.parse_args()
    steps = 6 if args.smoke else args.steps
    common = ["parallel.tp=1", "parallel.sequence_parallel=false", f"train.steps={steps}", "scheduler.name=constant",
              f"scheduler.warmup_steps={min(10, steps)}", f"optimizer.lr={args.lr}", "model.hidden_size=128",
              "model.intermediate_size=384", "data.seq_len=64", "data.micro_batch_size=8", "train.log_every=2",
              f"train.eval_every={steps}", "train.sample_tokens=0", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.plot=false", "checkpoint.save_final=false"]
    runs = dict(RUNS)
    if args.with_fp32:
        runs = {"fp32": ["precision.preset=fp32"], **runs}
    curves = {name: run(name, o, common, args.work) for name, o in runs.items()}
    first = {name: records[0]["loss"] for name, records in curves.items()}
    final = {name: records[-1]["loss"] for name, records in curves.items()}
    ref = final["bf16-mixed"]
    print(f"\n{steps} steps, constant lr {args.lr}, model 128 wide x 4 layers, seq 64 x 8 sequences")
    print("| run | first logged loss | final loss | final - bf16-mixed | loss drop / bf16-mixed's |")
    print("|---|---|---|---|---|")
    drop_ref = first["bf16-mixed"] - ref
    for name in curves:
        drop = first[name] - final[name]
        print(f"| {name} | {first[name]:.4f} | {final[name]:.4f} | {final[name] - ref:+.4f} | "
              f"{drop / drop_ref:.2f} |")
    plot(curves, args.out, f"constant lr {args.lr}: bf16 updates below half the bf16 spacing")
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
