"""Cross-entropy over vocabulary-sharded logits that never gathers the full logits.

Each rank holds logits for a block of the vocabulary. The loss needs only three reductions over
the TP group, each of one number per token: the maximum logit (for stability), the sum of
exponentials, and the logit of the target token (held by exactly one rank). Backward is local:
``softmax - onehot`` on the rank's own block.

Memory: the logits are the largest activation (tokens x vocabulary), and an fp32 copy of them is
the largest temporary. The function therefore never holds a full-size fp32 intermediate: it walks
the rows in chunks of ``chunk_rows`` (:func:`default_chunk_rows`; one fp32 work buffer of that
many rows, reused; every operation is per row, so the chunking changes no result), keeps only the
logits themselves plus two numbers per token (the row maximum and the sum of exponentials) for
backward, and there recomputes the softmax chunk by chunk straight into the gradient. Keeping the fp32 softmax
instead (what a plain autograd composition does) costs two full-size fp32 temporaries in the
forward for fp32 logits and three for bf16 ones; here the forward adds one chunk, the saved
activation is the logits in their own dtype (half the bytes of an fp32 softmax under bf16
autocast), and the largest moment is backward's: the logits plus their gradient. The chunk also
stays in cache across the subtract / exp / sum passes, which makes the loop cheaper on CPUs
(``bench/bench_cross_entropy.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.comm.primitives import GroupInfo

#: fp32 elements per chunk on a CPU with one intra-op thread: 1 MiB, cache-sized
SMALL_CHUNK_ELEMENTS = 1 << 18
#: fp32 elements per chunk elsewhere (64 MiB): few chunks, so few operator launches
LARGE_CHUNK_ELEMENTS = 1 << 24


def default_chunk_rows(v_local: int, device: torch.device | str = "cpu", threads: int | None = None) -> int:
    """Rows per chunk for a local vocabulary of ``v_local`` columns (at least one row).

    Small (1 MiB) chunks only on a CPU running one intra-op thread, where keeping a chunk in cache
    is what pays. Every chunk costs a dozen operators, and with several threads each is a parallel
    region all threads must reach: on a machine with more runnable threads than cores one of them
    is often descheduled and the others spin (measured: 2 threads on a loaded 2-core CPU took 10x
    longer with 1 MiB chunks than with one chunk); on a GPU each is a kernel launch. There the
    chunks are 64 MiB of fp32, which still bounds the temporaries of large logits.
    """
    threads = torch.get_num_threads() if threads is None else threads
    small = torch.device(device).type == "cpu" and threads == 1
    return max(1, (SMALL_CHUNK_ELEMENTS if small else LARGE_CHUNK_ELEMENTS) // max(v_local, 1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, ignore_index, chunk_rows):
        # logits: [N, V_local] (any float dtype; computed in fp32); target: [N] global ids.
        n, v_local = logits.shape
        real = min(max(vocab_size - vocab_start, 0), v_local)  # columns past it are TP padding
        step = max(1, min(chunk_rows, n))
        f32 = dict(dtype=torch.float32, device=logits.device)
        row_max = torch.full((n,), float("-inf"), **f32)
        if real > 0:
            for s in range(0, n, step):  # a maximum is exact in any dtype: no fp32 copy needed
                row_max[s:s + step] = logits[s:s + step, :real].amax(dim=-1)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        local_t = target - vocab_start
        ignored = target == ignore_index
        mine = (local_t >= 0) & (local_t < real) & ~ignored
        safe_t = local_t.clamp(0, max(real - 1, 0))
        target_logit = torch.zeros(n, **f32)
        sum_exp = torch.zeros(n, **f32)
        if real > 0:
            work = torch.empty((step, real), **f32)
            for s in range(0, n, step):
                e = min(s + step, n)
                x = torch.sub(logits[s:e, :real], row_max[s:e, None], out=work[:e - s])
                torch.gather(x, 1, safe_t[s:e, None], out=target_logit[s:e, None])
                torch.sum(x.exp_(), dim=-1, out=sum_exp[s:e])
            target_logit.mul_(mine)
        if group is not None:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, row_max, sum_exp, safe_t, mine, ignored)
        ctx.real, ctx.step = real, step
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, row_max, sum_exp, safe_t, mine, ignored = ctx.saved_tensors
        real, step = ctx.real, ctx.step
        n = logits.shape[0]
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad[:, real:] = 0  # padding columns carry no probability mass
        scale = (grad_loss * ~ignored).float()
        direct = logits.dtype == torch.float32  # compute in the gradient itself, no work buffer
        work = None if direct or real == 0 else torch.empty((step, real), dtype=torch.float32, device=logits.device)
        for s in range(0, n if real > 0 else 0, step):
            e = min(s + step, n)
            x = grad[s:e, :real] if work is None else work[:e - s]
            torch.sub(logits[s:e, :real], row_max[s:e, None], out=x)
            x.exp_().div_(sum_exp[s:e, None])
            rows = torch.arange(e - s, device=x.device)
            x[rows, safe_t[s:e]] -= mine[s:e].to(x.dtype)
            x.mul_(scale[s:e, None])
            if work is not None:
                grad[s:e, :real].copy_(x)
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int,
                                 tp: GroupInfo, ignore_index: int = -100,
                                 chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ignored) from local logits ``[N, V_local]``.

    ``vocab_size`` is the real vocabulary; columns past it (TP padding) are excluded.
    ``chunk_rows``: rows processed at a time (default :func:`default_chunk_rows`: 1 MiB of fp32 on
    a one-thread CPU, else 64 MiB); any value gives the same losses and gradients, bit for bit.
    """
    v_local = logits.shape[-1]
    vocab_start = tp.rank * v_local
    group = tp.group if tp.size > 1 else None
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(v_local, logits.device)
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, ignore_index,
                                            chunk_rows)
