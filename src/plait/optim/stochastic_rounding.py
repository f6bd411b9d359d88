"""Unbiased (stochastic) rounding of fp32 tensors to bf16, in plain tensor ops.

Why: a bf16 weight updated with round-to-nearest stalls once the update is below half the bf16
spacing at the weight (2^-8 relative): every step rounds back to the old value, so small learning
rates or late-training updates are silently lost. Rounding up with probability equal to the
fraction of the gap covered keeps the update in expectation, ``E[round(x)] = x``, so the weight
follows the fp32 trajectory on average without keeping an fp32 master copy.

Why in software: some accelerators have a stochastic-rounding conversion instruction, but not all,
and PyTorch exposes none. Integer ops on the fp32 bit pattern work on every device and give the
same result everywhere for the same random bits.

How: a bf16 number is the high 16 bits of an fp32 number. Read as an integer, the fp32 bit pattern
is monotone in the magnitude within each sign, with uniform spacing inside a binade, and the
pattern just above a binade's last value is the next binade's first (the carry into the exponent
is the correct next neighbour). Adding a uniform integer ``r`` in ``[0, 2^16)`` to the pattern and
dropping the low 16 bits therefore rounds the magnitude up with probability ``low16 / 2^16``,
exactly the distance from the lower neighbour divided by the spacing. The sign bit is untouched,
so negative values round in magnitude, which is again unbiased. Exact bf16 values have zero low
bits and never carry.

Edge cases, chosen deliberately:

* ``inf`` and ``nan`` are converted with round-to-nearest (a NaN whose payload lies only in the
  low 16 bits would otherwise truncate to ``inf``, and ``+nan`` patterns could wrap to ``-0``).
* A finite value above the largest bf16 value (``0x7F7F``, about 3.39e38) has ``inf`` as its
  upper neighbour in the bit order and rounds to it with probability proportional to its
  distance, as the fp32 -> bf16 round-to-nearest cast does for the upper half of that interval.
  We keep the overflow rather than saturating: an update that big signals divergence, and
  clamping to a finite maximum would hide it.
* Subnormals need no special case: they are evenly spaced integers in the same bit order, and
  only integer ops are used, so nothing flushes them to zero.
"""

from __future__ import annotations

import torch

_LOW_BITS = 16


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down to a bf16 neighbour with probability proportional to
    proximity, so that the expectation of the result is ``x``.

    ``generator`` supplies the random bits (on ``x.device``); pass a seeded one for reproducible
    rounding, e.g. identical rounding of replicas on different processes. The result has ``x``'s
    shape and is a new contiguous tensor.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16: x.dtype is {x.dtype}; only torch.float32 is supported")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << _LOW_BITS, x.shape, dtype=torch.int32, generator=generator, device=x.device)
    # Two's-complement addition is unsigned addition mod 2^32, so the carry out of the low half goes
    # into the magnitude bits for negative values too; finite patterns stay below 0x7F81_0000 and
    # 0xFF81_0000, so no addition of a finite value wraps. The arithmetic shift keeps the sign and
    # drops the low half; the value then fits int16, and its bits are the bf16 bits.
    high = torch.bitwise_right_shift(bits + noise, _LOW_BITS).to(torch.int16)
    rounded = high.view(torch.bfloat16)
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))
