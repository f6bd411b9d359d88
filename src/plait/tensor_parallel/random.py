"""A second random stream, one per tensor-parallel rank, for randomness on sharded activations.

Tensor parallelism splits some activations across the ranks of a TP group (attention heads,
and under sequence parallelism the sequence outside attention and MLP) and keeps others
replicated (the hidden states between blocks without sequence parallelism). Dropout needs
different rules for the two kinds:

* on a **replicated** activation every rank must drop the same elements, or the replicas stop
  being copies of one tensor and the ranks train different models. Those draws come from the
  default (global) generator, which the caller must seed identically on all ranks of a TP group
  (the trainer does; :mod:`plait.materialize` does not touch the global generator);
* on a **sharded** activation each rank holds a different slice of one logical tensor, so its
  mask must be independent of the other ranks' masks; drawing it from an identically seeded
  generator would repeat one mask pattern across heads or sequence chunks.

:class:`TensorParallelRNG` keeps the state of that second, per-rank stream, seeded from
``(seed, tp_rank)``. :meth:`TensorParallelRNG.fork` swaps it into the device's global generator
for the duration of a block of code, so ordinary ``F.dropout`` and SDPA's attention dropout draw
from it without being told about it, and stores the advanced state back on exit. There is no
module-global registry: the tracker object is created by ``parallelize`` (stored as
``model.rng_tracker``) and handed to the modules that need it.

Activation checkpointing recomputes forwards; :mod:`plait.activation_checkpointing` saves and
restores this tracker's state around the recomputation (``torch.utils.checkpoint`` only restores
the global generators), so recomputed masks equal the original ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

#: added to the seed so the per-rank stream does not start where the global generator seeded with
#: the same user seed starts (tp rank 0 would otherwise reproduce the replicated stream exactly)
SEED_OFFSET = 2718

RNGState = dict[str, torch.Tensor]


class TensorParallelRNG:
    """The per-TP-rank random stream: one generator state per device, seeded ``seed + 2718 + tp_rank``.

    States are created lazily, on the first :meth:`fork` on a device (the model may be built on
    the meta device and moved later), each from the same seed; the CPU and a CUDA device
    therefore hold separate streams, as the global generators do.
    """

    def __init__(self, seed: int, tp_rank: int) -> None:
        if not isinstance(seed, int) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"TensorParallelRNG needs an integer seed and a tp_rank >= 0; got seed={seed!r}, "
                             f"tp_rank={tp_rank!r}")
        self.base_seed = seed
        self.tp_rank = tp_rank
        self.seed = seed + SEED_OFFSET + tp_rank
        self._states: RNGState = {}

    # ------------------------------------------------------------------ state
    def reseed(self, seed: int) -> None:
        """Restart the stream from ``seed`` (same TP rank): e.g. a run seed that also depends on the
        data-parallel and pipeline rank, applied after the model was built."""
        self.base_seed, self.seed = seed, seed + SEED_OFFSET + self.tp_rank
        self._states = {}

    def get_state(self) -> RNGState:
        """A copy of the stream's state: ``{device: generator state}`` for each device used so far."""
        return {dev: s.clone() for dev, s in self._states.items()}

    def set_state(self, state: RNGState) -> None:
        """Replace the whole state (devices missing from ``state`` restart from the seed on next use)."""
        self._states = {dev: s.clone() for dev, s in state.items()}

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        # A private generator gives the seeded state without touching the global one.
        return torch.Generator(device=device).manual_seed(self.seed).get_state()

    # ------------------------------------------------------------------ fork
    @contextlib.contextmanager
    def fork(self, device: torch.device | str = "cpu") -> Iterator[None]:
        """Run the block with this stream as ``device``'s global generator.

        The global state is saved on entry and restored on exit (also when the block raises, as
        checkpoint's early-stopped recomputation does), and the tracker keeps the state the block
        advanced it to, so consecutive forks continue one stream. ``device`` is the device of the
        tensors the block draws for (CUDA: that device's generator; CPU: the CPU generator); on the
        meta device nothing is drawn and the block runs unchanged.
        """
        dev = torch.device(device)
        if dev.type == "meta":
            yield
            return
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            get, put = (lambda: torch.cuda.get_rng_state(dev)), (lambda s: torch.cuda.set_rng_state(s, dev))
        elif dev.type == "cpu":
            get, put = torch.get_rng_state, torch.set_rng_state
        else:
            raise ValueError(f"TensorParallelRNG.fork: device {str(dev)!r} is not supported; valid: cpu, cuda")
        key = str(dev)
        mine = self._states.get(key)
        if mine is None:
            mine = self._initial_state(dev)
        outer = get()
        put(mine)
        try:
            yield
        finally:
            self._states[key] = get()
            put(outer)

    def __repr__(self) -> str:
        return f"TensorParallelRNG(seed={self.base_seed}, tp_rank={self.tp_rank})"


class TrackedDropout(nn.Dropout):
    """Dropout that draws its mask from a :class:`TensorParallelRNG` stream.

    Used for residual dropout under sequence parallelism, where each TP rank holds a different
    chunk of the sequence and so needs its own mask. Without sequence parallelism the residual is
    replicated and a plain ``nn.Dropout`` on the (identically seeded) global generator is right.
    """

    def __init__(self, p: float, rng: TensorParallelRNG) -> None:
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng.fork(x.device):
            return F.dropout(x, self.p, True, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, rng={self.rng!r}"


__all__ = ["SEED_OFFSET", "TensorParallelRNG", "TrackedDropout"]
