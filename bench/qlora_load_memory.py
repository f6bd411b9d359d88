"""Peak host memory of building a QLoRA model from a Hugging Face directory: whole vs streamed.

``whole``: the stage is allocated and read in full in the parameter dtype, then quantized (what a
run would do without :mod:`plait.deferred`). ``streamed``: what ``plait train`` does with
``lora.quantize_base``: placeholders, then each projection read and quantized in turn, the other
weights filled whole. ``dense``: the plain LoRA build, for reference. Each variant runs in its
own process; the figure is that process's peak anonymous resident memory (``RssAnon``, sampled
every millisecond; the checkpoint files it maps are page cache, not counted) minus the same just
before the build (torch and plait imported).

Run: ``python bench/qlora_load_memory.py ~/.cache/plait/models/smollm2-135m-instruct``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _anon_mib() -> float:
    """This process's anonymous resident memory (heap; not the checkpoint files it maps)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakSampler:
    """The largest :func:`_anon_mib` seen every millisecond while it runs (a background thread)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon_mib())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_mib())


def child(directory: str, variant: str) -> None:
    import torch

    from plait.lora import LoraSettings, apply_lora
    from plait.materialize import build_stages, build_stages_deferred
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import load_hf_config
    from plait.quantize import quantize_base_

    config = load_hf_config(directory)
    layers = [list(range(config.num_hidden_layers))]
    settings = LoraSettings(rank=16, alpha=32.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"))
    before = _anon_mib()
    with PeakSampler() as sampler:
        if variant == "streamed":
            stages, values = build_stages_deferred(config, single_process_mesh(), layers, hf_path=directory)
            apply_lora(stages, settings, seed=0)
            summary = quantize_base_(stages, "nf4", values=values)
        else:
            stages = build_stages(config, single_process_mesh(), layers, hf_path=directory)
            apply_lora(stages, settings, seed=0)
            summary = quantize_base_(stages, "nf4") if variant == "whole" else None
    peak = sampler.peak
    held = sum(p.numel() * p.element_size() for s in stages for p in s.parameters()) / 2**20
    if summary is not None:
        held += summary.stored_bytes / 2**20
    print(json.dumps({"variant": variant, "peak_mib": peak - before, "held_mib": held,
                      "torch": torch.__version__}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--child", choices=("dense", "whole", "streamed"))
    args = p.parse_args()
    if args.child:
        child(args.directory, args.child)
        return 0
    rows = []
    for variant in ("dense", "whole", "streamed"):
        out = subprocess.run([sys.executable, __file__, args.directory, "--child", variant], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| build | weights held after (MiB) | peak anonymous memory growth during the build (MiB) |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['held_mib']:.0f} | {r['peak_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
