"""Tensor-parallel layers against unsharded single-process references (gloo, 2 and 4 ranks).

For each layer: outputs, input gradients and weight gradients of the sharded layer equal the
corresponding slices of the reference. Tolerance: fp32 with 2e-6 absolute / 1e-5 relative, since
a row-parallel sum (and the all-reduced input gradient) adds the same products in a different
order than the single matmul of the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed

B, S, H, OUT, V = 2, 8, 16, 24, 37  # V deliberately not divisible by 2 or 4 (vocab padding)
TOL = dict(atol=2e-6, rtol=1e-5)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seq_shard(t, tp):
    return t.chunk(tp.size, dim=1)[tp.rank]


def _errors(pairs):
    return {k: ((a - b).abs().max().item() if a.numel() else 0.0) if a.shape == b.shape
            else f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
            for k, (a, b) in pairs.items()}


def _column(tp, sp, bias, gather_output):
    from plait.tensor_parallel import ColumnParallelLinear

    ref = torch.nn.Linear(H, OUT, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(_rand(OUT, H, seed=1))
        if bias:
            ref.bias.copy_(_rand(OUT, seed=2))
    layer = ColumnParallelLinear(H, OUT, tp, bias=bias, sequence_parallel=sp, gather_output=gather_output)
    with torch.no_grad():
        for name, spec in layer.shard_specs().items():
            getattr(layer, name).copy_(spec.shard(getattr(ref, name)))
    x_full = _rand(B, S, H, seed=3).requires_grad_()
    x = (_seq_shard(x_full.detach(), tp) if sp else x_full.detach().clone()).requires_grad_()
    y_ref = ref(x_full)
    gy = _rand(*y_ref.shape, seed=4)
    y_ref.backward(gy)
    y = layer(x)
    rows = list(layer.weight_spec.index)
    y.backward(gy if gather_output else gy[..., rows])
    dx_ref = _seq_shard(x_full.grad, tp) if sp else x_full.grad
    pairs = {"out": (y, y_ref if gather_output else y_ref[..., rows]), "dx": (x.grad, dx_ref),
             "dw": (layer.weight.grad, layer.weight_spec.shard(ref.weight.grad))}
    if bias:
        pairs["db"] = (layer.bias.grad, layer.bias_spec.shard(ref.bias.grad))
    return pairs


def _row(tp, sp, bias):
    from plait.tensor_parallel import RowParallelLinear

    ref = torch.nn.Linear(OUT, H, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(_rand(H, OUT, seed=1))
        if bias:
            ref.bias.copy_(_rand(H, seed=2))
    layer = RowParallelLinear(OUT, H, tp, bias=bias, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight_spec.shard(ref.weight))
        if bias:
            layer.bias.copy_(ref.bias)
    cols = list(layer.weight_spec.index)
    x_full = _rand(B, S, OUT, seed=3).requires_grad_()
    x = x_full.detach()[..., cols].clone().requires_grad_()
    y_ref = ref(x_full)
    gy = _rand(*y_ref.shape, seed=4)
    y_ref.backward(gy)
    y = layer(x)
    y.backward(_seq_shard(gy, tp) if sp else gy)
    pairs = {"out": (y, _seq_shard(y_ref, tp) if sp else y_ref), "dx": (x.grad, x_full.grad[..., cols]),
             "dw": (layer.weight.grad, layer.weight_spec.shard(ref.weight.grad))}
    if bias:
        pairs["db"] = (layer.bias.grad, ref.bias.grad)
    return pairs


def _embedding(tp, sp):
    from plait.tensor_parallel import VocabParallelEmbedding

    ref = torch.nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(_rand(V, H, seed=1))
    layer = VocabParallelEmbedding(V, H, tp, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight_spec.shard(ref.weight))
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    y_ref = ref(ids)
    gy = _rand(*y_ref.shape, seed=4)
    y_ref.backward(gy)
    y = layer(ids)
    y.backward(_seq_shard(gy, tp) if sp else gy)
    return {"out": (y, _seq_shard(y_ref, tp) if sp else y_ref),
            "dw": (layer.weight.grad, layer.weight_spec.shard(ref.weight.grad))}


def _cross_entropy(tp):
    from plait.tensor_parallel import vocab_parallel_cross_entropy
    from plait.tensor_parallel.linear import even_rows

    n = B * S
    logits_full = (_rand(n, V, seed=1) * 3).requires_grad_()
    target = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(2))
    target[::5] = -100  # ignored positions
    loss_ref = F.cross_entropy(logits_full, target, ignore_index=-100, reduction="none")
    g = _rand(n, seed=3)
    loss_ref.backward(g)
    rows = even_rows(V, tp, pad_to_multiple=True)
    padded = torch.cat([logits_full.detach(), torch.full((n, len(rows) * tp.size - V), 7.0)], dim=1)
    local = padded[:, tp.rank * len(rows):(tp.rank + 1) * len(rows)].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, V, tp)
    loss.backward(g)
    real = [i for i, r in enumerate(rows) if r >= 0]
    grad_ref = logits_full.grad[:, [rows[i] for i in real]]
    pad_grad = local.grad[:, [i for i, r in enumerate(rows) if r < 0]]
    return {"loss": (loss, loss_ref), "dlogits": (local.grad[:, real], grad_ref),
            "pad_grad_zero": (pad_grad, torch.zeros_like(pad_grad))}


def _norm(tp):
    from plait.models.llama.model import RMSNorm
    from plait.tensor_parallel import SequenceParallelRMSNorm

    ref = RMSNorm(H, 1e-6)
    layer = SequenceParallelRMSNorm(H, 1e-6, tp)
    with torch.no_grad():
        ref.weight.copy_(_rand(H, seed=1))
        layer.weight.copy_(ref.weight)
    x_full = _rand(B, S, H, seed=3).requires_grad_()
    x = _seq_shard(x_full.detach(), tp).clone().requires_grad_()
    y_ref = ref(x_full)
    gy = _rand(*y_ref.shape, seed=4)
    y_ref.backward(gy)
    y = layer(x)
    y.backward(_seq_shard(gy, tp))
    return {"out": (y, _seq_shard(y_ref, tp)), "dx": (x.grad, _seq_shard(x_full.grad, tp)),
            "dw": (layer.weight.grad, ref.weight.grad)}


CASES = {
    "column": lambda tp: _column(tp, sp=False, bias=True, gather_output=False),
    "column_gather": lambda tp: _column(tp, sp=False, bias=False, gather_output=True),
    "column_sp": lambda tp: _column(tp, sp=True, bias=True, gather_output=False),
    "row": lambda tp: _row(tp, sp=False, bias=True),
    "row_sp": lambda tp: _row(tp, sp=True, bias=True),
    "embedding": lambda tp: _embedding(tp, sp=False),
    "embedding_sp": lambda tp: _embedding(tp, sp=True),
    "cross_entropy": _cross_entropy,
    "norm_sp": _norm,
}


def _worker(rank, world, case_names):
    from plait.mesh import ParallelMesh

    torch.manual_seed(0)
    tp = ParallelMesh(world, rank, tp=world).info("tp")
    return {name: _errors(CASES[name](tp)) for name in case_names}


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_reference(world):
    results = run_distributed(_worker, world, list(CASES))
    for rank, per_case in enumerate(results):
        for case, errs in per_case.items():
            for what, err in errs.items():
                assert not isinstance(err, str), f"rank {rank} {case} {what}: {err}"
                assert err <= TOL["atol"] + 1e-5, f"rank {rank} {case} {what}: max abs error {err}"
