"""The flat-buffer fused AdamW step equals ``torch.optim.AdamW(fused=True)`` on the segments.

Not bitwise in the moments: torch's CPU kernel rounds a tensor's SIMD body and its scalar tail
differently (fused multiply-add in one, not the other), so an element's last bit depends on where
the tensor boundaries fall; one flat run puts elements in the SIMD body that per-segment tensors
put in a tail. The tolerances are fp32 ulps: weights within one (a relative 2^-22 bounds one ulp
at any mantissa), moments within a few.
"""

from __future__ import annotations

import pytest
import torch

from plait.comm.primitives import GroupInfo
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.optim.flat_adamw import FlatAdamW, FlatRun
from plait.precision import policy_for

ULP = 2.0**-22  #: relative size of one fp32 ulp, at most
SIZES = [7, 130, 1, 64, 33]  # segment lengths; the gap after the last is padding
DECAY = [True, False, True, False, True]


def _flat(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _pair(weight_decay: float):
    """(FlatAdamW over one run, torch's fused AdamW over copies of the segments), same values."""
    n = sum(SIZES) + 5
    values, grads = _flat(0, n), torch.zeros(n)
    values[sum(SIZES):] = 0
    segs, at = [], 0
    for size in SIZES:
        seg = values[at:at + size]
        seg.grad = grads[at:at + size]
        segs.append(seg)
        at += size
    groups = [{"params": [s for s, d in zip(segs, DECAY, strict=True) if d], "weight_decay": weight_decay},
              {"params": [s for s, d in zip(segs, DECAY, strict=True) if not d], "weight_decay": 0.0}]
    flat = FlatAdamW(groups, [FlatRun(values, grads, segs)], lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    copies = [s.detach().clone() for s in segs]
    ref_groups = [{"params": [c for c, d in zip(copies, DECAY, strict=True) if d], "weight_decay": weight_decay},
                  {"params": [c for c, d in zip(copies, DECAY, strict=True) if not d], "weight_decay": 0.0}]
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, fused=True)
    return flat, values, grads, segs, ref, copies


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_flat_step_matches_torch_fused_adamw(weight_decay):
    flat, values, grads, segs, ref, copies = _pair(weight_decay)
    n = sum(SIZES)
    for step in range(5):
        grads[:n].copy_(_flat(100 + step, n))
        for c, s in zip(copies, segs, strict=True):
            c.grad = s.grad.clone()
        if step == 3:  # a skipped step (non-finite gradients): nothing changes, counters restored
            before = [t.clone() for s in segs for t in (s, flat.state[s]["exp_avg"], flat.state[s]["exp_avg_sq"])]
            flat.found_inf = torch.ones(())  # type: ignore[attr-defined]
            flat.step()
            del flat.found_inf  # type: ignore[attr-defined]
            after = [t for s in segs for t in (s, flat.state[s]["exp_avg"], flat.state[s]["exp_avg_sq"])]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            continue
        flat.step()
        ref.step()
        for s, c in zip(segs, copies, strict=True):
            torch.testing.assert_close(s, c, rtol=ULP, atol=0)
            torch.testing.assert_close(flat.state[s]["exp_avg"], ref.state[c]["exp_avg"], rtol=2.5e-7, atol=0)
            torch.testing.assert_close(flat.state[s]["exp_avg_sq"], ref.state[c]["exp_avg_sq"], rtol=5e-7, atol=0)
            assert flat.state[s]["step"].item() == ref.state[c]["step"].item()
    assert not values[n:].any(), "padding must stay zero"


def test_groups_with_different_lr_fall_back_to_per_group_steps():
    flat, _, grads, segs, ref, copies = _pair(0.1)
    n = sum(SIZES)
    flat.param_groups[1]["lr"] = ref.param_groups[1]["lr"] = 3e-3
    for step in range(3):
        grads[:n].copy_(_flat(200 + step, n))
        for c, s in zip(copies, segs, strict=True):
            c.grad = s.grad.clone()
        flat.step()
        ref.step()
    for s, c in zip(segs, copies, strict=True):
        torch.testing.assert_close(s, c, rtol=ULP, atol=0)


def test_grad_scale_divides_the_gradients_in_the_kernel():
    """Clipping folded into the step: dividing by ``1 / coef`` in the kernel is ``grad * coef`` to an ulp."""
    flat, _, grads, segs, ref, copies = _pair(0.1)
    n = sum(SIZES)
    coef = torch.tensor(0.37)
    for step in range(3):
        grads[:n].copy_(_flat(300 + step, n))
        for c, s in zip(copies, segs, strict=True):
            c.grad = s.grad * coef
        flat.grad_scale = coef.reciprocal()  # type: ignore[attr-defined]
        flat.step()
        ref.step()
    for s, c in zip(segs, copies, strict=True):
        torch.testing.assert_close(s, c, rtol=2 * ULP, atol=0)


def test_distributed_optimizer_steps_one_flat_run_per_buffer():
    """Without ZeRO-1 the whole buffer is one run; its step (clipping folded in) equals the
    per-parameter fused AdamW after ``clip_grad_norm_``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    ref_model.load_state_dict(model.state_dict())
    solo = GroupInfo.single()
    opt = DistributedOptimizer([model], policy_for("fp32"), OptimizerHyper(1e-2, 0.1, (0.9, 0.95), 1e-8),
                               dp=solo, tp=solo, bucket_mb=16 * 8 * 4 / 2**20)
    assert isinstance(opt.inner, FlatAdamW) and len(opt.inner.runs) == 1 < len(opt.bucket_plan.buckets)
    decay = [p for n, p in ref_model.named_parameters() if p.dim() > 1]
    keep = [p for n, p in ref_model.named_parameters() if p.dim() < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        opt.grads.mark_final()
        model(x).square().mean().backward()
        opt.grads.finish()
        opt.clip_(opt.grad_norm(), 0.05)
        opt.step()
        ref.zero_grad()
        ref_model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        ref.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        # the norm is summed in another order, and the clip factor applied by division: round-off,
        # which Adam's normalisation turns into update differences of a few 1e-8 at lr 1e-2
        # (without the clipping the weights would differ by ~2e-3 here)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_an_lr_scheduler_sees_the_run_by_run_step():
    """step_runs bypasses torch's step wrapper; a scheduler stepped after it must not warn that the
    optimizer never stepped (it did: the learning rates are right, only the warning would be wrong)."""
    import warnings

    flat, *_ = _pair(0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(flat, lambda step: 1.0 / (step + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat.step_runs()
        scheduler.step()
    assert flat.param_groups[0]["lr"] == pytest.approx(0.5e-2)
