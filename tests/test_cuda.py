"""plait on one CUDA GPU: the training path against the CPU, bf16, NCCL, the grouped expert matmul.

Marked ``cuda`` and skipped (with the reason) where ``torch.cuda.is_available()`` is false, so
the default suite on a CPU machine counts them as skipped. Run them on a machine with a GPU with
``pytest -m cuda tests/test_cuda.py`` or as the first step of ``bash bench/device_check.sh``.

Every test trains or runs through plait's own entry points: the stages from
:func:`plait.materialize.build_stages`, the optimizer and runtime the trainer builds
(:class:`~plait.data_parallel.optimizer.DistributedOptimizer`,
:func:`plait.train.build_run.build_runtime`), one :func:`plait.train.step.train_step` per step, and
the process group from :func:`plait.launch.init_worker` (what ``plait train`` calls in each rank).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import traceback

import pytest
import torch

from grouped_mm_calls import count_grouped_mm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs a CUDA GPU (torch {torch.__version__} sees none here)"),
]

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 256, 32, 2, 2
#: fp32 on CUDA against fp32 on the CPU: other matmul and attention kernels (cuBLAS and the CUDA
#: SDPA kernels against the CPU's), so other summation orders, each an fp32 round-off (~1e-7
#: relative). The first step's loss is a forward alone; the later ones also carry the AdamW
#: updates' differences, which stay of the same order over a few steps. Both bounds leave a
#: margin of about 100x over that round-off.
FIRST_LOSS_RTOL = 1e-5
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3
#: a bf16 forward against the fp32 one at the same initial weights: bf16 keeps 8 bits of mantissa
#: (relative rounding 4e-3 per operation); the loss is an average over 128 tokens
BF16_FIRST_LOSS_RTOL = 2e-2


def _config():
    from plait.models.llama.config import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _batches(steps: int, repeat: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (MICROBATCHES, MICRO_BATCH, SEQ)
    if repeat:  # one batch seen again each step: the loss must fall
        return [torch.randint(0, VOCAB, shape, generator=gen)] * steps
    return [torch.randint(0, VOCAB, shape, generator=gen) for _ in range(steps)]


def train(device: str, preset: str, steps: int = 6, *, repeat: bool = False, mesh=None) -> dict[str, list[float]]:
    """``steps`` training steps of a tiny Llama on ``device`` through plait's training path (one
    process, one pipeline stage, two micro-batches accumulated); the per-step losses and norms."""
    from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
    from plait.materialize import build_stages
    from plait.mesh import single_process_mesh
    from plait.precision import policy_for
    from plait.train.build_run import build_runtime
    from plait.train.step import train_step

    config = _config()
    mesh = mesh if mesh is not None else single_process_mesh()
    (stage,) = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=0, device=device)
    policy = policy_for(preset)
    hyper = OptimizerHyper(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    optimizer = DistributedOptimizer([stage], policy, hyper, dp=mesh.info("dp"), tp=mesh.info("tp"), pp=mesh.info("pp"))
    runtime = build_runtime([stage], mesh, policy, optimizer, schedule="1f1b", microbatches=MICROBATCHES,
                            micro_batch_size=MICRO_BATCH, seq_len=SEQ, sequence_parallel=False)
    losses, norms = [], []
    for batch in _batches(steps, repeat):
        loss, norm = train_step(runtime, optimizer, batch, grad_clip=1.0)
        losses.append(float(loss))
        norms.append(float(norm))
    return {"losses": losses, "norms": norms}


@pytest.fixture
def full_fp32_matmuls():
    """fp32 matmuls in full precision (no TF32) for the test, whatever the environment set."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_fp32_training_on_cuda_matches_the_cpu(full_fp32_matmuls):
    cpu = train("cpu", "fp32")
    gpu = train("cuda", "fp32")
    assert _relative(gpu["losses"][0], cpu["losses"][0]) <= FIRST_LOSS_RTOL, (gpu["losses"][0], cpu["losses"][0])
    worst = max(_relative(g, c) for g, c in zip(gpu["losses"], cpu["losses"], strict=True))
    assert worst <= LOSS_RTOL, (gpu["losses"], cpu["losses"])
    worst_norm = max(_relative(g, c) for g, c in zip(gpu["norms"], cpu["norms"], strict=True))
    assert worst_norm <= GRAD_NORM_RTOL, (gpu["norms"], cpu["norms"])


@pytest.mark.parametrize("preset", ["autocast", "bf16-mixed"])
def test_bf16_training_on_cuda_is_finite_and_learns(preset, full_fp32_matmuls):
    reference = train("cuda", "fp32", steps=1, repeat=True)["losses"][0]
    run = train("cuda", preset, steps=8, repeat=True)
    assert all(math.isfinite(v) for v in run["losses"] + run["norms"]), run
    assert _relative(run["losses"][0], reference) <= BF16_FIRST_LOSS_RTOL, (run["losses"][0], reference)
    assert run["losses"][-1] < run["losses"][0] - 0.1, f"{preset}: the loss on a repeated batch must fall: {run}"


# ------------------------------------------------------------------------------ NCCL, one rank
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_worker(port: int, queue) -> None:
    """One rank, as ``plait train`` starts it: the launcher's environment, then ``init_worker``."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from plait.launch import finish_worker, init_worker
    from plait.mesh import ParallelMesh

    try:
        rank, world = init_worker()
        t = torch.arange(4, dtype=torch.float32, device="cuda") + 1
        dist.all_reduce(t)  # a sum over one rank: the values themselves
        gathered = [torch.empty(4, device="cuda")]
        dist.all_gather(gathered, t)
        dist.broadcast(t, src=0)
        torch.cuda.synchronize()
        mesh = ParallelMesh(world, rank)  # the process groups of every axis, on NCCL
        run = train("cuda", "bf16-mixed", steps=2, mesh=mesh)
        queue.put(("ok", {"rank": rank, "world": world, "backend": dist.get_backend(), "sum": t.tolist(),
                          "gathered": gathered[0].tolist(), "device": torch.cuda.current_device(), **run}))
        finish_worker()
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put(("error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # the result is sent before the process leaves
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def test_one_rank_nccl_process_group_all_reduce_and_a_training_step():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_nccl_worker, args=(_free_port(), queue))
    proc.start()
    try:
        status, payload = queue.get(timeout=180)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", payload
    assert payload["backend"] == "nccl" and (payload["rank"], payload["world"]) == (0, 1), payload
    assert payload["sum"] == [1.0, 2.0, 3.0, 4.0] == payload["gathered"], payload
    assert all(math.isfinite(v) for v in payload["losses"] + payload["norms"]), payload


# ------------------------------------------------------------------------------ MoE grouped matmul
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="torch._grouped_mm runs on CUDA from compute capability 9.0 (Hopper) on")
def test_grouped_expert_matmul_on_cuda_matches_the_expert_loop(monkeypatch):
    """A bf16 MoE layer on the GPU takes the grouped path (torch._grouped_mm, no host read) and gives
    the per-expert loop's outputs and gradients."""
    from plait.nn.moe import MoELayer, SoftmaxTopKRouter
    from plait.nn.moe import experts as experts_module

    torch.manual_seed(0)
    hidden, inter, num_experts = 64, 32, 8  # rows of 64 and 32 bf16 values: multiples of 16 bytes
    layer = MoELayer(hidden, num_experts, inter, SoftmaxTopKRouter(hidden, num_experts, 2),
                     device="cuda", dtype=torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(4, 24, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 24, hidden, device="cuda", dtype=torch.bfloat16)

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        return y.detach().float(), xi.grad.float(), {n: p.grad.float() for n, p in layer.named_parameters()}

    calls = count_grouped_mm(monkeypatch)
    y, dx, grads = run()
    assert len(calls) == 2 + 4, f"grouped path not taken on {torch.cuda.get_device_name()}: {len(calls)} calls"
    monkeypatch.setattr(experts_module, "grouped_mm_usable", lambda *a, **k: False)
    y_loop, dx_loop, grads_loop = run()
    assert len(calls) == 6, "the loop must not call torch._grouped_mm"

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # bf16 results, fp32 accumulation in both
        return float((a - b).abs().max()) <= 2e-2 * float(b.abs().max()) + 1e-6

    assert close(y, y_loop) and close(dx, dx_loop)
    bad = [n for n in grads_loop if not close(grads[n], grads_loop[n])]
    assert not bad, bad
