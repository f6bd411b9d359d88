"""Every family's planner shapes are the shapes its tensor-parallel plan builds.

Why: the planner (plait.plan) prices a rank's shard from ``ModelFamily.local_shapes`` without
building a model; if a family's plan split a projection differently (other head padding, KV
replication, vocabulary rows, MLP split), its estimates would silently drift from what it trains.
Each family's tiny model is built on the meta device, its real ``parallelize`` applied for one TP
rank (rank arithmetic only: no process group), and every local width the planner uses is read
back from the parameters: q/k/v/o projections (or one fused q/k/v projection, GPT-NeoX's), the
dense MLP (gated or plain), the embedding and the output head.
A family record whose shapes ignore the TP degree is caught (the negative control).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.mesh import ParallelMesh
from plait.models.decoder.config import DecoderConfig
from plait.models.decoder.model import DecoderForCausalLM
from plait.models.decoder.shapes import LocalShapes
from plait.models.llama.parallelize import kv_replication_for
from plait.models.registry import FAMILIES
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import local_shapes

FAMILY_FIELDS = {
    "llama": dict(attention_bias=True),
    "qwen3": dict(),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # layer 1 is dense: its MLP is the plan's split one
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[1]),
    "gpt_neox": dict(partial_rotary_factor=0.5),
    # a sliding and a full-attention layer; four norms and the q/k norms per block
    "gemma3": dict(sliding_window=8, sliding_window_pattern=2),
    # latent attention with a query bottleneck; a dense layer, then an MoE one with a shared expert
    "deepseek_v3": dict(q_lora_rank=12, kv_lora_rank=10, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1, n_group=2,
                        topk_group=1),
}
#: families without grouped-query attention: their configs take one K/V head per query head
NO_GQA = {"gpt_neox"}
#: families whose heads are not padded or replicated (latent attention): tp must divide the heads
WHOLE_HEADS = {"deepseek_v3"}
#: name -> (tp, query heads, KV heads, head_dim)
HEADS = {
    "tp1": (1, 4, 2, 16),
    "tp2": (2, 4, 2, 16),                       # one KV head per rank
    "tp2_kv_replication": (2, 4, 1, 16),        # one KV head on both ranks
    "tp2_head_padding": (2, 3, 1, 16),          # 3 query heads padded to 4
    "tp4_padding_and_replication": (4, 6, 2, 8),  # 6 heads padded to 8, KV heads replicated
}


def _config(family: str, heads: str) -> DecoderConfig:
    _, nq, nkv, hd = HEADS[heads]
    nkv = nq if family in NO_GQA else nkv
    if family == "deepseek_v3":  # head_dim is the rotary width; the query/key heads are nope + rope wide
        return FAMILIES[family].config_cls(vocab_size=101, hidden_size=nq * hd, intermediate_size=96,
                                           num_hidden_layers=2, num_attention_heads=nq, qk_nope_head_dim=hd - 4,
                                           max_position_embeddings=64, **FAMILY_FIELDS[family])
    return FAMILIES[family].config_cls(vocab_size=101, hidden_size=nq * hd, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=nq, num_key_value_heads=nkv, head_dim=hd,
                                       max_position_embeddings=64, **FAMILY_FIELDS[family])


def _parallel_model(config: DecoderConfig, tp: int, rank: int) -> tuple[DecoderForCausalLM, int]:
    """The family's full model on meta with its TP plan applied for ``rank``, and the mesh's KV replication."""
    family = FAMILIES[type(config).family]
    kv = kv_replication_for(config, tp)
    with torch.device("meta"):
        model = family.causal_lm_cls(config)
    if tp > 1:
        family.parallelize(model, ParallelMesh(tp, rank, tp=tp, kv_replication=kv, create_groups=False))
    return model, kv


def _mismatches(model: DecoderForCausalLM, config: DecoderConfig, sh: LocalShapes, tp: int) -> list[str]:
    """Every local width of ``sh`` that differs from the parameters ``model`` holds."""
    hd = config.head_dim
    embed, head = model.decoder.embedding.weight, model.head.weight
    found: dict[str, set] = {"tp": {tp}, "hidden": {embed.shape[1], head.shape[1]},
                             "vocab": {embed.shape[0], head.shape[0]}, "q": set(), "kv": set(), "q_heads": set(),
                             "intermediate": set()}
    for block in model.decoder.layers:
        if hasattr(block, "self_attn") and hasattr(block.self_attn, "kv_b_proj"):  # latent attention
            attn = block.self_attn
            q = (attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj).weight.shape[0]
            found["q"].add(q)
            found["kv"].add(attn.kv_b_proj.weight.shape[0])  # per head: the nope key part and the value
            found["q_heads"].add(q // config.qk_head_dim)
            assert attn.o_proj.weight.shape[1] == q // config.qk_head_dim * config.v_head_dim
        elif hasattr(block, "self_attn"):
            attn = block.self_attn
            found["q"] |= {attn.q_proj.weight.shape[0], attn.o_proj.weight.shape[1]}
            found["kv"] |= {attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]}
            found["q_heads"].add(attn.q_proj.weight.shape[0] // hd)
        else:  # one fused projection, [q, k, v] per head: a third of its rows each
            attn = block.attention
            fused = attn.query_key_value.weight.shape[0]
            assert fused % 3 == 0, fused
            found["q"] |= {fused // 3, attn.dense.weight.shape[1]}
            found["kv"] |= {fused // 3}
            found["q_heads"].add(fused // 3 // hd)
        mlp = getattr(block, "mlp", None)
        if hasattr(mlp, "gate_proj"):  # a dense MLP (Mixtral's blocks have none, Qwen3-MoE's sparse ones an MoE layer)
            found["intermediate"] |= {mlp.gate_proj.weight.shape[0], mlp.up_proj.weight.shape[0],
                                      mlp.down_proj.weight.shape[1]}
        elif hasattr(mlp, "dense_h_to_4h"):  # a plain MLP
            found["intermediate"] |= {mlp.dense_h_to_4h.weight.shape[0], mlp.dense_4h_to_h.weight.shape[1]}
    (q_heads,) = found["q_heads"] or {0}
    (vocab,) = found["vocab"] if len(found["vocab"]) == 1 else {-1}
    found["head_padding"] = {q_heads * tp != config.num_attention_heads}
    found["vocab_padding"] = {vocab * tp != config.vocab_size}
    problems = []
    for name, values in found.items():
        expected = getattr(sh, name)
        if values and values != {expected}:
            problems.append(f"{name}: planner {expected}, built {sorted(values)}")
    return problems


@pytest.mark.parametrize("family,heads", [(f, h) for f in FAMILIES for h in HEADS
                                          if f not in WHOLE_HEADS or HEADS[h][1] % HEADS[h][0] == 0])
def test_planner_shapes_are_the_parallelized_parameters(family, heads):
    config = _config(family, heads)
    tp = HEADS[heads][0]
    for rank in sorted({0, tp - 1}):
        model, kv = _parallel_model(config, tp, rank)
        sh = local_shapes(config, ParallelDegrees(tp=tp, kv_replication=kv))
        assert sh == FAMILIES[family].local_shapes(config, tp, kv)  # the planner asks the family
        assert _mismatches(model, config, sh, tp) == [], (family, heads, rank)
    if tp > 1:  # the model was really split: its widths are not the full model's
        assert sh.q_heads < config.num_attention_heads or sh.head_padding
        assert sh.vocab < config.vocab_size


def test_every_family_is_a_decoder():
    for family in FAMILIES.values():
        assert issubclass(family.config_cls, DecoderConfig)
        assert issubclass(family.causal_lm_cls, DecoderForCausalLM)


def test_a_family_whose_shapes_ignore_the_plan_is_caught():
    """Negative control: a family record claiming the full model's widths at tp=2 disagrees with
    what its plan builds, in the q, kv, MLP and vocabulary widths."""
    config = _config("qwen3", "tp2")
    model, kv = _parallel_model(config, 2, 0)
    family = FAMILIES["qwen3"]
    wrong = dataclasses.replace(family, local_shapes=lambda c, tp, kv: dataclasses.replace(
        family.local_shapes(c, 1, 1), tp=tp))
    problems = _mismatches(model, config, wrong.local_shapes(config, 2, kv), 2)
    assert {p.split(":")[0] for p in problems} == {"q", "kv", "q_heads", "intermediate", "vocab", "vocab_padding"}
