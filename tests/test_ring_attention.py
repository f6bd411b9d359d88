"""Context-parallel attention: the zigzag split, the ring plan, and ring / all-gather attention on
cp = 2 and 4 gloo ranks against full SDPA on one process (forward, dq, dk, dv; causal, GQA, packed
documents, with and without zigzag, chunk lengths that are not powers of two)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from plait.context_parallel import SequenceSplit, causal_work, pieces, ring_plan
from plait.context_parallel.piecewise import backward_block, empty_accumulator, forward_block
from plait.context_parallel.ring import group_queries
from plait.nn.attention import document_causal_mask

TOL = 1e-5


# ------------------------------------------------------------------ split and plan (no processes)
def test_zigzag_split_holds_head_and_tail_chunks():
    s = SequenceSplit(seq_len=12, cp=3)
    assert [s.chunks(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert s.indices(0).tolist() == [0, 1, 10, 11]
    x = torch.arange(24).view(2, 12)
    parts = [s.split(x, r, dim=1) for r in range(3)]
    assert parts[1].tolist() == [[2, 3, 8, 9], [14, 15, 20, 21]]
    assert torch.equal(s.unsplit(parts, dim=1), x)
    c = SequenceSplit(seq_len=12, cp=3, zigzag=False)
    assert [c.chunks(r) for r in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert torch.equal(c.unsplit([c.split(x, r, dim=1) for r in range(3)], dim=1), x)


def test_split_refuses_a_length_not_divisible_by_two_cp():
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by 2\\*cp=4"):
        SequenceSplit(seq_len=10, cp=2)


def test_ring_plan_is_the_expected_list():
    s = SequenceSplit(seq_len=8, cp=2)
    fwd = ring_plan(s, 0)
    assert [st.owner for st in fwd] == [0, 1]
    assert [(p.q_chunk, p.k_chunk, p.kind) for p in fwd[0].pieces] == [(0, 0, "diagonal"), (3, 0, "full"),
                                                                       (3, 3, "diagonal")]
    assert [(p.q_chunk, p.k_chunk, p.kind) for p in fwd[1].pieces] == [(3, 1, "full"), (3, 2, "full")]
    assert [st.owner for st in ring_plan(SequenceSplit(8, 4), 1, direction=-1)] == [1, 2, 3, 0]


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    for cp in (2, 4, 8):
        z = [causal_work(SequenceSplit(16 * cp, cp), r) for r in range(cp)]
        assert len(set(z)) == 1, z
        c = [causal_work(SequenceSplit(16 * cp, cp, zigzag=False), r) for r in range(cp)]
        assert max(c) / (sum(c) / cp) > 1.4  # about (2cp - 1) / cp
        n = 16 * cp
        assert sum(z) == sum(c) == n * (n + 1) // 2  # every causal pair exactly once


# ------------------------------------------------------------------ reference
def _inputs(b, heads, kv_heads, seq, d, seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, seq, d, generator=g)
    k = torch.randn(b, kv_heads, seq, d, generator=g)
    v = torch.randn(b, kv_heads, seq, d, generator=g)
    dout = torch.randn(b, heads, seq, d, generator=g)
    segments = None
    if packed:  # documents of uneven lengths crossing chunk and rank boundaries
        bounds = torch.tensor([0, 3, 4, 11, 12, 20, 23])
        segments = torch.stack([torch.bucketize(torch.arange(seq), bounds, right=True) + row for row in range(b)])
    return q, k, v, dout, segments


def _reference(q, k, v, dout, segments):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if segments is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(segments), enable_gqa=gqa)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _simulated(q, k, v, dout, segments, split):
    """Every rank's pieces computed in one process (no transfers): checks the plan and the math."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    kvh = k.shape[1]
    locals_ = [[split.split(t, r, dim=2) for t in (q, k, v, dout)] for r in range(split.cp)]
    outs, dqs, dkvs = [], [], [torch.zeros(2, *locals_[0][1].shape) for _ in range(split.cp)]
    for r, (ql, _, _, dl) in enumerate(locals_):
        qg = group_queries(ql, kvh)
        acc = empty_accumulator(qg)
        for o in range(split.cp):
            kv = torch.stack(locals_[o][1:3])
            acc = forward_block(qg, kv, pieces(split, r, o), split, segments, scale, acc)
        out, lse = acc
        dg = dl.reshape(qg.shape)
        delta = (dg * out).sum(-1)
        dq = torch.zeros_like(qg)
        for o in range(split.cp):
            kv = torch.stack(locals_[o][1:3])
            dkvs[o] += backward_block(qg, kv, dg, lse, delta, pieces(split, r, o), split, segments, scale, dq)
        outs.append(out.reshape(ql.shape))
        dqs.append(dq.reshape(ql.shape))
    return (split.unsplit(outs, 2), split.unsplit(dqs, 2), split.unsplit([d[0] for d in dkvs], 2),
            split.unsplit([d[1] for d in dkvs], 2))


@pytest.mark.parametrize("cp,seq,heads,kv_heads,zigzag,packed", [
    (1, 6, 4, 2, True, False),
    (2, 12, 4, 2, True, False),     # chunk of 3
    (2, 12, 4, 4, False, False),
    (3, 30, 6, 2, True, True),      # chunk of 5, documents across ranks
    (4, 24, 4, 1, True, True),      # chunk of 3, one K/V head
    (4, 24, 4, 2, False, True),
])
def test_pieces_cover_full_attention_in_one_process(cp, seq, heads, kv_heads, zigzag, packed):
    q, k, v, dout, segments = _inputs(2, heads, kv_heads, seq, 8, packed=packed)
    ref = _reference(q, k, v, dout, segments)
    got = _simulated(q, k, v, dout, segments, SequenceSplit(seq, cp, zigzag))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=name)


def test_a_wrong_mask_is_caught():
    """Negative control: ignoring the documents of a packed row must fail the comparison."""
    q, k, v, dout, segments = _inputs(1, 2, 2, 12, 8, packed=True)
    ref = _reference(q, k, v, dout, segments)
    got = _simulated(q, k, v, dout, None, SequenceSplit(12, 2))
    assert not torch.allclose(got[0], ref[0], atol=1e-3)


# ------------------------------------------------------------------ on cp ranks (gloo)
CASES = [  # (seq, heads, kv_heads, zigzag, packed, mode)
    ("zigzag GQA", 24, 4, 2, True, False, "ring"),
    ("contiguous MHA", 24, 2, 2, False, False, "ring"),
    ("zigzag packed", 24, 4, 2, True, True, "ring"),
    ("allgather GQA packed", 24, 4, 1, True, True, "allgather"),
]


def _cp_worker(rank, world, cases):
    from plait.comm.primitives import GroupInfo
    from plait.context_parallel import RingExchange, allgather_attention, ring_attention

    info = GroupInfo(torch.distributed.group.WORLD, rank, world)
    results = []
    for _, seq, heads, kv_heads, zigzag, packed, mode in cases:
        split = SequenceSplit(seq, world, zigzag)
        q, k, v, dout, segments = _inputs(2, heads, kv_heads, seq, 8, seed=seq + heads, packed=packed)
        ql, kl, vl = (split.split(t, rank, dim=2).requires_grad_() for t in (q, k, v))
        if mode == "ring":
            out = ring_attention(ql, kl, vl, split, RingExchange(info, list(range(world))), segments)
        else:
            out = allgather_attention(ql, kl, vl, split, info, segments)
        out.backward(split.split(dout, rank, dim=2))
        results.append([t.detach() for t in (out, ql.grad, kl.grad, vl.grad)])
    return results


def _check_cp(cp, seq_scale):
    cases = [(name, seq * seq_scale, h, kvh, z, p, m) for name, seq, h, kvh, z, p, m in CASES]
    per_rank = run_distributed(_cp_worker, cp, cases)
    for i, (name, seq, heads, kv_heads, zigzag, packed, _) in enumerate(cases):
        q, k, v, dout, segments = _inputs(2, heads, kv_heads, seq, 8, seed=seq + heads, packed=packed)
        ref = _reference(q, k, v, dout, segments)
        split = SequenceSplit(seq, cp, zigzag)
        for j, what in enumerate(("out", "dq", "dk", "dv")):
            got = split.unsplit([per_rank[r][i][j] for r in range(cp)], 2)
            torch.testing.assert_close(got, ref[j], rtol=TOL, atol=TOL, msg=f"{name}: {what}")


def test_ring_and_allgather_attention_on_two_ranks_equal_full_attention():
    _check_cp(2, 1)  # chunk of 6


@pytest.mark.slow
def test_ring_and_allgather_attention_on_four_ranks_equal_full_attention():
    _check_cp(4, 1)  # chunk of 3


def test_attention_work_counts_document_causal_pairs():
    from plait.context_parallel.balance import attention_work, imbalance, keys_seen

    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert keys_seen(seg).tolist() == [[1, 2, 3, 1, 2, 1, 2, 3]]
    one_doc = torch.zeros(1, 32, dtype=torch.long)
    for cp in (2, 4):
        assert attention_work(one_doc, SequenceSplit(32, cp)) == [causal_work(SequenceSplit(32, cp), r)
                                                                    for r in range(cp)]
        assert imbalance(attention_work(one_doc, SequenceSplit(32, cp))) == 1.0
    mask = document_causal_mask(seg)  # the pairs equal the mask's true entries
    assert sum(attention_work(seg, SequenceSplit(8, 2))) == int(mask.sum())


def test_balanced_split_pairs_chunks_by_work():
    from plait.context_parallel.balance import attention_work, balanced_split, imbalance

    assert balanced_split(torch.zeros(1, 32, dtype=torch.long), 4) == SequenceSplit(32, 4, assignment=(
        (0, 7), (1, 6), (2, 5), (3, 4)))  # one document per row: zigzag
    g = torch.Generator().manual_seed(0)
    worse = 0
    for _ in range(20):  # packed rows of random documents
        cuts = torch.randperm(63, generator=g)[:5].sort().values + 1
        seg = torch.bucketize(torch.arange(64), cuts, right=True)[None]
        zig = imbalance(attention_work(seg, SequenceSplit(64, 4)))
        bal = imbalance(attention_work(seg, balanced_split(seg, 4)))
        assert bal <= zig + 1e-12
        worse += bal < zig
    assert worse > 10  # it usually helps
    with pytest.raises(ValueError, match="every chunk of 0..3 once"):
        SequenceSplit(8, 2, assignment=((0, 1), (1, 2)))
