"""KV replication ("mixed TP degrees") and head padding against dense grouped-query attention.

fp32 tolerance 1e-5 absolute: the sharded attention adds the o_proj partial products and the
input-gradient contributions in a different order than the dense reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed

TOL = 1e-5


def _config(heads, kv_heads, head_dim=8, bias=False):
    from plait.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       attention_bias=bias, max_position_embeddings=32)


def _worker(rank, world, heads, kv_heads, kv_rep, placement, sp, bias):
    from plait.mesh import ParallelMesh
    from plait.models.llama.model import LlamaAttention, RotaryEmbedding, causal_attention
    from plait.tensor_parallel import HeadLayout, ParallelSelfAttention

    torch.manual_seed(0)
    cfg = _config(heads, kv_heads, bias=bias)
    layout = HeadLayout.plan(heads, kv_heads, cfg.head_dim, world, kv_rep, placement)
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=layout.kv_replication, kv_placement=placement)
    tp, kv = mesh.info("tp"), mesh.info("kv")
    ref = LlamaAttention(cfg)
    par = ParallelSelfAttention(cfg.hidden_size, layout, tp, kv, causal_attention, qkv_bias=bias,
                                o_bias=bias, sequence_parallel=sp)
    specs = {f"{m}.{p}": s for m in ("q_proj", "k_proj", "v_proj", "o_proj")
             for p, s in getattr(par, m).shard_specs().items()}
    with torch.no_grad():
        for name, p in par.named_parameters():
            src = dict(ref.named_parameters())[name]
            p.copy_(specs[name].shard(src) if name in specs else src)
    cos, sin = RotaryEmbedding(cfg)(torch.empty(0), 12)

    def shard_seq(t):
        return t.chunk(world, dim=1)[rank] if sp else t

    x_full = torch.randn(2, 12, cfg.hidden_size).requires_grad_()
    x = shard_seq(x_full.detach()).clone().requires_grad_()
    y_ref = ref(x_full, cos, sin)
    gy = torch.randn_like(y_ref)
    y_ref.backward(gy)
    y = par(x, cos, sin)
    y.backward(shard_seq(gy))
    errs = {"out": (y - shard_seq(y_ref)).abs().max().item(),
            "dx": (x.grad - shard_seq(x_full.grad)).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        want = specs[name].shard(ref_params[name].grad) if name in specs else ref_params[name].grad
        errs["d" + name] = (p.grad - want).abs().max().item()

    # Five AdamW steps on both; K/V replicas must stay bitwise identical, and track the dense model.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        xs = torch.randn(2, 12, cfg.hidden_size, generator=g)
        target = torch.randn(2, 12, cfg.hidden_size, generator=g)
        for model, opt_, inp, tgt in ((ref, opt_ref, xs, target), (par, opt, shard_seq(xs), shard_seq(target))):
            opt_.zero_grad()
            loss = ((model(inp, cos, sin) - tgt) ** 2).sum()
            loss.backward()
            opt_.step()
    replicas_identical = True
    for name in ("k_proj.weight", "v_proj.weight") + (("k_proj.bias",) if bias else ()):
        mine = dict(par.named_parameters())[name].detach().contiguous()
        if kv.size > 1:
            others = [torch.empty_like(mine) for _ in range(kv.size)]
            dist.all_gather(others, mine, group=kv.group)
            replicas_identical &= all(torch.equal(o, mine) for o in others)
    # Adam's normalised update turns round-off in near-zero gradients into weight differences of
    # up to ~lr, so after the steps the check is on the layer's output, not on single weights.
    with torch.no_grad():
        probe = torch.randn(2, 12, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
        errs["after5_out"] = (par(shard_seq(probe), cos, sin) - shard_seq(ref(probe, cos, sin))).abs().max().item()
    return {"errs": errs, "replicas_identical": replicas_identical, "kv_replication": layout.kv_replication,
            "padded_heads": layout.padded_num_heads}


@pytest.mark.parametrize(
    "heads,kv_heads,kv_rep,placement,sp,bias,expect_m,expect_padded",
    [
        (4, 2, None, "interleaved", False, False, 2, 4),   # TP=4, 2 KV heads: m=2
        (4, 1, None, "interleaved", True, True, 4, 4),     # TP=4, 1 KV head: m=4, with SP and biases
        (8, 2, 2, "adjacent", False, False, 2, 8),         # adjacent replica placement
        (6, 6, None, "interleaved", False, False, 1, 8),   # 6 heads at TP=4: padded to 8
        (6, 2, None, "interleaved", True, False, 2, 8),    # GQA with padding and replication
    ],
)
def test_kv_replication_matches_dense(heads, kv_heads, kv_rep, placement, sp, bias, expect_m, expect_padded):
    results = run_distributed(_worker, 4, heads, kv_heads, kv_rep, placement, sp, bias)
    for rank, r in enumerate(results):
        assert r["kv_replication"] == expect_m
        assert r["padded_heads"] == expect_padded
        assert r["replicas_identical"], f"rank {rank}: K/V replicas diverged"
        for what, err in r["errs"].items():
            tol = TOL if not what.startswith("after5") else 1e-4  # 5 AdamW steps amplify round-off
            assert err <= tol, f"rank {rank} {what}: max abs error {err}"


def test_head_layout_lists():
    from plait.tensor_parallel import HeadLayout

    lay = HeadLayout.plan(8, 2, 4, 4)  # g=4, m=2 interleaved: rank r holds KV head r % 2
    assert lay.kv_replication == 2
    assert [lay.kv_heads(r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
    assert [lay.q_heads(r) for r in range(4)] == [(0, 1), (4, 5), (2, 3), (6, 7)]  # Q-head permutation
    adj = HeadLayout.plan(8, 2, 4, 4, placement="adjacent")
    assert [adj.q_heads(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    pad = HeadLayout.plan(6, 6, 4, 4)
    assert [pad.q_heads(r) for r in range(4)] == [(0, 1), (2, 3), (4, 5), (-1, -1)]


@pytest.mark.parametrize(
    "heads,kv,tp,m,needle",
    [(4, 4, 8, None, "tp=8 exceeds num_attention_heads=4"),
     (8, 2, 4, 3, r"kv_replication=3 is not valid .* valid values: \[2, 4\]"),
     (8, 2, 4, 1, r"kv_replication=1 is not valid"),
     (8, 8, 4, 2, r"kv_replication=2 is not valid .* valid values: \[1\]")],
)
def test_bad_head_layouts(heads, kv, tp, m, needle):
    from plait.tensor_parallel import HeadLayout, HeadLayoutError

    with pytest.raises(HeadLayoutError, match=needle):
        HeadLayout.plan(heads, kv, 4, tp, m)
