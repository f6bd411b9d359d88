"""Discrete-event simulation of all pipeline ranks executing their task lists together.

The semantics are the runtime's: each rank executes its list strictly in order; a send is
non-blocking (it completes as soon as it is issued and costs the sender nothing); a receive
blocks until the matching send has been issued, and completes ``p2p_time`` after that send at
the earliest. ``Forward``, ``Backward`` and ``WeightGrad`` are the only tasks that take time.
``forward_time`` and ``backward_time`` are per microbatch for *all the layers one rank holds*, so
with ``vpp`` chunks one chunk's Forward takes ``forward_time / vpp`` (total times are comparable
across ``vpp``). ``backward_time`` is the whole backward; in a list with ``WeightGrad`` tasks (a
split backward, ``zb-h1``) ``weight_time`` of it (default half) is the ``W`` and the rest the ``B``.

The simulator also checks that a task list can run at all, raising :class:`ScheduleError` for:
a deadlock (naming each stuck rank and the receive it waits on), a send or receive that the
stage convention forbids (activation out of the last stage, gradient into it, ...), a message
sent twice, received twice or never received, a Forward without its received input, a
Backward before its Forward or its received gradient, a Forward never followed by its Backward,
a WeightGrad before its Backward or run twice, a Backward without its WeightGrad in a list that
splits backwards, and a list whose last task is not its only ``ReduceGradients``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.pipeline.schedules import ScheduleError, schedule_tasks
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
    rank_chunk_of,
    stage_of,
    task_label,
)


@dataclass(frozen=True)
class TimedTask:
    """One executed compute task: it ran on its rank from ``start`` to ``end``."""

    start: float
    end: float
    task: Forward | Backward | WeightGrad


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`; tuples are indexed by pipeline rank.

    ``total_time`` is the makespan (the last rank's finish); ``busy[r]`` the compute time of rank
    ``r``; ``bubble[r] = 1 - busy[r] / total_time`` its idle share; ``finish[r]`` when rank ``r``
    issued its ``ReduceGradients``; ``peak_in_flight[r]`` the largest number of (microbatch, chunk)
    forwards done whose backward was not yet done (the activation-memory high-water mark);
    ``timeline[r]`` its compute tasks with start and end times; ``peak_awaiting_w[r]`` the largest
    number of forwards done whose WeightGrad was not yet done (equal to ``peak_in_flight`` for a
    schedule without W: a microbatch between its B and its W keeps what W needs).
    """

    name: str
    pp: int
    vpp: int
    microbatches: int
    total_time: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    finish: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    timeline: tuple[tuple[TimedTask, ...], ...]
    peak_awaiting_w: tuple[int, ...] = ()

    @property
    def mean_bubble(self) -> float:
        """Idle share of the whole pipeline: ``1 - sum(busy) / (pp * total_time)``."""
        return 1.0 - sum(self.busy) / (self.pp * self.total_time)


def theoretical_bubble(pp: int, microbatches: int, vpp: int = 1) -> float:
    """The standard idle share of a flushed pipeline: ``(pp - 1) / (vpp * microbatches + pp - 1)``.

    For ``vpp = 1`` this is GPipe's / 1F1B's ``(p - 1) / (m + p - 1)``; interleaving divides the
    bubble time by ``vpp`` (Narayanan et al. 2021, bubble/ideal ratio ``(p - 1) / (v * m)``).
    """
    for field, value in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{field} must be an int >= 1, got {field}={value!r}")
    return (pp - 1) / (vpp * microbatches + pp - 1)


def schedule_bubble(name: str, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Idle share of schedule ``name``'s makespan with uniform stages, forward 1 and backward 2.

    1F1B, GPipe and interleaved 1F1B: :func:`theoretical_bubble`. ``zb-h1`` (backward split into
    B = W = 1): ``(pp - 1) / (3 * microbatches + pp - 1)`` when ``microbatches >= pp``, a third of
    1F1B's idle time (:func:`simulate` gives exactly this; it is used for fewer micro-batches).
    ``interleaved-zb``: simulated (``zb-h1`` at ``vpp = 1``).
    """
    if name == "interleaved-zb" and vpp > 1:
        theoretical_bubble(pp, microbatches, vpp)  # the same argument checks
        return simulate(pp, microbatches, vpp, name).mean_bubble
    if name not in ("zb-h1", "interleaved-zb"):
        return theoretical_bubble(pp, microbatches, vpp)
    theoretical_bubble(pp, microbatches, vpp)  # the same argument checks
    if microbatches >= pp:
        return (pp - 1) / (3 * microbatches + pp - 1)
    return simulate(pp, microbatches, 1, name).mean_bubble


def _message(task: SendActivation | RecvActivation | SendGradient | RecvGradient, pp_rank: int, pp: int,
             vpp: int) -> tuple[str, int, int]:
    """Key of the message a send/recv task carries: (kind, microbatch, sending stage)."""
    stage = stage_of(pp_rank, task.chunk, pp)
    last = pp * vpp - 1
    if isinstance(task, SendActivation):
        bad, key = stage == last, ("activation", task.microbatch, stage)
    elif isinstance(task, RecvActivation):
        bad, key = stage == 0, ("activation", task.microbatch, stage - 1)
    elif isinstance(task, SendGradient):
        bad, key = stage == 0, ("gradient", task.microbatch, stage)
    else:  # RecvGradient
        bad, key = stage == last, ("gradient", task.microbatch, stage + 1)
    if bad:
        raise ScheduleError(f"rank {pp_rank}: {task} is invalid on global stage {stage} of {last + 1} "
                            f"(pp={pp}, vpp={vpp})")
    return key


def simulate_tasks(task_lists: list[list[Task]], vpp: int = 1, forward_time: float = 1.0,
                   backward_time: float = 2.0, p2p_time: float = 0.0, name: str = "custom",
                   weight_time: float | None = None) -> SimResult:
    """Run ``task_lists[r]`` on rank ``r`` for every rank (``pp = len(task_lists)``); see module doc."""
    pp = len(task_lists)
    if pp < 1:
        raise ScheduleError("task_lists must hold one list per pipeline rank, got none")
    if min(forward_time, backward_time) <= 0 or p2p_time < 0:
        raise ScheduleError(f"need forward_time > 0, backward_time > 0, p2p_time >= 0; got "
                            f"{forward_time}, {backward_time}, {p2p_time}")
    split = any(isinstance(t, WeightGrad) for tasks in task_lists for t in tasks)
    w_total = backward_time / 2 if weight_time is None else weight_time
    if split and not 0 < w_total < backward_time:
        raise ScheduleError(f"need 0 < weight_time < backward_time, got {weight_time} and {backward_time}")
    last = pp * vpp - 1
    f_cost, b_cost = forward_time / vpp, (backward_time - (w_total if split else 0.0)) / vpp
    w_cost = w_total / vpp
    sent: dict[tuple[str, int, int], float] = {}
    received: set[tuple[str, int, int]] = set()
    pos = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    finish = [math.nan] * pp
    peak = [0] * pp
    timeline: list[list[TimedTask]] = [[] for _ in range(pp)]
    have_input: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    have_grad: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    forwarded: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    backwarded: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    weighted: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    peak_w = [0] * pp

    def fail(rank: int, task: Task, why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank}, task {pos[rank]} {task}: {why}")

    def step(r: int) -> bool:
        """Execute rank r's next task if it can run now; False when blocked on a receive."""
        task = task_lists[r][pos[r]]
        if isinstance(task, ReduceGradients):
            if pos[r] != len(task_lists[r]) - 1:
                raise fail(r, task, "ReduceGradients must be the last task, and appear once")
            finish[r] = clock[r]
        else:
            if not 0 <= task.chunk < vpp:
                raise fail(r, task, f"chunk out of range 0..{vpp - 1}")
            mc = (task.microbatch, task.chunk)
            stage = stage_of(r, task.chunk, pp)
            if isinstance(task, (SendActivation, SendGradient)):
                key = _message(task, r, pp, vpp)
                if key in sent:
                    raise fail(r, task, "sent twice")
                done = forwarded if isinstance(task, SendActivation) else backwarded
                if mc not in done[r]:
                    raise fail(r, task, "sends the result of a Forward/Backward that has not run")
                sent[key] = clock[r]
            elif isinstance(task, (RecvActivation, RecvGradient)):
                key = _message(task, r, pp, vpp)
                if key not in sent:
                    return False
                if key in received:
                    raise fail(r, task, "received twice")
                received.add(key)
                clock[r] = max(clock[r], sent[key] + p2p_time)
                (have_input if isinstance(task, RecvActivation) else have_grad)[r].add(mc)
            elif isinstance(task, Forward):
                if mc in forwarded[r]:
                    raise fail(r, task, "forward run twice")
                if stage > 0 and mc not in have_input[r]:
                    raise fail(r, task, "Forward before its RecvActivation")
                timeline[r].append(TimedTask(clock[r], clock[r] + f_cost, task))
                clock[r] += f_cost
                busy[r] += f_cost
                forwarded[r].add(mc)
                peak[r] = max(peak[r], len(forwarded[r]) - len(backwarded[r]))
                peak_w[r] = max(peak_w[r], len(forwarded[r]) - len(weighted[r] if split else backwarded[r]))
            elif isinstance(task, Backward):
                if mc in backwarded[r] or mc not in forwarded[r]:
                    raise fail(r, task, "Backward run twice or before its Forward")
                if stage < last and mc not in have_grad[r]:
                    raise fail(r, task, "Backward before its RecvGradient")
                timeline[r].append(TimedTask(clock[r], clock[r] + b_cost, task))
                clock[r] += b_cost
                busy[r] += b_cost
                backwarded[r].add(mc)
            elif isinstance(task, WeightGrad):
                if mc in weighted[r] or mc not in backwarded[r]:
                    raise fail(r, task, "WeightGrad run twice or before its Backward")
                timeline[r].append(TimedTask(clock[r], clock[r] + w_cost, task))
                clock[r] += w_cost
                busy[r] += w_cost
                weighted[r].add(mc)
            else:
                raise fail(r, task, f"unknown task type {type(task).__name__}")
        pos[r] += 1
        return True

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(task_lists[r]) and step(r):
                progress = True

    stuck = [r for r in range(pp) if pos[r] < len(task_lists[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at task {pos[r]} {task_lists[r][pos[r]]}" for r in stuck)
        raise ScheduleError(f"deadlock ({name}, pp={pp}, vpp={vpp}): stuck ranks {stuck}, each blocked on a "
                            f"receive whose send is never issued: {waits}")
    if unreceived := set(sent) - received:
        kind, mb, stage = min(unreceived)
        rank, chunk = rank_chunk_of(stage, pp)
        raise ScheduleError(f"{len(unreceived)} message(s) sent but never received, e.g. the {kind} of microbatch "
                            f"{mb} sent by rank {rank} chunk {chunk} (stage {stage})")
    for r in range(pp):
        if not task_lists[r] or not isinstance(task_lists[r][-1], ReduceGradients):
            raise ScheduleError(f"rank {r}: task list must end with ReduceGradients()")
        if forwarded[r] != backwarded[r]:
            raise ScheduleError(f"rank {r}: forwards without a backward: {sorted(forwarded[r] - backwarded[r])}")
        if split and weighted[r] != backwarded[r]:
            raise ScheduleError(f"rank {r}: backwards without a WeightGrad: {sorted(backwarded[r] - weighted[r])}")

    total = max(clock)
    return SimResult(
        name=name, pp=pp, vpp=vpp, microbatches=max((len(f) for f in forwarded), default=0) // vpp,
        total_time=total, busy=tuple(busy),
        bubble=tuple(1.0 - b / total if total > 0 else 0.0 for b in busy),
        finish=tuple(finish), peak_in_flight=tuple(peak), timeline=tuple(tuple(t) for t in timeline),
        peak_awaiting_w=tuple(peak_w),
    )


def simulate(pp: int, microbatches: int, vpp: int, name: str, forward_time: float = 1.0,
             backward_time: float = 2.0, p2p_time: float = 0.0, weight_time: float | None = None) -> SimResult:
    """Simulate schedule ``name`` on all ``pp`` ranks (built with :func:`schedule_tasks`)."""
    lists = [schedule_tasks(name, r, pp, microbatches, vpp) for r in range(pp)]
    return simulate_tasks(lists, vpp, forward_time, backward_time, p2p_time, name=name, weight_time=weight_time)


def format_timeline(result: SimResult) -> str:
    """Text diagram of ``result``: one row per rank, one column per time slot.

    The slot is the shortest compute task (one chunk-forward, or a B/W of a split backward); a
    longer task fills as many slots as it lasts, ``.`` is idle. Times must be whole multiples of
    the slot (e.g. 1.0 and 2.0).
    """
    tasks = [t for row in result.timeline for t in row]
    if not tasks:
        return ""
    slot = min(t.end - t.start for t in tasks)
    n = round(result.total_time / slot)
    width = max(len(task_label(t.task, result.vpp)) for t in tasks)
    lines = []
    for r, row in enumerate(result.timeline):
        cells = ["." * 1] * n
        for t in row:
            a, b = round(t.start / slot), round(t.end / slot)
            if not (math.isclose(a * slot, t.start) and math.isclose(b * slot, t.end)):
                raise ValueError("format_timeline needs task times that are whole multiples of the forward time")
            for i in range(a, b):
                cells[i] = task_label(t.task, result.vpp)
        lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)
