"""The typed tasks a pipeline schedule is made of, and the stage convention they refer to.

A schedule is, for one pipeline rank, a plain list of these frozen dataclasses; the runtime walks
the list in order and executes each task. Nothing here touches torch or torch.distributed, so a
schedule can be built, printed, compared and simulated anywhere.

Stage convention (Megatron-LM interleaving): with ``pp`` ranks and ``vpp`` model chunks per rank
there are ``S = pp * vpp`` global stages, and chunk ``c`` of rank ``r`` is global stage
``s = c * pp + r``. Stage 0 embeds, stage ``S - 1`` computes the loss inside its ``Forward``, and
activations flow from stage ``s`` to ``s + 1`` (gradients the other way). A send/recv task names
only ``(microbatch, chunk)`` on its own rank; the peer is implied: activations go to the stage
after ``(rank, chunk)`` and come from the stage before it, gradients the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MicrobatchTask:
    """Base of every task that concerns one microbatch on one model chunk of this rank."""

    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Forward(MicrobatchTask):
    """Forward of ``microbatch`` through ``chunk``; on the last global stage this includes the loss."""


@dataclass(frozen=True)
class Backward(MicrobatchTask):
    """Backward of ``microbatch`` through ``chunk`` (weight gradients accumulate, input gradient kept).

    In a zero-bubble schedule this is ``B``: the column/row-parallel layers' weight-gradient
    products are deferred to the matching :class:`WeightGrad`; every other gradient is computed here.
    """


@dataclass(frozen=True)
class WeightGrad(MicrobatchTask):
    """``W`` of a zero-bubble schedule: the weight-gradient products deferred by ``Backward(microbatch,
    chunk)``, accumulated into the parameters (no communication; placed in the pipeline's bubbles)."""


@dataclass(frozen=True)
class RecvActivation(MicrobatchTask):
    """Receive the input of ``Forward(microbatch, chunk)`` from the previous global stage (never on stage 0)."""


@dataclass(frozen=True)
class SendActivation(MicrobatchTask):
    """Send the output of ``Forward(microbatch, chunk)`` to the next global stage (never on stage S-1)."""


@dataclass(frozen=True)
class RecvGradient(MicrobatchTask):
    """Receive the gradient of ``Forward(microbatch, chunk)``'s output from the next stage (never on S-1)."""


@dataclass(frozen=True)
class SendGradient(MicrobatchTask):
    """Send the gradient of ``Forward(microbatch, chunk)``'s input to the previous stage (never on stage 0)."""


@dataclass(frozen=True)
class ReduceGradients:
    """Last task of every rank's list: synchronise tied-weight and data-parallel gradients."""


Task = Forward | Backward | WeightGrad | RecvActivation | SendActivation | RecvGradient | SendGradient | ReduceGradients

COMPUTE_TASKS = (Forward, Backward, WeightGrad)
SEND_TASKS = (SendActivation, SendGradient)
RECV_TASKS = (RecvActivation, RecvGradient)


def stage_of(pp_rank: int, chunk: int, pp: int) -> int:
    """Global stage held by ``chunk`` of ``pp_rank``: ``chunk * pp + pp_rank``."""
    return chunk * pp + pp_rank


def rank_chunk_of(stage: int, pp: int) -> tuple[int, int]:
    """Inverse of :func:`stage_of`: the ``(pp_rank, chunk)`` holding global ``stage``."""
    return stage % pp, stage // pp


_LETTERS = {Forward: "F", Backward: "B", WeightGrad: "W", RecvActivation: "rA", SendActivation: "sA",
            RecvGradient: "rG", SendGradient: "sG"}


def task_label(task: Task, vpp: int = 1) -> str:
    """Short label for diagrams: ``F3`` (forward of microbatch 3); with ``vpp > 1`` the chunk is a
    letter, ``F3b`` = forward of microbatch 3 on chunk 1. ``ReduceGradients`` is ``R``."""
    if isinstance(task, ReduceGradients):
        return "R"
    chunk = "" if vpp == 1 else chr(ord("a") + task.chunk) if vpp <= 26 else f".{task.chunk}"
    return f"{_LETTERS[type(task)]}{task.microbatch}{chunk}"
