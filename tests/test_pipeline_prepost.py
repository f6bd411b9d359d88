"""Pre-posted receives and pooled receive buffers change no number, and stop allocating.

On two gloo ranks a tiny Llama runs one step with blocking receives (``prepost_receives = 0``,
fresh buffers) and then three steps with receives posted ahead (``2``) from the pool the first
step filled, each on the same weights (no optimizer step) but different micro-batches per step
position. Losses and every gradient must equal the blocking run's bit for bit: a buffer handed
back to the pool while something still read it (the stage input autograd saved, the received
gradient that a deferred zb-h1 weight-gradient product holds) would be overwritten by the next
receive and change them. The pool must stop growing once a step has run with the pre-posting
window: no new receive buffers in later steps. Schedules: 1F1B, zb-h1 (B/W split), interleaved 1F1B (vpp=2: both
ranks receive activations and gradients), and "late-w": every forward, then every B, then every W
(a valid split-backward list in which later gradients arrive while earlier Ws still hold theirs;
handing a buffer back after its B instead of its W fails this test).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

SEQ, MB, M = 8, 2, 4


def _worker(rank: int, world: int, schedule: str) -> dict:
    from builders import build_llama_stages
    from plait.mesh import ParallelMesh
    from plait.models.llama.config import LlamaConfig
    from plait.pipeline.runtime import PipelineRuntime

    vpp = 2 if schedule == "interleaved-1f1b" else 1
    late_w = schedule == "late-w"
    if late_w:
        schedule = "zb-h1"
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2 * vpp,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    mesh = ParallelMesh(world, rank, pp=world)
    stages = build_llama_stages(config, mesh, [[i] for i in range(2 * vpp)], seed=0)
    runtime = PipelineRuntime(stages, mesh, schedule=schedule, microbatches=M, micro_batch_size=MB, seq_len=SEQ,
                              hidden_size=config.hidden_size, sequence_parallel=False, dtype=torch.float32)
    assert runtime.prepost_receives == 2, "gloo pre-posts by default"
    if late_w:
        runtime.use_tasks(_late_w_tasks(rank, world))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (M, MB, SEQ), generator=gen) for _ in range(2)]
    params = [p for s in stages for p in s.parameters()]

    def step(batch):
        for p in params:
            p.grad = None
        loss = runtime.run(batch, train=True)
        return loss.clone(), [p.grad.clone() for p in params]

    runtime.prepost_receives = 0
    ref = [step(b) for b in batches]  # blocking receives; the pool fills during these steps
    runtime.prepost_receives = 2
    mismatches, pool = [], set()
    for n in range(3):
        loss, grads = step(batches[n % 2])
        ref_loss, ref_grads = ref[n % 2]
        if not torch.equal(loss, ref_loss) or not all(map(torch.equal, grads, ref_grads)):
            mismatches.append(n)
        if n == 0:  # the window may hold a buffer or two more than blocking receives did
            pool = {t.data_ptr() for t in runtime._pool}
    return {"mismatch_steps": mismatches, "pool": len(pool),
            "new_buffers": len({t.data_ptr() for t in runtime._pool} - pool)}


def _late_w_tasks(rank: int, pp: int) -> list:
    from plait.pipeline import tasks as T

    first, last = rank == 0, rank == pp - 1
    out: list = []
    for mb in range(M):
        out += ([] if first else [T.RecvActivation(mb, 0)]) + [T.Forward(mb, 0)]
        out += [] if last else [T.SendActivation(mb, 0)]
    for mb in range(M):
        out += ([] if last else [T.RecvGradient(mb, 0)]) + [T.Backward(mb, 0)]
        out += [] if first else [T.SendGradient(mb, 0)]
    return out + [T.WeightGrad(mb, 0) for mb in range(M)] + [T.ReduceGradients()]


def _all_schedules(rank: int, world: int) -> dict:
    return {name: _worker(rank, world, name) for name in ("1f1b", "zb-h1", "interleaved-1f1b", "late-w")}


@pytest.mark.slow
def test_prepost_and_pooled_buffers_match_blocking_receives():
    for rank, per_schedule in enumerate(run_distributed(_all_schedules, 2)):
        for schedule, result in per_schedule.items():
            assert result["mismatch_steps"] == [], f"rank {rank} {schedule}: {result}"
            assert result["pool"] > 0 and result["new_buffers"] == 0, f"rank {rank} {schedule}: {result}"
