"""The vocab-parallel cross-entropy walks the rows in chunks: any chunk size gives the same result.

Every operation of the loss is per row (maximum, exponentials, sum, target logit), so chunking
the rows must change nothing: losses, logit gradients and the hidden-state and head-weight
gradients behind them are compared bit for bit (``torch.equal``) between one chunk and several,
at TP=1 in process and at TP=2 on two gloo ranks, in fp32 and bf16, with vocabulary padding and
ignored targets. The unchunked result is also checked against ``F.cross_entropy`` of the full
(unsharded) logits in fp32, to 1e-6 / 1e-5 (a different summation order of the exponentials).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from plait.comm.primitives import GroupInfo
from plait.tensor_parallel.cross_entropy import default_chunk_rows, vocab_parallel_cross_entropy

N, H, V = 14, 8, 37  # tokens, hidden, real vocabulary (odd: the TP=2 shards have a padding column)
CHUNKS = (1, 5, N)   # 5: a last chunk of 4 rows; N: a single chunk
TOL = dict(atol=1e-6, rtol=1e-5)


def _case(dtype: torch.dtype, v_local: int, tp: GroupInfo):
    """Hidden states, this rank's head rows (zero for padding columns), targets with ignored ones."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(v_local * tp.size, H, generator=g)
    weight[V:] = 0.0
    target = torch.randint(0, V, (N,), generator=g)
    target[2::5] = -100
    local = weight[tp.rank * v_local:(tp.rank + 1) * v_local]
    return hidden.to(dtype), local.to(dtype), target, weight[:V]


def _head_loss(hidden, weight, target, tp, chunk_rows):
    """Loss sum and the gradients of logits, hidden states and head weight through ``h @ W^T``."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logits = h @ w.t()
    logits.retain_grad()
    loss = vocab_parallel_cross_entropy(logits, target, V, tp, chunk_rows=chunk_rows)
    scale = torch.linspace(0.5, 1.5, N)  # a per-token upstream gradient, not only ones
    (loss * scale).sum().backward()
    return {"loss": loss.detach(), "dlogits": logits.grad, "dhidden": h.grad, "dweight": w.grad}


def _compare_chunks(tp: GroupInfo, v_local: int) -> dict[str, str]:
    """Mismatches (empty when every chunked run equals the single-chunk run exactly)."""
    bad = {}
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, target, _ = _case(dtype, v_local, tp)
        whole = _head_loss(hidden, weight, target, tp, N)
        for chunk in CHUNKS[:-1]:
            part = _head_loss(hidden, weight, target, tp, chunk)
            for what, value in part.items():
                if not torch.equal(value, whole[what]):
                    bad[f"{dtype} chunk_rows={chunk} {what}"] = f"max diff {(value - whole[what]).abs().max():.3g}"
    return bad


def _reference_errors(tp: GroupInfo, v_local: int) -> dict[str, float]:
    """Unchunked fp32 result against F.cross_entropy on the full logits (this rank's columns)."""
    hidden, weight, target, full_weight = _case(torch.float32, v_local, tp)
    got = _head_loss(hidden, weight, target, tp, N)
    logits = (hidden @ full_weight.t()).requires_grad_()
    ref = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    (ref * torch.linspace(0.5, 1.5, N)).sum().backward()
    assert logits.grad is not None
    lo = tp.rank * v_local
    real = min(V - lo, v_local)
    pad = got["dlogits"][:, real:]
    return {"loss": (got["loss"] - ref.detach()).abs().max().item(),
            "dlogits": (got["dlogits"][:, :real] - logits.grad[:, lo:lo + real]).abs().max().item(),
            "padding dlogits": pad.abs().max().item() if pad.numel() else 0.0}


def _tp2_worker(rank: int, world: int) -> tuple[dict, dict]:
    import torch.distributed as dist

    tp = GroupInfo(dist.group.WORLD, rank, world)
    v_local = -(-V // world)
    return _compare_chunks(tp, v_local), _reference_errors(tp, v_local)


@pytest.mark.parametrize("v_local", [V, V + 3], ids=["exact", "padded"])
def test_chunks_equal_one_chunk_tp1(v_local):
    tp = GroupInfo.single()
    assert _compare_chunks(tp, v_local) == {}
    for what, err in _reference_errors(tp, v_local).items():
        assert err <= TOL["atol"] + TOL["rtol"], f"{what}: {err}"


@pytest.mark.slow
def test_chunks_equal_one_chunk_tp2():
    for rank, (bad, errors) in enumerate(run_distributed(_tp2_worker, 2)):
        assert bad == {}, f"rank {rank}: {bad}"
        for what, err in errors.items():
            assert err <= TOL["atol"] + TOL["rtol"], f"rank {rank} {what}: {err}"


def test_default_chunk_and_bad_chunk():
    assert default_chunk_rows(16384, "cpu", threads=1) == 16 and default_chunk_rows(10**9, "cpu", threads=1) == 1
    assert default_chunk_rows(16384, "cpu", threads=2) == 1024 == default_chunk_rows(16384, "cuda", threads=1)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 3, GroupInfo.single(),
                                     chunk_rows=0)
