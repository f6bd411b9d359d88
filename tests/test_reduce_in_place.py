"""The row-parallel reduce sums in place (no copy of the activation) and stays autograd-safe.

Two gloo ranks: ``reduce_from_tp`` of a fresh linear output returns that very tensor holding the
sum, and its gradient is the identity; when an earlier op *had* saved the tensor for its backward,
the in-place sum makes that backward raise (autograd's version check) instead of using wrong
values; inputs that cannot be dirtied (a leaf that requires grad, a view) are copied and left
untouched.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from plait.comm.collectives import reduce_from_tp


def _worker(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(rank)
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    partial = torch.nn.functional.linear(x, w)
    expected = partial.detach().clone()
    dist.all_reduce(expected)
    ptr = partial.data_ptr()
    y = reduce_from_tp(partial, group)
    in_place = y is partial and y.data_ptr() == ptr
    close = torch.allclose(y, expected)
    (y * 3).sum().backward()
    grad_ok = torch.allclose(x.grad, torch.full_like(partial, 3.0) @ w)

    saved = torch.randn(2, 4, requires_grad=True).exp()  # exp saves its output for backward
    reduce_from_tp(saved, group)
    try:
        saved.sum().backward()
        caught = ""
    except RuntimeError as e:
        caught = str(e)

    leaf = torch.ones(3, requires_grad=True)
    out_leaf = reduce_from_tp(leaf, group)
    base = torch.ones(4, 2) * (rank + 1)
    view = base[:, 0]
    out_view = reduce_from_tp(view, group)
    copies_ok = (out_leaf is not leaf and torch.equal(leaf.detach(), torch.ones(3))
                 and torch.equal(out_leaf.detach(), torch.full((3,), float(world)))
                 and torch.equal(base[:, 0], torch.full((4,), float(rank + 1)))
                 and torch.equal(out_view, torch.full((4,), float(sum(range(1, world + 1))))))
    return in_place, close, grad_ok, caught, copies_ok


@pytest.mark.slow  # two processes: ~5 s with their start-up
def test_reduce_from_tp_sums_in_place_and_autograd_guards_it():
    for in_place, close, grad_ok, caught, copies_ok in run_distributed(_worker, 2):
        assert in_place and close and grad_ok
        assert "modified by an inplace operation" in caught
        assert copies_ok
