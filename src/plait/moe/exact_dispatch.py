"""Expert parallelism's exact-volume dispatch: only the routed rows travel, at one host read.

The default dispatcher (:class:`~plait.moe.expert_parallel.AllToAllDispatcher`) reserves ``N``
rows per peer so that no shape depends on the routing: no host read, but ``ep * N`` rows per
exchange, most of them padding. ``moe.dispatch: exact`` swaps in :class:`ExactAllToAllDispatcher`,
which sends each peer exactly the rows routed to its experts (an all-to-all with variable split
sizes). The split sizes must be host integers (``all_to_all_single`` takes Python lists on every
backend), so after the per-expert counts are exchanged on the device, one read brings this
rank's send and receive sizes to the host: one synchronisation per MoE layer and forward (again
in an activation-checkpointing recomputation), none in the backward, which reuses the sizes.

When that is the better trade: the padding grows with ``ep`` (``ep * N`` rows against about ``N``),
so at large expert-parallel degrees over slow links exact volume wins; on one host, or where the
device runs ahead of the host, the static shape does. The numbers are equal either way: both
dispatchers run the same experts over the same rows (tests/test_moe_parity.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo
from plait.moe.all_to_all import exchange
from plait.nn.moe import DispatchPlan, Experts


class _VariableAllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(receive), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


def variable_all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all: ``send[p]`` rows of ``x`` (in peer order) go to peer ``p``, and
    ``receive[s]`` rows come from peer ``s``."""
    return _VariableAllToAll.apply(x, send, receive, group)


class ExactAllToAllDispatcher:
    """A :data:`~plait.nn.moe.layer.Dispatcher` exchanging exactly the routed rows over ``ep``.

    The rows arrive sorted by global expert with the kept ones first, so the rows for peer ``p``
    (which holds experts ``p * E/ep ..``) are one contiguous block; received rows are grouped
    peer-major and regrouped by local expert (within an expert, in peer order, as the static
    dispatcher does), run through the experts, and sent back the way they came.
    """

    def __init__(self, ep: GroupInfo) -> None:
        self.ep = ep

    def __call__(self, rows: torch.Tensor, plan: DispatchPlan, experts: Experts) -> torch.Tensor:
        ep, group = self.ep.size, self.ep.group
        n, hidden = rows.shape
        counts = plan.counts.view(ep, -1)  # [peer, its local expert] kept rows this rank sends
        received = exchange(counts, group)  # [peer, my local expert] rows each peer sends me
        sizes = torch.cat([counts.sum(dim=1), received.sum(dim=1)]).tolist()  # the one host read
        send, receive = sizes[:ep], sizes[ep:]
        kept = sum(send)
        recv = variable_all_to_all(rows[:kept], send, receive, group)
        local = received.shape[1]
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            received.reshape(-1), output_size=recv.shape[0])
        order = torch.argsort(expert_of_row, stable=True)
        ends = torch.cumsum(received.sum(dim=0), 0).to(torch.int32)
        out = experts(recv[order], ends)
        back = variable_all_to_all(torch.zeros_like(out).index_copy(0, order, out), receive, send, group)
        return torch.cat([back, back.new_zeros(n - kept, hidden)])
