"""Which samples make up each global batch: a pure function of ``(seed, step)``, independent of the DP degree.

Samples are numbered globally across the whole run: global sample ``k`` (``k = step *
global_batch_size + j``) is dataset index ``perm_e[k % num_samples]`` with epoch ``e = k //
num_samples`` and ``perm_e`` the permutation of ``range(num_samples)`` drawn from
``numpy.random.default_rng(seed + e)``. A DP rank takes a contiguous slice of the global batch,
so the samples a step trains on do not depend on how many ranks share it, and resuming at step
``k`` needs nothing but ``k``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


class GlobalBatchSampler:
    """Deterministic global batches: ``indices(step)`` for the whole batch, ``rank_indices`` for one DP rank."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0):
        for name, value, low in (("num_samples", num_samples, 1), ("global_batch_size", global_batch_size, 1),
                                 ("seed", seed, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        self.num_samples, self.global_batch_size, self.seed = int(num_samples), int(global_batch_size), int(seed)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()  # the last few epochs' permutations
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the dataset in ``epoch`` (int64 array of length ``num_samples``)."""
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
                self._perms[epoch] = perm
                while len(self._perms) > 2:
                    self._perms.popitem(last=False)
            else:
                self._perms.move_to_end(epoch)
            return perm

    def samples(self, start: int, stop: int) -> list[int]:
        """Dataset indices of global samples ``start .. stop-1``."""
        if start < 0 or stop < start:
            raise ValueError(f"sample range [{start}, {stop}) is not valid")
        out: list[int] = []
        k = start
        while k < stop:
            epoch, pos = divmod(k, self.num_samples)
            take = min(stop - k, self.num_samples - pos)
            out.extend(self.permutation(epoch)[pos:pos + take].tolist())
            k += take
        return out

    def epoch(self, step: int) -> int:
        """The epoch of the first sample of ``step``."""
        return step * self.global_batch_size // self.num_samples

    def indices(self, step: int) -> list[int]:
        """The global batch of ``step``: ``global_batch_size`` dataset indices."""
        self._check_step(step)
        first = step * self.global_batch_size
        return self.samples(first, first + self.global_batch_size)

    def rank_indices(self, step: int, dp_rank: int, dp: int, microbatches: int = 1) -> list[list[int]]:
        """DP rank ``dp_rank``'s contiguous slice of step ``step``'s global batch, as ``microbatches`` lists.

        The slice is ``global_batch_size // dp`` samples starting at ``dp_rank * global_batch_size // dp``,
        cut into ``microbatches`` consecutive runs of ``global_batch_size // (dp * microbatches)``.
        """
        self._check_step(step)
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"dp={dp!r} must be a positive integer")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank!r} must be in [0, {dp})")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
        if self.global_batch_size % (dp * microbatches):
            raise ValueError(f"global_batch_size={self.global_batch_size} is not divisible by dp * microbatches = "
                             f"{dp} * {microbatches}; choose a global batch that is a multiple of {dp * microbatches}")
        local = self.global_batch_size // dp
        micro = local // microbatches
        first = step * self.global_batch_size + dp_rank * local
        flat = self.samples(first, first + local)
        return [flat[m * micro:(m + 1) * micro] for m in range(microbatches)]

    @staticmethod
    def _check_step(step: int) -> None:
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
