"""Pipeline-parallel schedules as pure functions: ``schedule_tasks`` returns one rank's task list.

Five schedules (see docs/pipeline_schedules.md for diagrams):

* ``"gpipe"``: every forward (microbatches 0..m-1), then every backward in the *same* order
  0..m-1. Forward order for the backwards makes every schedule here accumulate each chunk's
  weight gradients in microbatch order 0..m-1, so GPipe, 1F1B and interleaved 1F1B sum the same
  terms in the same order (bitwise-identical gradients with deterministic kernels).
* ``"1f1b"`` (PipeDream-flush): ``min(pp - r - 1, m)`` warm-up forwards, then alternate one
  forward / one backward, then the remaining backwards. At most ``pp - r`` microbatches are in
  flight (forward done, backward not yet) on rank ``r``, instead of ``m`` for GPipe.
* ``"interleaved-1f1b"`` (Megatron-LM's virtual-pipeline schedule): each rank holds ``vpp`` chunks;
  forwards visit microbatches in groups of ``pp``, running a group through chunk 0, then chunk 1,
  ...; backwards follow the same table with the chunk order reversed. Warm-up is
  ``2 * (pp - r - 1) + (vpp - 1) * pp`` forwards (clamped to ``vpp * m``, in which case the rank runs
  all forwards, then all backwards), as in current Megatron-LM.
* ``"zb-h1"`` (zero bubble, the memory-neutral "H1" variant of Qi et al. 2023): each backward is
  split into ``B`` (:class:`~plait.pipeline.tasks.Backward`: input gradients, sent on at once) and
  ``W`` (:class:`~plait.pipeline.tasks.WeightGrad`: the deferred weight-gradient products). Rank
  ``r`` runs 1F1B's ``min(pp - r - 1, m)`` warm-up forwards, then forward/``B`` pairs, and runs the
  ``W`` of microbatch ``i`` only after the ``B`` of microbatch ``i + r``: those ``r`` postponed ``W`` s
  fill the cool-down, where 1F1B's rank ``r`` waits for gradients. In the cool-down every ``B`` is
  followed by one ``W``, the rest close the step. At most ``pp`` microbatches are between their
  forward and their ``W`` on any rank (``pp - r`` of them holding full activations, as in 1F1B, the
  others only what ``W`` needs), so the peak over ranks is 1F1B's rank 0. With ``F = B = W`` the
  idle time per rank is ``(pp - 1)`` units instead of 1F1B's ``3 (pp - 1)``.

* ``"interleaved-zb"`` (zero bubble over interleaved chunks): interleaved 1F1B's order of forwards
  and backwards, with each backward split into ``B`` and ``W`` as in ``zb-h1``; rank ``r`` runs
  the ``W`` of a backward once ``2 r`` newer ``B`` s have run (in the cool-down, once every forward
  is done, one ``W`` follows each ``B``), and the remaining ``W`` s close the step. The chunks halve
  (``vpp = 2``) the warm-up ramp that no schedule of a synchronised step can fill, and the deferred
  ``W`` s fill most of the rest: with ``F = B = W`` and ``m`` a multiple of ``pp`` up to ``pp = 6``
  the idle share is ``(pp - 1) / (3 vpp m + pp - 1)``, half of ``zb-h1``'s at ``vpp = 2``
  (:func:`plait.pipeline.simulate.schedule_bubble` simulates it). Peak activations in flight are
  interleaved 1F1B's (rank 0's ``2 (pp - 1) + (vpp - 1) pp + 1`` chunks), and the last rank
  additionally keeps up to ``2 (pp - 1)`` chunks' weight-gradient inputs waiting for their ``W``.
  Same constraints as ``interleaved-1f1b`` (``m`` a multiple of ``pp``); with ``vpp = 1`` it is
  ``zb-h1``.

Every Forward is immediately preceded by its RecvActivation (if the stage is not 0) and
followed by its SendActivation (if not the last stage); every Backward is preceded by its
RecvGradient (if not the last stage) and followed by its SendGradient (if not stage 0). Receives
are placed as late as possible on purpose: with non-blocking sends this is deadlock-free for all
the schedules (checked by ``plait.pipeline.simulate``) and keeps a rank from holding a received
tensor for longer than needed. The list ends with one ``ReduceGradients()``.
"""

from __future__ import annotations

from collections import deque

from plait.pipeline.tasks import (
    Backward,
    Forward,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    SendActivation,
    SendGradient,
    Task,
    WeightGrad,
    stage_of,
)

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb")
#: schedules that split the backward into B and W (the runtime then defers weight gradients)
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("zb-h1", "interleaved-zb")
#: schedules that run several model chunks per rank (``vpp``)
INTERLEAVED_SCHEDULES: tuple[str, ...] = ("interleaved-1f1b", "interleaved-zb")


class ScheduleError(ValueError):
    """A schedule that cannot be built (bad name, sizes or rank) or a task list that cannot run."""


# A compute step: (kind, microbatch, chunk), kind "F" (forward), "B" (backward) or "W" (weight grads).
_Step = tuple[str, int, int]


def _check_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{field} must be an int, got {value!r} ({type(value).__name__})")


def validate_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, pp_rank: int | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``schedule_tasks(name, pp_rank, pp, microbatches, vpp)`` is valid.

    ``pp_rank=None`` skips the rank check (validate a configuration for all ranks at once).
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(map(repr, SCHEDULES))}")
    for field, value in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        _check_int(field, value)
    if pp < 1:
        raise ScheduleError(f"pp (pipeline-parallel size) must be >= 1, got pp={pp}")
    if pp_rank is not None:
        _check_int("pp_rank", pp_rank)
        if not 0 <= pp_rank < pp:
            raise ScheduleError(f"pp_rank={pp_rank} is out of range for pp={pp}; valid: 0..{pp - 1}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got microbatches={microbatches}")
    if vpp < 1:
        raise ScheduleError(f"vpp (virtual chunks per rank) must be >= 1, got vpp={vpp}")
    if name not in INTERLEAVED_SCHEDULES:
        if vpp != 1:
            raise ScheduleError(f"vpp={vpp} needs an interleaved schedule ('interleaved-1f1b' or 'interleaved-zb'); "
                                f"{name!r} supports only vpp=1")
        return
    if microbatches < pp:
        raise ScheduleError(
            f"{name!r} needs microbatches >= pp, got microbatches={microbatches} < pp={pp}; "
            f"use a multiple of {pp} such as {pp}"
        )
    if microbatches % pp != 0:
        lower, upper = microbatches - microbatches % pp, microbatches - microbatches % pp + pp
        raise ScheduleError(
            f"{name!r} needs microbatches divisible by pp={pp}, got microbatches={microbatches}; "
            f"valid nearby values: {lower}, {upper}"
        )
    if vpp > 1 and pp < 2:
        raise ScheduleError(
            f"{name!r} with vpp={vpp} needs pp >= 2 (with pp=1 every chunk would send to its own "
            f"rank); got pp={pp}: use vpp=1"
        )


def _gpipe(pp_rank: int, pp: int, m: int) -> list[_Step]:
    return [("F", mb, 0) for mb in range(m)] + [("B", mb, 0) for mb in range(m)]


def _one_f_one_b(pp_rank: int, pp: int, m: int) -> list[_Step]:
    warmup = min(pp - pp_rank - 1, m)
    steps: list[_Step] = [("F", mb, 0) for mb in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", warmup + i, 0), ("B", i, 0)]
    steps += [("B", mb, 0) for mb in range(m - warmup, m)]
    return steps


def _zb_h1(pp_rank: int, pp: int, m: int) -> list[_Step]:
    warmup = min(pp - pp_rank - 1, m)
    steps: list[_Step] = [("F", mb, 0) for mb in range(warmup)]
    next_w = 0
    for i in range(m - warmup):
        steps += [("F", warmup + i, 0), ("B", i, 0)]
        if i >= pp_rank:  # W lags its B by pp_rank microbatches in the steady state
            steps.append(("W", next_w, 0))
            next_w += 1
    for mb in range(m - warmup, m):  # cool-down: one W after each B, filling the wait for the next gradient
        steps.append(("B", mb, 0))
        steps.append(("W", next_w, 0))
        next_w += 1
    steps += [("W", mb, 0) for mb in range(next_w, m)]
    return steps


def _interleaved(pp_rank: int, pp: int, m: int, vpp: int) -> list[_Step]:
    # Megatron-LM's schedule table: microbatch groups of size pp, each run through chunk 0..vpp-1.
    table = [(mb, chunk) for start in range(0, m, pp) for chunk in range(vpp) for mb in range(start, start + pp)]
    total = len(table)
    warmup = min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp, total)

    def fwd(k: int) -> _Step:
        mb, chunk = table[k]
        return "F", mb, chunk

    def bwd(k: int) -> _Step:
        mb, chunk = table[k]
        return "B", mb, vpp - 1 - chunk

    steps = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [fwd(warmup + k), bwd(k)]
    steps += [bwd(k) for k in range(total - warmup, total)]
    return steps


def _interleaved_zb(pp_rank: int, pp: int, m: int, vpp: int) -> list[_Step]:
    if vpp == 1:
        return _zb_h1(pp_rank, pp, m)
    # interleaved 1F1B's F/B order; each B's W waits in a queue until 2 * pp_rank newer Bs have run
    # (in the cool-down, once every forward is done, one W follows each B), the rest close the step
    lag = 2 * pp_rank
    total_forwards = m * vpp
    steps: list[_Step] = []
    pending: deque[_Step] = deque()
    forwards = 0
    for kind, mb, chunk in _interleaved(pp_rank, pp, m, vpp):
        steps.append((kind, mb, chunk))
        if kind == "F":
            forwards += 1
            continue
        pending.append(("W", mb, chunk))
        if forwards == total_forwards or len(pending) > lag:
            steps.append(pending.popleft())
    return steps + list(pending)


def compute_order(name: str, pp_rank: int, pp: int, microbatches: int,
                  vpp: int = 1) -> list[Forward | Backward | WeightGrad]:
    """Only the Forward/Backward/WeightGrad tasks of ``schedule_tasks(...)``, in order (no communication)."""
    return [t for t in schedule_tasks(name, pp_rank, pp, microbatches, vpp)
            if isinstance(t, (Forward, Backward, WeightGrad))]


def schedule_tasks(name: str, pp_rank: int, pp: int, microbatches: int, vpp: int = 1) -> list[Task]:
    """The ordered task list of pipeline rank ``pp_rank`` for one optimizer step.

    ``name`` is one of :data:`SCHEDULES`; ``pp`` ranks, ``microbatches`` per step, ``vpp`` model
    chunks per rank (only ``"interleaved-1f1b"`` accepts ``vpp > 1``; with ``vpp == 1`` it returns
    exactly the ``"1f1b"`` list, after checking the interleaved constraints on ``microbatches``).
    Raises :class:`ScheduleError` for an invalid combination.
    """
    validate_schedule(name, pp, microbatches, vpp, pp_rank=pp_rank)
    if name == "gpipe":
        steps = _gpipe(pp_rank, pp, microbatches)
    elif name == "zb-h1":
        steps = _zb_h1(pp_rank, pp, microbatches)
    elif name == "interleaved-zb":
        steps = _interleaved_zb(pp_rank, pp, microbatches, vpp)
    elif name == "1f1b" or vpp == 1:
        steps = _one_f_one_b(pp_rank, pp, microbatches)
    else:
        steps = _interleaved(pp_rank, pp, microbatches, vpp)

    last_stage = pp * vpp - 1
    tasks: list[Task] = []
    for kind, mb, chunk in steps:
        stage = stage_of(pp_rank, chunk, pp)
        if kind == "W":
            tasks.append(WeightGrad(mb, chunk))
        elif kind == "F":
            if stage > 0:
                tasks.append(RecvActivation(mb, chunk))
            tasks.append(Forward(mb, chunk))
            if stage < last_stage:
                tasks.append(SendActivation(mb, chunk))
        else:
            if stage < last_stage:
                tasks.append(RecvGradient(mb, chunk))
            tasks.append(Backward(mb, chunk))
            if stage > 0:
                tasks.append(SendGradient(mb, chunk))
    tasks.append(ReduceGradients())
    return tasks
