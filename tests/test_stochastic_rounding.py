"""Stochastic rounding to bf16 and the low-precision AdamW built on it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.optim.lowp_adamw import LowPrecisionAdamW
from plait.optim.stochastic_rounding import stochastic_round_to_bf16


def _from_bits(bits: list[int]) -> torch.Tensor:
    """fp32 tensor with the given 32-bit patterns (given as unsigned ints)."""
    signed = [b - (1 << 32) if b >= (1 << 31) else b for b in bits]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above |x| in magnitude (as fp32), with x's sign."""
    bits = x.view(torch.int32)
    lo = (bits & ~0xFFFF).view(torch.float32)
    hi = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return lo, hi


# Lower neighbours: ordinary, negative, tiny normal, large, fp32-subnormal (also bf16-subnormal),
# and the last bf16 value of a binade for each sign, whose upper neighbour is the next binade's
# first value (the carry runs into the exponent).
_BASES = [1.0, -3.0, 1e-30, 1e30, -1e30, 1e-39]
_BINADE_TOPS = [0x3FFF0000, 0xBFFF0000]  # 1.9921875 -> 2.0 and its negative


def test_unbiased_and_only_neighbours():
    base = torch.tensor(_BASES, dtype=torch.float32).to(torch.bfloat16).float()
    base = torch.cat([base, _from_bits(_BINADE_TOPS)])
    lo, hi = _bf16_neighbours(base)
    assert torch.equal(lo, base)
    fracs = torch.tensor([0.25, 0.5, 0.9], dtype=torch.float64)
    lo64, hi64 = lo.double()[:, None], hi.double()[:, None]
    x = (lo64 + fracs * (hi64 - lo64)).float().reshape(-1)  # fp32 values strictly inside the gaps
    lo_x, hi_x = _bf16_neighbours(x)
    assert bool(((x != lo_x) & (x != hi_x)).all())
    # The probability of rounding up is the fp32 value's actual position in the gap (0.9 is not
    # exact in fp32, nor in the subnormal gap).
    p = ((x.double() - lo_x.double()) / (hi_x.double() - lo_x.double()))

    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    out = stochastic_round_to_bf16(x[:, None].expand(-1, n).contiguous(), gen)
    assert out.dtype == torch.bfloat16
    out32 = out.float()
    is_lo, is_hi = out32 == lo_x[:, None], out32 == hi_x[:, None]
    assert bool((is_lo | is_hi).all()), "every result is one of the two bf16 neighbours"
    # The mean is lo + gap * (fraction rounded up); the fraction is a Bernoulli(p) mean, whose
    # standard error is sqrt(p(1-p)/n). Five of them: a false failure has odds ~1e-6 per value.
    frac_up = is_hi.double().mean(dim=1)
    mean = lo_x.double() + frac_up * (hi_x.double() - lo_x.double())
    bound = 5 * torch.sqrt(p * (1 - p) / n) * (hi_x.double() - lo_x.double()).abs()
    err = (mean - x.double()).abs()
    assert bool((err <= bound).all()), f"bias exceeds 5 s.e. for {x[err > bound].tolist()}"


def test_exact_bf16_values_unchanged():
    gen = torch.Generator().manual_seed(0)
    every_pattern = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every_pattern[torch.isfinite(every_pattern)]
    x = finite.float()[None, :].expand(8, -1).contiguous()
    out = stochastic_round_to_bf16(x, gen)
    assert torch.equal(out.view(torch.int16), finite.view(torch.int16)[None, :].expand(8, -1))  # keeps -0.0


def test_nonfinite_and_overflow():
    gen = torch.Generator().manual_seed(0)
    # inf, -inf, quiet NaN, and NaNs whose payload sits only in the low 16 bits (a carry-free
    # truncation would make the first one inf) or whose pattern would wrap around (0xFFFFFFFF).
    x = _from_bits([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFF80FFFF, 0xFFFFFFFF, 0x7FFFFFFF])
    out = stochastic_round_to_bf16(x[None, :].expand(1000, -1).contiguous(), gen).float()
    assert bool((out[:, 0] == math.inf).all()) and bool((out[:, 1] == -math.inf).all())
    assert bool(out[:, 2:].isnan().all())
    # Above the largest bf16 value the upper neighbour is inf (documented choice, as with the
    # round-to-nearest cast for the upper half of that interval).
    bmax = torch.finfo(torch.bfloat16).max
    fmax = torch.full((10_000,), torch.finfo(torch.float32).max)
    out = stochastic_round_to_bf16(fmax, gen).float()
    assert bool(((out == bmax) | (out == math.inf)).all())
    mid = _from_bits([0x7F7F8000, 0xFF7F8000]).repeat(10_000).reshape(10_000, 2)  # halfway to +-inf
    out = stochastic_round_to_bf16(mid, gen).float()
    assert bool(((out[:, 0] == bmax) | (out[:, 0] == math.inf)).all())
    assert bool(((out[:, 1] == -bmax) | (out[:, 1] == -math.inf)).all())
    assert 0.45 < out.isinf().double().mean().item() < 0.55


def test_seeded_generator_is_deterministic():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    a = stochastic_round_to_bf16(x, torch.Generator().manual_seed(7))
    b = stochastic_round_to_bf16(x, torch.Generator().manual_seed(7))
    c = stochastic_round_to_bf16(x, torch.Generator().manual_seed(8))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))
    with pytest.raises(ValueError, match="float32"):
        stochastic_round_to_bf16(x.double())


def _grads(shapes: list[tuple[int, ...]], steps: int, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def test_fp32_params_match_torch_adamw():
    shapes = [(16, 8), (8,), (4, 4)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]

    def groups(ps):
        return [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0, "lr": 3e-3}]

    opt = LowPrecisionAdamW(groups(ours), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, stochastic_rounding=True)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False, fused=False)
    # A scheduler changes param_groups[i]["lr"]; ours must follow it as torch's does.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    for grads in _grads(shapes, 10, seed=99):
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    # Same fp32 operations in the same order, so agreement is expected to be exact; 1e-6 relative
    # leaves room only for a different libm pow in the bias corrections.
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)
        assert opt.state[p]["step"] == 10


def _train_constant_grad(p: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()


def _expected_bf16_moment_trajectory(steps: int, lr: float, betas: tuple[float, float], eps: float) -> float:
    """Where the weight should go on average, in fp64, from the same update with bf16 moments.

    With a constant gradient and no weight decay the moments do not depend on the weight, so they
    are identical for every element and for rounded or unrounded weights. They are stored in bf16
    with round-to-nearest, which biases them (v rounds up by up to half a gap each step): that is
    the optimizer's specified behaviour, not the weight rounding under test, so the reference
    reproduces it and only the weight is kept exact.
    """
    beta1, beta2 = betas
    m = torch.zeros(1, dtype=torch.bfloat16)
    v = torch.zeros(1, dtype=torch.bfloat16)
    g = torch.ones(1)
    p = 1.0
    for step in range(1, steps + 1):
        m32, v32 = m.float().lerp_(g, 1 - beta1), v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v32.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
        p -= (lr / (1 - beta1 ** step) * m32 / denom).double().item()
        m, v = m32.to(torch.bfloat16), v32.to(torch.bfloat16)
    return p


def test_stochastic_rounding_fixes_the_stall():
    # With a constant gradient Adam moves each weight by ~lr per step. At 1.0 moving down, the bf16
    # gap is 2^-8, so an update of 1e-3 < 2^-9 rounds back to 1.0 every time without SR.
    n, steps, lr = 4096, 200, 1e-3
    plain = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    sr = torch.ones(n, dtype=torch.bfloat16, requires_grad=True)
    ref = torch.ones(n, dtype=torch.float32, requires_grad=True)
    _train_constant_grad(plain, LowPrecisionAdamW([plain], lr=lr), steps)
    _train_constant_grad(sr, LowPrecisionAdamW([sr], lr=lr, stochastic_rounding=True, seed=3), steps)
    _train_constant_grad(ref, torch.optim.AdamW([ref], lr=lr, weight_decay=0.0, foreach=False), steps)

    assert bool((plain == 1.0).all()), "round-to-nearest stalls"
    assert 1.0 - ref.detach()[0].item() == pytest.approx(steps * lr, rel=1e-3)
    expected = _expected_bf16_moment_trajectory(steps, lr, (0.9, 0.999), 1e-8)
    # Error of the SR mean: each step's rounding error is zero-mean, at most one gap (2^-8 below
    # 1.0) wide, and does not feed back into later updates (no weight decay, constant gradient),
    # so per element the total has std <= sqrt(steps) * 2^-8 / 2, and the mean over n elements
    # that over sqrt(n). Five of those is ~2e-3, against a distance moved of ~0.2.
    sigma_mean = math.sqrt(steps) * 2.0 ** -8 / 2 / math.sqrt(n)
    sr_mean = sr.detach().double().mean().item()
    assert abs(sr_mean - expected) <= 5 * sigma_mean
    # Against fp32 AdamW the bf16 moments add their own bias (v stored rounded up, so steps come out
    # a few percent short here); the weight still covers most of the fp32 distance.
    assert (1.0 - sr_mean) == pytest.approx(1.0 - ref.detach()[0].item(), rel=0.05)
    assert sr.detach().unique().numel() > 1  # the elements took different roundings


def _bf16_params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(torch.bfloat16).requires_grad_() for s in [(32, 16), (16,), (16,)]]


def _run(params: list[torch.Tensor], seed: int, steps: int = 5) -> LowPrecisionAdamW:
    opt = LowPrecisionAdamW([{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:]}],
                            lr=1e-3, stochastic_rounding=True, seed=seed)
    for grads in _grads([tuple(p.shape) for p in params], steps, seed=11):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    return opt


def test_replicas_round_identically():
    init = _bf16_params(0)
    a = [p.detach().clone().requires_grad_() for p in init]
    b = [p.detach().clone().requires_grad_() for p in init]
    _run(a, seed=42)
    # Advance the global stream between the two: the rounding must not depend on it.
    torch.manual_seed(123)
    torch.rand(1000)
    _run(b, seed=42)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    c = [p.detach().clone().requires_grad_() for p in init]
    _run(c, seed=43)
    assert any(not torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(a, c, strict=True))


def test_distinct_positions_round_independently():
    # Two equal parameters with equal gradients at different positions must get different random
    # bits; otherwise all replicated copies of a layer would share rounding errors.
    p = torch.full((4096,), 1.0, dtype=torch.bfloat16, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    opt = LowPrecisionAdamW([p, q], lr=1e-3, stochastic_rounding=True)
    for _ in range(3):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
    assert not torch.equal(p.view(torch.int16), q.view(torch.int16))


def test_bf16_state_dtype_and_state_dict_round_trip():
    params = _bf16_params(1)
    opt = _run(params, seed=5, steps=3)
    for p in params:
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg_sq"].dtype == torch.bfloat16
        assert st["step"] == 3
    saved = copy.deepcopy(opt.state_dict())
    twin = [p.detach().clone().requires_grad_() for p in params]
    opt2 = LowPrecisionAdamW([{"params": twin[:2], "weight_decay": 0.01}, {"params": twin[2:]}],
                             lr=1e-3, stochastic_rounding=True, seed=999)
    opt2.load_state_dict(saved)  # restores the seed too: it is a group setting
    for o, ps in ((opt, params), (opt2, twin)):
        for grads in _grads([tuple(p.shape) for p in ps], 3, seed=77):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.to(torch.bfloat16)
            o.step()
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        assert opt2.state[q]["step"] == 6


class _CountHostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``, the op behind ``.item()``, ``float(t)`` and ``bool(t)``."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_step_reads_nothing_back_to_the_host():
    params = _bf16_params(2)
    opt = _run(params, seed=1, steps=1)
    for p in params:
        p.grad = torch.ones_like(p)
    with _CountHostReads() as counter:
        opt.step()
    assert counter.reads == 0


def test_rejects_bad_settings():
    p = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="lr"):
        LowPrecisionAdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        LowPrecisionAdamW([p], betas=(0.9, 1.0))
