"""QLoRA against LoRA in one run: base-weight bytes per rank and training-step speed.

Contestants, all LoRA rank 16 on the seven projections of every block, adapters fp32:

* ``lora``: plait, the base as read (in ``--dtype``: bf16 is "bf16 LoRA", the usual reference);
* ``qlora-nf4`` / ``qlora-int8``: plait with ``lora.quantize_base`` (the base dequantized into
  ``--dtype`` inside each matmul);
* ``peer-torchao-nf4`` (``--peer``): transformers' Llama with every block projection's weight a
  torchao ``NF4Tensor`` (its own NF4 linear) under PEFT's LoRA, the usual QLoRA stack on a CPU.

Memory: the bytes of the frozen block projections on one tensor-parallel rank (what the issue's
goal, <= 0.30x of bf16, is about) at TP=1 and TP=2, read off models built on the meta device under
the fake process group (real shapes, no data), and the whole rank's parameter bytes.
Speed: tokens/s of a training step (forward, mean next-token loss, backward, AdamW on the
adapters) on one process; the contestants alternate for ``--rounds`` rounds of ``--steps`` steps
after ``--warmup`` steps, and the table gives medians and each one's ratio to ``lora``. The first
losses are printed: QLoRA's differ from LoRA's by the quantization error only.

Run: ``python bench/bench_qlora.py`` (SmolLM2-135M's widths, 4 layers), ``--smoke`` for a check.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch
import torch.distributed as dist

from _common import Result, adamw, hf_twin, markdown_table, random_batch, time_steps
from plait.lora import LoraSettings, apply_lora, lora_parameters
from plait.materialize import build_model
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.parallelize import kv_replication_for
from plait.quantize import quantize_base_, quantized_weights

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = LoraSettings(rank=16, alpha=32.0, target_modules=TARGETS)


def smollm2(layers: int, smoke: bool) -> LlamaConfig:
    if smoke:
        return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def rank_bytes(config: LlamaConfig, tp: int, method: str, dtype: torch.dtype) -> tuple[int, int]:
    """``(block projection bytes, all parameter bytes)`` of TP rank 0, on the meta device."""
    dist.init_process_group("fake", rank=0, world_size=tp)
    try:
        mesh = ParallelMesh(tp, 0, tp=tp, kv_replication=kv_replication_for(config, tp))
        model = build_model(config, mesh, device="meta", dtype=dtype, init=False)
        apply_lora([model], SETTINGS, seed=0)
        weights = [m.weight for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in TARGETS]
        projections = sum(w.numel() * w.element_size() for w in weights)
        if method != "none":
            quantize_base_([model], method, block_size=64)
            projections = sum(w.nbytes_stored() for _, w in quantized_weights([model]))
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        return projections, dense + sum(w.nbytes_stored() for _, w in quantized_weights([model]))
    finally:
        dist.destroy_process_group()


def plait_step(config: LlamaConfig, method: str, dtype: torch.dtype, ids: torch.Tensor):
    model = build_model(config, single_process_mesh(), seed=3, dtype=dtype)
    apply_lora([model], SETTINGS, seed=7)
    with torch.no_grad():  # non-zero B, so the adapters' path is the one trained
        for name, p in lora_parameters([model]):
            if name.endswith(".B"):
                p.normal_(0.0, 1e-3)
    if method != "none":
        quantize_base_([model], method, block_size=64)
    opt = adamw([[p for _, p in lora_parameters([model])]], foreach=False)
    return _stepper(lambda: model(ids, ids), opt)


def peer_step(config: LlamaConfig, dtype: torch.dtype, ids: torch.Tensor):
    """transformers + torchao NF4 weights + PEFT LoRA (fp32 adapters)."""
    import peft
    from torchao.quantization import to_nf4

    base = build_model(config, single_process_mesh(), seed=3)
    hf = hf_twin(config, base.state_dict()).to(dtype)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                weight = module.weight.detach().contiguous()
                blocks = weight.numel() // 64  # torchao needs a scaler block dividing them: the largest <= 256
                scaler = max(d for d in range(1, 257) if blocks % d == 0)
                module.weight = torch.nn.Parameter(to_nf4(weight, 64, scaler), requires_grad=False)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    opt = adamw([[p for p in model.parameters() if p.requires_grad]], foreach=False)
    return _stepper(lambda: model(input_ids=ids, labels=ids).loss, opt)


def _stepper(loss_fn, opt):
    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer", action="store_true", help="also torchao NF4 + PEFT on transformers' Llama")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.seq = 2, 1, 1, 32
    logging.getLogger("torchao").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = smollm2(args.layers, args.smoke)
    print(f"model: SmolLM2-135M widths, {config.num_hidden_layers} layers, {config.num_parameters() / 1e6:.1f}M "
          f"parameters; base {args.dtype}, adapters fp32; batch {args.batch} x seq {args.seq}; torch "
          f"{torch.__version__}; avx512_bf16: {'avx512_bf16' in open('/proc/cpuinfo').read()}")

    rows = []
    for tp in (1, 2):
        bf16, _ = rank_bytes(config, tp, "none", torch.bfloat16)
        for method in ("none", "nf4", "int8"):
            proj, total = rank_bytes(config, tp, method, torch.bfloat16)
            rows.append([f"TP={tp}", method, f"{proj / 2**20:.2f}", f"{proj / bf16:.3f}", f"{total / 2**20:.2f}"])
    print("\nper-rank bytes (base bf16 where not quantized; adapters fp32):")
    print(markdown_table(["layout", "base", "block projections MiB", "of bf16", "all parameters MiB"], rows))

    ids = random_batch(config, args.batch, args.seq, seed=0)
    steps = {"lora": plait_step(config, "none", dtype, ids), "qlora-nf4": plait_step(config, "nf4", dtype, ids),
             "qlora-int8": plait_step(config, "int8", dtype, ids)}
    if args.peer:
        steps["peer-torchao-nf4"] = peer_step(config, dtype, ids)
    results = {name: Result(name) for name in steps}
    for name, step in steps.items():
        results[name].first_loss = step()
        for _ in range(args.warmup - 1):
            step()
    tokens = args.batch * args.seq
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            wall, cpu = time_steps(steps[name], args.steps)
            results[name].add(tokens * args.steps, args.steps, wall, cpu)
    base = results["lora"]
    rows = []
    for name, res in results.items():
        paired = statistics.median(a / b for a, b in zip(res.tokens_per_s, base.tokens_per_s, strict=True))
        rows.append([name, f"{res.first_loss:.4f}", f"{res.median:,.0f}", res.spread, f"{res.median / base.median:.3f}",
                     f"{paired:.3f}"])
    print(f"\ntraining step, {args.dtype} compute, {args.threads} threads:")
    print(markdown_table(["contestant", "first loss", "tok/s (median)", "range", "of lora", "paired of lora"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
