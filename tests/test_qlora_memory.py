"""The planner prices a QLoRA rank's parameters as the built model holds them, at TP=1 and TP=2.

The model is built on the meta device under the fake process group (no data moves, the real
shapes), adapted and quantized as a run does it; its parameter bytes (frozen base, quantized
projections, adapters) must equal ``estimate_memory(..., adapters=...).parameters`` exactly, and
the trained elements the planner gives gradients and optimizer state must be the adapters'.
SmolLM2-135M's widths (9 query heads, 3 KV heads: TP=2 pads a query head and replicates KV heads).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.lora import LoraSettings, apply_lora, lora_parameters
from plait.materialize import build_model
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.parallelize import kv_replication_for
from plait.plan.adapters import AdapterPlan
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import estimate_memory, precision_bytes
from plait.quantize import quantize_base_, quantized_weights

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _built_bytes(tp: int, quantize: str, dtype: torch.dtype) -> tuple[int, int]:
    """``(parameter bytes, adapter elements)`` of TP rank 0, built as a run builds it: the model in
    fp32 (``build_stages_for``), the adapters in the parameter dtype ``dtype`` (the optimizer's flat
    buffer holds what it trains), the base quantized from its values rounded to ``dtype``."""
    kv = kv_replication_for(SMOLLM2, tp)
    dist.init_process_group("fake", rank=0, world_size=tp)
    try:
        model = build_model(SMOLLM2, ParallelMesh(tp, 0, tp=tp, kv_replication=kv), device="meta", init=False)
        # the optimizer keeps trained weights in the parameter dtype (its flat buffer), adapters included
        apply_lora([model], LoraSettings(rank=16, alpha=32.0, target_modules=TARGETS), seed=0, dtype=dtype)
        if quantize != "none":
            quantize_base_([model], quantize, block_size=64, round_to=dtype)
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        stored = sum(w.nbytes_stored() for _, w in quantized_weights([model]))
        return dense + stored, sum(p.numel() for _, p in lora_parameters([model]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("quantize,precision", [("nf4", "fp32"), ("int8", "bf16-pure"), ("none", "fp32")])
def test_planned_parameter_bytes_equal_the_built_ranks(tp, quantize, precision):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    built, adapters = _built_bytes(tp, quantize, dtype)
    layout = ParallelDegrees(tp=tp, kv_replication=kv_replication_for(SMOLLM2, tp))
    plan = AdapterPlan(16, TARGETS, quantize, 64)
    estimate = estimate_memory(SMOLLM2, layout, precision=precision, micro_batch_size=1, seq_len=256,
                               microbatches=1, adapters=plan)
    full = estimate_memory(SMOLLM2, layout, precision=precision, micro_batch_size=1, seq_len=256, microbatches=1)
    assert estimate.parameters == built, (estimate.parameters, built)
    pb = precision_bytes(precision)
    assert estimate.gradients == adapters * pb.grad  # the adapters alone train
    assert estimate.optimizer == 2 * adapters * pb.optimizer_state and estimate.optimizer < full.optimizer / 50


def test_plait_plan_prices_a_qlora_recipe_on_a_hugging_face_model(tmp_path, capsys):
    """``plait plan`` reads a ``model.hf_path`` recipe as written (it used to fill in every model
    field and then refuse them as contradicting the checkpoint), prices the adapters and the
    quantized base."""
    from plait.cli import main
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint

    small = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    save_hf_checkpoint(build_model(small, single_process_mesh(), seed=0), tmp_path / "hf",
                       single_process_mesh().info("tp"))
    recipe = tmp_path / "qlora.yaml"
    recipe.write_text(f"model:\n  hf_path: {tmp_path / 'hf'}\ndata:\n  seq_len: 128\n"
                      f"  tokenizer: {tmp_path / 'hf'}/tokenizer.json\nlora:\n  rank: 8\n  quantize_base: nf4\n")
    assert main(["plan", str(recipe), "--world", "4", "--device", "h100", "--all"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out, out
