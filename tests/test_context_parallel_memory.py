"""The planner's context-parallel memory terms (plait.context_parallel.plan, plait.plan.memory).

The ring kernel's transient (:func:`attention_workspace_bytes`) is checked against the tensors a
piece's backward really keeps alive (a dispatch mode holding a weak reference to every storage an op
creates, peak over the ops), and the estimate's use of it as data. The measured per-rank peak at
cp=1/2/4 against the estimate is ``bench/measure_memory.py --cp`` (docs/context_parallel.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from plait.context_parallel.piecewise import backward_block
from plait.context_parallel.plan import (
    BACKWARD_SCORE_TENSORS,
    attention_workspace_bytes,
    piece_scores_bytes,
    pieces,
    ring_buffer_bytes,
)
from plait.context_parallel.ring import backward_inputs
from plait.context_parallel.split import SequenceSplit
from plait.models.llama.config import LlamaConfig
from plait.plan.degrees import ParallelDegrees
from plait.plan.memory import chunk_cost, estimate_memory, rank_chunks

MiB = 1024**2


class _PeakStorages(TorchDispatchMode):
    """Peak bytes of the storages ops create, alive at once (checked after every op); the storages of
    ``inputs`` (which views of them share) are not counted."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in inputs}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.skip:
                ref = StorageWeakRef(t.untyped_storage())
                self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.peak = max(self.peak, sum(n for ref, n in self.refs.values() if not ref.expired()))
        return out


def test_workspace_term_is_the_piece_backward_peak():
    """One diagonal piece's backward: the peak of what it allocates is the priced workspace (five fp32
    score tensors and the causal mask) plus the small per-token gradients."""
    b, kvh, g, n, d = 1, 2, 2, 96, 4
    split = SequenceSplit(2 * n, 1)  # one rank: its two chunks meet in one full and two diagonal pieces
    torch.manual_seed(0)
    q = torch.randn(b, kvh * g, 2 * n, d)
    kv = torch.randn(2, b, kvh, 2 * n, d)
    out, grad = torch.randn(b, kvh, g, 2 * n, d), torch.randn(b, kvh * g, 2 * n, d)
    lse = torch.randn(b, kvh, g, 2 * n)
    qg, dout, delta, dq = backward_inputs(q, kvh, out, grad)
    diagonal = tuple(p for p in pieces(split, 0, 0) if p.kind == "diagonal")[:1]
    with _PeakStorages([qg, kv, dout, lse, delta, dq]) as mode:
        backward_block(qg, kv, dout, lse, delta, diagonal, split, None, 0.5, dq)
    term = attention_workspace_bytes(b, 2 * n, kvh * g)
    assert term == BACKWARD_SCORE_TENSORS * 4 * b * kvh * g * n * n + n * n
    small = 4 * (2 * b * kvh * 2 * n * d + 4 * b * kvh * g * n * d)  # dkv, dq/dk/dv of the piece
    assert term <= mode.peak <= term + small, (mode.peak, term)


def test_workspace_and_ring_terms_as_data():
    assert piece_scores_bytes(2, 8192, 8) == 4 * 2 * 8 * 4096 * 4096
    assert attention_workspace_bytes(1, 4096, 4) == 5 * 4 * 4 * 2048**2 + 2048**2
    assert ring_buffer_bytes(1, 4096, 64) == 5 * 2 * 4096 * 64 * 4
    # quadratic in the chunk: doubling cp at a fixed sequence quarters it (up to the mask)
    assert attention_workspace_bytes(1, 8192 // 4, 4) * 4 == pytest.approx(attention_workspace_bytes(1, 8192 // 2, 4),
                                                                            rel=0.01)


CP_DEMO = LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      max_position_embeddings=8192)


@pytest.mark.parametrize("cp", [2, 4])
def test_estimate_prices_the_ring_workspace_less_what_is_released(cp):
    """At cp > 1 the backward transient is the workspace less what the micro-batch has freed before
    the last layer's attention backward; at cp = 1 (SDPA) nothing of it is priced."""
    S, local = 8192, 8192 // cp
    layout = ParallelDegrees(cp=cp)
    (chunk,) = rank_chunks(CP_DEMO, layout, local, 0)
    cost = chunk_cost(CP_DEMO, layout, "fp32", chunk, 1, local)
    h, i, N = 128, 256, local
    # the chunked loss saves the (fp32) logits and two fp32 numbers per token, no softmax
    released = (4 * N * 2048 + 8 * N + (N * h * 8 + 4 * N + N * h * 4)  # loss, final norm, head input
                + (N * h * 8 + 4 * N + N * h * 4 + 4 * N * i * 4))  # last layer: norm, gate/up input, MLP
    assert cost.backward_transient == attention_workspace_bytes(1, local, 4) - released  # the scores dominate
    est = estimate_memory(CP_DEMO, layout, precision="fp32", micro_batch_size=1, seq_len=S, microbatches=1)
    assert est.workspace == cost.backward_transient
    assert est.comm_buffers == ring_buffer_bytes(1, local, 64)
    one = estimate_memory(CP_DEMO, ParallelDegrees(), precision="fp32", micro_batch_size=1, seq_len=S, microbatches=1)
    assert one.comm_buffers == 0 and one.workspace == 8 * S * 2048  # SDPA: the loss backward, no score workspace


def test_selective_checkpointing_releases_only_the_head():
    layout = ParallelDegrees(cp=2, activation_checkpointing="selective")
    (chunk,) = rank_chunks(CP_DEMO, layout, 4096, 0)
    cost = chunk_cost(CP_DEMO, layout, "fp32", chunk, 1, 4096)
    N, h = 4096, 128
    released = 4 * N * 2048 + 8 * N + N * h * 8 + 4 * N + N * h * 4  # saved logits + 2 numbers/token, norm, head input
    assert cost.backward_transient == attention_workspace_bytes(1, 4096, 4) - released
    full = chunk_cost(CP_DEMO, dataclasses.replace(layout, activation_checkpointing="none"), "fp32", chunk, 1, 4096)
    assert full.backward_transient < cost.backward_transient


def test_loss_under_cp_is_priced_as_the_vocab_parallel_loss():
    """cp's output module runs the vocab-parallel cross-entropy even at TP = 1: its loss working set
    is the one a TP = 2 rank with the same local vocabulary has, not F.cross_entropy's."""
    layout = ParallelDegrees(cp=2)
    (chunk,) = rank_chunks(CP_DEMO, layout, 1024, 0)
    cp2 = chunk_cost(CP_DEMO, layout, "fp32", chunk, 1, 1024)
    wide = dataclasses.replace(CP_DEMO, vocab_size=2 * CP_DEMO.vocab_size)  # 2048 rows per rank at TP = 2
    (tp_chunk,) = rank_chunks(wide, ParallelDegrees(tp=2), 1024, 0)
    tp2 = chunk_cost(wide, ParallelDegrees(tp=2), "fp32", tp_chunk, 1, 1024)
    assert (cp2.logits_saved, cp2.forward_transient) == (tp2.logits_saved, tp2.forward_transient)
    one = chunk_cost(CP_DEMO, ParallelDegrees(), "fp32", chunk, 1, 1024)  # TP = 1 without cp: F.cross_entropy
    # F.cross_entropy saves no per-token numbers and frees no saved logits in backward; the forward
    # working sets can coincide (the chunked loss's chunk depends on the thread count)
    assert (one.logits_saved, one.backward_transient) != (cp2.logits_saved, cp2.backward_transient)


@pytest.mark.slow
def test_measured_activation_peak_within_15_percent_of_the_estimate():
    """``bench/measure_memory.py --cp`` at seq_len 8192, cp=1 and cp=2 (ring): every rank's measured
    activation peak (forward + backward, above the model states) is within 15% of the planner's."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "bench" / "measure_memory.py"), "--cp", "--layouts", "cp1,cp2",
                          "--no-warmup"], cwd=root, capture_output=True, text=True, timeout=1200,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stdout.split("activation peak measured MiB")[1]
    ratios = {(m.group(1), m.group(2)): float(m.group(3))
              for m in re.finditer(r"^\| (cp\d) \(m=1\) \| fp32 \| off \| (\d) \|.*\| ([\d.]+) \|$", table, re.M)}
    assert set(ratios) == {("cp1", "0"), ("cp2", "0"), ("cp2", "1")}, run.stdout[-3000:]
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios
