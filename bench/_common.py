"""Helpers shared by the benchmark scripts: model config from the CLI, the HF twin, timing, tables.

Not a benchmark itself. The scripts import it as ``_common`` (they put ``bench/`` on ``sys.path``
by being run as ``python bench/<script>.py``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from plait.models.llama.config import LlamaConfig

#: Default benchmark model: ~22M parameters (12.6M of them in the untied embedding and head),
#: GQA with 6 query and 2 K/V heads of dim 64. A 2-thread fp32 training step on 2 x 256 tokens
#: takes ~0.3 s on a 2-core AVX-512 Xeon VM (bf16 autocast ~1 s there: no native bf16 matmul).
DEFAULTS = dict(vocab=16384, hidden=384, intermediate=1024, layers=6, heads=6, kv_heads=2,
                batch=2, seq=256, rounds=5, steps=5, warmup=2)
#: ``--smoke``: a tiny model and short run that only checks the script end to end.
SMOKE = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
             batch=2, seq=32, rounds=2, steps=2, warmup=1)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model-size and run-length flags; unset flags take :data:`DEFAULTS` (or :data:`SMOKE`)."""
    g = parser.add_argument_group("model size (default: a ~22M-parameter Llama)")
    g.add_argument("--vocab", type=int, help=f"vocabulary size (default {DEFAULTS['vocab']})")
    g.add_argument("--hidden", type=int, help=f"hidden size (default {DEFAULTS['hidden']})")
    g.add_argument("--intermediate", type=int,
                   help=f"MLP intermediate size (default {DEFAULTS['intermediate']})")
    g.add_argument("--layers", type=int, help=f"decoder layers (default {DEFAULTS['layers']})")
    g.add_argument("--heads", type=int, help=f"query heads (default {DEFAULTS['heads']})")
    g.add_argument("--kv-heads", type=int, help=f"key/value heads (default {DEFAULTS['kv_heads']})")
    r = parser.add_argument_group("run length")
    r.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULTS['batch']})")
    r.add_argument("--seq", type=int, help=f"tokens per sequence (default {DEFAULTS['seq']})")
    r.add_argument("--rounds", type=int,
                   help=f"alternating rounds; medians are over rounds (default {DEFAULTS['rounds']})")
    r.add_argument("--steps", type=int,
                   help=f"timed training steps per implementation per round (default {DEFAULTS['steps']})")
    r.add_argument("--warmup", type=int,
                   help=f"untimed steps per implementation before round 1 (default {DEFAULTS['warmup']})")
    r.add_argument("--seed", type=int, default=0, help="weight-init and data seed (default 0)")
    r.add_argument("--foreach", action="store_true",
                   help="multi-tensor (foreach) AdamW on both sides (default: torch's CPU default, a per-tensor loop)")
    r.add_argument("--smoke", action="store_true", help="tiny model and short run (end-to-end check only)")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset size/run flags from :data:`SMOKE` (with ``--smoke``) or :data:`DEFAULTS`."""
    base = SMOKE if args.smoke else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def make_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                       rope_theta=10000.0, tie_word_embeddings=False)


def hf_twin(config: LlamaConfig, state_dict: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> nn.Module:
    """transformers' ``LlamaForCausalLM`` with ``config`` (SDPA attention, no KV cache) and these
    weights, built on ``device``."""
    import transformers

    hf_config = transformers.LlamaConfig(**config.to_hf_dict())
    hf_config.use_cache = False
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(state_dict, strict=True)
    return model.train()


def random_batch(config: LlamaConfig, batch: int, seq: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 12345)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=gen)


@dataclass
class Result:
    """Per-round measurements of one implementation (one entry per timed round)."""

    name: str
    tokens_per_s: list[float] = field(default_factory=list)
    #: CPU seconds per step (all threads / all ranks): less sensitive to other load than wall time
    cpu_s_per_step: list[float] = field(default_factory=list)
    first_loss: float | None = None
    #: the loss of one more step after the timed rounds (same trajectory on every side)
    last_loss: float | None = None
    #: seconds of compilation in the warm-up (compiled contestants only)
    compile_s: float | None = None

    def add(self, tokens: int, steps: int, wall_s: float, cpu_s: float) -> None:
        self.tokens_per_s.append(tokens / wall_s)
        self.cpu_s_per_step.append(cpu_s / steps)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def median_cpu_ms(self) -> float:
        return 1e3 * statistics.median(self.cpu_s_per_step)

    @property
    def spread(self) -> str:
        return f"{min(self.tokens_per_s):,.0f}-{max(self.tokens_per_s):,.0f}"


def time_steps(step: Callable[[], object], steps: int,
               sync: Callable[[], object] | None = None) -> tuple[float, float]:
    """``(wall seconds, CPU seconds of this process)`` for ``steps`` consecutive calls of ``step``.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clocks start and before they are read,
    so that on an asynchronous device the time covers the steps' kernels, not only their launches."""
    if sync is not None:
        sync()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    if sync is not None:
        sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def device_sync(device: str | torch.device) -> Callable[[], object] | None:
    """``torch.cuda.synchronize`` of ``device`` when it is a CUDA device, else ``None`` (CPU work is synchronous)."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def adamw(param_groups: list[list[torch.nn.Parameter]], foreach: bool) -> torch.optim.Optimizer:
    """AdamW (lr 1e-4, no weight decay). ``foreach=False`` is torch's CPU default (per-tensor loop).

    Parameters are passed as groups because a foreach step cannot mix DTensor and plain tensors.
    """
    groups = [{"params": g} for g in param_groups if g]
    return torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.0, foreach=foreach)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


TABLE_HEADER = ["plait tok/s", "{b} tok/s", "plait/{b}", "paired plait/{b}", "plait ms/step", "{b} ms/step",
                "plait CPU ms/step", "{b} CPU ms/step", "plait tok/s range", "{b} tok/s range"]


def comparison_row(ours: Result, theirs: Result, tokens_per_step: int) -> list[str]:
    """Table cells: median tok/s of each, ratio of the medians, median of the per-round ratios (each
    round's two runs are adjacent in time, so this one is the most robust to other load on the
    machine), median wall and CPU ms per step, per-round tok/s ranges."""
    paired = statistics.median(a / b for a, b in zip(ours.tokens_per_s, theirs.tokens_per_s, strict=True))
    return [f"{ours.median:,.0f}", f"{theirs.median:,.0f}", f"{ours.median / theirs.median:.3f}", f"{paired:.3f}",
            f"{1e3 * tokens_per_step / ours.median:.0f}", f"{1e3 * tokens_per_step / theirs.median:.0f}",
            f"{ours.median_cpu_ms:.0f}", f"{theirs.median_cpu_ms:.0f}", ours.spread, theirs.spread]


def comparison_header(first: str, other: str) -> list[str]:
    return [first] + [h.format(b=other) for h in TABLE_HEADER]


def describe(config: LlamaConfig, args: argparse.Namespace) -> str:
    return (f"model: {config.num_parameters() / 1e6:.1f}M params (vocab {config.vocab_size}, hidden "
            f"{config.hidden_size}, intermediate {config.intermediate_size}, {config.num_hidden_layers} layers, "
            f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads of dim {config.head_dim}); "
            f"batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens/step; "
            f"{args.rounds} rounds x {args.steps} timed steps after {args.warmup} warm-up steps; "
            f"torch {torch.__version__}")


def gloo_rank_entry(rank: int, world: int, port: int | None, fn: Callable, fn_args: tuple) -> None:
    """Process entry shared by the multi-rank benchmarks: one thread, gloo init, ``fn(rank, world,
    *fn_args)``, then ``destroy_process_group`` and ``os._exit`` (gloo can abort at interpreter exit).
    ``port=None`` means the launcher (torchrun) already set MASTER_ADDR/MASTER_PORT."""
    torch.set_num_threads(1)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        fn(rank, world, *fn_args)
    except BaseException:  # noqa: BLE001 - reported, then the process exits non-zero
        traceback.print_exc()
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def spawn_gloo_ranks(world: int, fn: Callable, fn_args: tuple) -> None:
    """Run ``fn(rank, world, *fn_args)`` on ``world`` spawned gloo ranks (:func:`gloo_rank_entry`)
    and wait for all; a failed rank ends the benchmark (its traceback is printed by the rank)."""
    ctx = mp.start_processes(gloo_rank_entry, args=(world, free_port(), fn, fn_args), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as exc:
        raise SystemExit(f"a rank failed ({exc}); its traceback is printed above") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
