"""Pipeline schedules as pure task lists: exact lists, structural properties, simulation, errors.

No processes and no torch: schedules are plain Python, so the checks run over a grid of sizes in
well under a second. Expected lists are written in the short notation of ``task_label``
(``F3`` forward of microbatch 3, ``rA``/``sA`` receive/send activation, ``rG``/``sG`` receive/send
gradient, ``W3`` the deferred weight gradients of microbatch 3 (zero-bubble schedules), a trailing
letter = chunk with vpp > 1, ``R`` = ReduceGradients); ``_parse`` maps each
token to exactly one task, and ``test_notation_is_the_dataclasses`` pins that mapping.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from plait.pipeline.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    ScheduleError,
    compute_order,
    schedule_tasks,
    validate_schedule,
)
from plait.pipeline.simulate import format_timeline, simulate, simulate_tasks, theoretical_bubble
from plait.pipeline.tasks import (
    Backward,
    Forward,
    RecvActivation,
    RecvGradient,
    ReduceGradients,
    SendActivation,
    SendGradient,
    WeightGrad,
)

_KINDS = {"F": Forward, "B": Backward, "W": WeightGrad, "rA": RecvActivation, "sA": SendActivation,
          "rG": RecvGradient, "sG": SendGradient}


def _parse(text: str) -> list:
    tasks = []
    for tok in text.split():
        if tok == "R":
            tasks.append(ReduceGradients())
            continue
        kind, mb, chunk = re.fullmatch(r"(rA|sA|rG|sG|F|B|W)(\d+)([a-z]?)", tok).groups()
        tasks.append(_KINDS[kind](int(mb), ord(chunk) - ord("a") if chunk else 0))
    return tasks


# (schedule, pp, microbatches, vpp, rank) -> expected list. Written out by hand from the definitions.
EXPECTED = {
    ("gpipe", 4, 4, 1, 0): "F0 sA0 F1 sA1 F2 sA2 F3 sA3 rG0 B0 rG1 B1 rG2 B2 rG3 B3 R",
    ("gpipe", 4, 4, 1, 3): "rA0 F0 rA1 F1 rA2 F2 rA3 F3 B0 sG0 B1 sG1 B2 sG2 B3 sG3 R",
    ("gpipe", 4, 8, 1, 0): "F0 sA0 F1 sA1 F2 sA2 F3 sA3 F4 sA4 F5 sA5 F6 sA6 F7 sA7 "
                           "rG0 B0 rG1 B1 rG2 B2 rG3 B3 rG4 B4 rG5 B5 rG6 B6 rG7 B7 R",
    ("gpipe", 4, 8, 1, 3): "rA0 F0 rA1 F1 rA2 F2 rA3 F3 rA4 F4 rA5 F5 rA6 F6 rA7 F7 "
                           "B0 sG0 B1 sG1 B2 sG2 B3 sG3 B4 sG4 B5 sG5 B6 sG6 B7 sG7 R",
    # 1F1B, pp=4: warm-up 3/2/1/0 forwards on ranks 0/1/2/3.
    ("1f1b", 4, 4, 1, 0): "F0 sA0 F1 sA1 F2 sA2 F3 sA3 rG0 B0 rG1 B1 rG2 B2 rG3 B3 R",
    ("1f1b", 4, 4, 1, 1): "rA0 F0 sA0 rA1 F1 sA1 rA2 F2 sA2 rG0 B0 sG0 rA3 F3 sA3 rG1 B1 sG1 "
                          "rG2 B2 sG2 rG3 B3 sG3 R",
    ("1f1b", 4, 4, 1, 2): "rA0 F0 sA0 rA1 F1 sA1 rG0 B0 sG0 rA2 F2 sA2 rG1 B1 sG1 rA3 F3 sA3 rG2 B2 sG2 "
                          "rG3 B3 sG3 R",
    ("1f1b", 4, 4, 1, 3): "rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 rA3 F3 B3 sG3 R",
    ("1f1b", 4, 8, 1, 0): "F0 sA0 F1 sA1 F2 sA2 F3 sA3 rG0 B0 F4 sA4 rG1 B1 F5 sA5 rG2 B2 F6 sA6 rG3 B3 "
                          "F7 sA7 rG4 B4 rG5 B5 rG6 B6 rG7 B7 R",
    ("1f1b", 4, 8, 1, 3): "rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 rA3 F3 B3 sG3 "
                          "rA4 F4 B4 sG4 rA5 F5 B5 sG5 rA6 F6 B6 sG6 rA7 F7 B7 sG7 R",
    # Interleaved pp=2, vpp=2 (stages: rank0 = {0 (a), 2 (b)}, rank1 = {1 (a), 3 (b)}), m=4.
    # Table: 0a 1a 0b 1b 2a 3a 2b 3b; warm-up 2*(pp-r-1) + (vpp-1)*pp = 4 / 2 forwards.
    ("interleaved-1f1b", 2, 4, 2, 0): "F0a sA0a F1a sA1a rA0b F0b sA0b rA1b F1b sA1b "
                                      "F2a sA2a rG0b B0b sG0b F3a sA3a rG1b B1b sG1b "
                                      "rA2b F2b sA2b rG0a B0a rA3b F3b sA3b rG1a B1a "
                                      "rG2b B2b sG2b rG3b B3b sG3b rG2a B2a rG3a B3a R",
    ("interleaved-1f1b", 2, 4, 2, 1): "rA0a F0a sA0a rA1a F1a sA1a rA0b F0b B0b sG0b rA1b F1b B1b sG1b "
                                      "rA2a F2a sA2a rG0a B0a sG0a rA3a F3a sA3a rG1a B1a sG1a "
                                      "rA2b F2b B2b sG2b rA3b F3b B3b sG3b rG2a B2a sG2a rG3a B3a sG3a R",
    # ZB-H1, pp=4: 1F1B's warm-up, the W of microbatch i after the B of microbatch i + rank, one W after
    # each cool-down B, the remaining Ws last.
    ("zb-h1", 4, 8, 1, 0): "F0 sA0 F1 sA1 F2 sA2 F3 sA3 rG0 B0 W0 F4 sA4 rG1 B1 W1 F5 sA5 rG2 B2 W2 "
                           "F6 sA6 rG3 B3 W3 F7 sA7 rG4 B4 W4 rG5 B5 W5 rG6 B6 W6 rG7 B7 W7 R",
    ("zb-h1", 4, 8, 1, 1): "rA0 F0 sA0 rA1 F1 sA1 rA2 F2 sA2 rG0 B0 sG0 rA3 F3 sA3 rG1 B1 sG1 W0 "
                           "rA4 F4 sA4 rG2 B2 sG2 W1 rA5 F5 sA5 rG3 B3 sG3 W2 rA6 F6 sA6 rG4 B4 sG4 W3 "
                           "rA7 F7 sA7 rG5 B5 sG5 W4 rG6 B6 sG6 W5 rG7 B7 sG7 W6 W7 R",
    ("zb-h1", 4, 8, 1, 3): "rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 rA3 F3 B3 sG3 W0 rA4 F4 B4 sG4 W1 "
                           "rA5 F5 B5 sG5 W2 rA6 F6 B6 sG6 W3 rA7 F7 B7 sG7 W4 W5 W6 W7 R",
    ("zb-h1", 2, 4, 1, 0): "F0 sA0 F1 sA1 rG0 B0 W0 F2 sA2 rG1 B1 W1 F3 sA3 rG2 B2 W2 rG3 B3 W3 R",
    ("zb-h1", 2, 4, 1, 1): "rA0 F0 B0 sG0 rA1 F1 B1 sG1 W0 rA2 F2 B2 sG2 W1 rA3 F3 B3 sG3 W2 W3 R",
    # fewer microbatches than the lag: every W waits for the end
    ("zb-h1", 4, 2, 1, 3): "rA0 F0 B0 sG0 rA1 F1 B1 sG1 W0 W1 R",
    # interleaved-zb, pp=2, vpp=2, m=4: interleaved 1F1B's F/B order above; rank 0 (lag 0) runs each W
    # right after its B; rank 1 (lag 2) keeps two Ws waiting, then one W per B, the last two close.
    ("interleaved-zb", 2, 4, 2, 0): "F0a sA0a F1a sA1a rA0b F0b sA0b rA1b F1b sA1b "
                                    "F2a sA2a rG0b B0b sG0b W0b F3a sA3a rG1b B1b sG1b W1b "
                                    "rA2b F2b sA2b rG0a B0a W0a rA3b F3b sA3b rG1a B1a W1a "
                                    "rG2b B2b sG2b W2b rG3b B3b sG3b W3b rG2a B2a W2a rG3a B3a W3a R",
    ("interleaved-zb", 2, 4, 2, 1): "rA0a F0a sA0a rA1a F1a sA1a rA0b F0b B0b sG0b rA1b F1b B1b sG1b "
                                    "rA2a F2a sA2a rG0a B0a sG0a W0b rA3a F3a sA3a rG1a B1a sG1a W1b "
                                    "rA2b F2b B2b sG2b W0a rA3b F3b B3b sG3b W1a rG2a B2a sG2a W2b "
                                    "rG3a B3a sG3a W3b W2a W3a R",
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"{k[0]}-pp{k[1]}-m{k[2]}-vpp{k[3]}-rank{k[4]}")
def test_exact_task_lists(key):
    name, pp, m, vpp, rank = key
    assert schedule_tasks(name, rank, pp, m, vpp) == _parse(EXPECTED[key])


def test_notation_is_the_dataclasses():
    assert schedule_tasks("1f1b", 1, 2, 2) == [
        RecvActivation(0, 0), Forward(0, 0), Backward(0, 0), SendGradient(0, 0),
        RecvActivation(1, 0), Forward(1, 0), Backward(1, 0), SendGradient(1, 0), ReduceGradients(),
    ]
    assert _parse("rG3b B3b sG3b R") == [RecvGradient(3, 1), Backward(3, 1), SendGradient(3, 1), ReduceGradients()]
    assert Forward(0, 0) != Backward(0, 0) and hash(Forward(1, 2)) == hash(Forward(1, 2))


# ---- properties over a grid ------------------------------------------------------------------

def _valid_configs():
    for name in SCHEDULES:
        for pp in range(1, 7):
            for m in range(1, 13):
                for vpp in range(1, 4):
                    try:
                        validate_schedule(name, pp, m, vpp)
                    except ScheduleError:
                        continue
                    yield name, pp, m, vpp


CONFIGS = list(_valid_configs())


def test_grid_covers_every_schedule():
    names = {c[0] for c in CONFIGS}
    assert names == set(SCHEDULES)
    assert any(c[0] == "interleaved-1f1b" and c[3] == 3 and c[1] == 6 for c in CONFIGS)
    assert len(CONFIGS) > 200


def _in_flight_peak(tasks) -> int:
    live = peak = 0
    for t in tasks:
        if isinstance(t, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(t, Backward):
            live -= 1
    return peak


def _awaiting_w_peak(tasks) -> int:
    """Most microbatches between their Forward and their WeightGrad (what a W-pending one keeps)."""
    live = peak = 0
    for t in tasks:
        if isinstance(t, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(t, WeightGrad):
            live -= 1
    return peak


def test_structure_over_grid():
    for name, pp, m, vpp in CONFIGS:
        where = f"{name} pp={pp} m={m} vpp={vpp}"
        S = pp * vpp
        lists = [schedule_tasks(name, r, pp, m, vpp) for r in range(pp)]
        sends: dict[tuple, int] = {}
        recvs: dict[tuple, int] = {}
        for r, tasks in enumerate(lists):
            assert tasks[-1] == ReduceGradients() and tasks.count(ReduceGradients()) == 1, where
            fwd = [(t.microbatch, t.chunk) for t in tasks if isinstance(t, Forward)]
            bwd = [(t.microbatch, t.chunk) for t in tasks if isinstance(t, Backward)]
            every = sorted((mb, c) for mb in range(m) for c in range(vpp))
            assert sorted(fwd) == every and sorted(bwd) == every, where
            pos = {("F", t.microbatch, t.chunk) if isinstance(t, Forward) else ("B", t.microbatch, t.chunk): i
                   for i, t in enumerate(tasks) if isinstance(t, (Forward, Backward))}
            assert all(pos[("F", mb, c)] < pos[("B", mb, c)] for mb, c in every), where
            # Every chunk's backwards run in microbatch order 0..m-1 (same gradient accumulation order).
            for c in range(vpp):
                assert [mb for mb, cc in bwd if cc == c] == list(range(m)), where
            wgt = [(t.microbatch, t.chunk) for t in tasks if isinstance(t, WeightGrad)]
            if name in SPLIT_BACKWARD_SCHEDULES:
                # one W per B, after it, in microbatch order (the weight gradients' accumulation order)
                wpos = {(t.microbatch, t.chunk): i for i, t in enumerate(tasks) if isinstance(t, WeightGrad)}
                assert wgt == bwd and all(pos[("B", mb, c)] < wpos[(mb, c)] for mb, c in every), where
                # zb-h1: at most pp microbatches between F and W; interleaved-zb: at most interleaved
                # 1F1B's rank-0 peak of chunks in flight
                bound = pp if vpp == 1 else min(2 * (pp - 1) + (vpp - 1) * pp + 1, vpp * m)
                assert max(_awaiting_w_peak(tasks), 1) <= bound, where
            else:
                assert wgt == [], where
            for i, t in enumerate(tasks[:-1]):
                stage = t.chunk * pp + r
                # Adjacency: recv right before its compute, send right after it.
                if isinstance(t, Forward):
                    assert (stage > 0) == (i > 0 and tasks[i - 1] == RecvActivation(t.microbatch, t.chunk)), where
                    assert (stage < S - 1) == (tasks[i + 1] == SendActivation(t.microbatch, t.chunk)), where
                if isinstance(t, Backward):
                    assert (stage < S - 1) == (i > 0 and tasks[i - 1] == RecvGradient(t.microbatch, t.chunk)), where
                    assert (stage > 0) == (tasks[i + 1] == SendGradient(t.microbatch, t.chunk)), where
                # Peer from the convention: stage s = chunk * pp + rank; activations go s -> s + 1.
                if isinstance(t, SendActivation):
                    peer = stage + 1
                    sends[("A", t.microbatch, peer % pp, peer // pp)] = sends.get(("A", t.microbatch, peer % pp,
                                                                                   peer // pp), 0) + 1
                elif isinstance(t, SendGradient):
                    peer = stage - 1
                    sends[("G", t.microbatch, peer % pp, peer // pp)] = sends.get(("G", t.microbatch, peer % pp,
                                                                                   peer // pp), 0) + 1
                elif isinstance(t, RecvActivation):
                    recvs[("A", t.microbatch, r, t.chunk)] = recvs.get(("A", t.microbatch, r, t.chunk), 0) + 1
                elif isinstance(t, RecvGradient):
                    recvs[("G", t.microbatch, r, t.chunk)] = recvs.get(("G", t.microbatch, r, t.chunk), 0) + 1
            peak = _in_flight_peak(tasks)
            if name == "gpipe":
                assert peak == m, where
            elif name in ("1f1b", "zb-h1") or vpp == 1:
                assert peak <= pp - r and peak == min(pp - r, m), where
            else:  # Megatron's interleaved bound: warm-up + 1, in chunk-microbatches.
                assert peak == min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, vpp * m), where
        assert sends == recvs and set(sends.values()) <= {1}, where
        assert len(sends) == 2 * m * (S - 1), where


def test_simulation_completes_and_bubble_matches_formula():
    # Uniform task times: every rank computes the same work, so all ranks' idle share must equal
    # (pp-1)/(vpp*m+pp-1). Tolerance 1e-9: times are sums of 1/vpp, 2/vpp, ... (not exact in binary).
    for name, pp, m, vpp in CONFIGS:
        if name in SPLIT_BACKWARD_SCHEDULES:
            continue  # test_zero_bubble_* below
        for f, b in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
            res = simulate(pp, m, vpp, name, forward_time=f, backward_time=b)
            th = theoretical_bubble(pp, m, vpp)
            assert res.bubble == pytest.approx([th] * pp, abs=1e-9), (name, pp, m, vpp, f, b)
            assert res.total_time == pytest.approx((m * vpp + pp - 1) * (f + b) / vpp, abs=1e-9)
            assert res.busy == pytest.approx([m * (f + b)] * pp, abs=1e-9)
            tasks = [schedule_tasks(name, r, pp, m, vpp) for r in range(pp)]
            assert res.peak_in_flight == tuple(_in_flight_peak(t) for t in tasks)


def test_zero_bubble_is_deadlock_free_and_never_slower_than_1f1b():
    # pp 2..8, m >= pp (and a few m < pp), several B/W splits and link latencies: the simulator runs
    # every list to the end (no deadlock, every message received, one W per B) and ZB-H1 never
    # takes longer than 1F1B with the same total work, holds the same full activations (F to B),
    # and at most pp microbatches between F and W on any rank.
    checked = 0
    for pp in range(2, 9):
        for m in list(range(pp, 3 * pp + 1)) + [1, pp - 1]:
            for f, b, w, p2p in ((1.0, 2.0, 1.0, 0.0), (2.0, 3.0, 1.0, 0.0), (1.0, 2.0, 0.5, 0.3)):
                zb = simulate(pp, m, 1, "zb-h1", f, b, p2p, weight_time=w)
                ref = simulate(pp, m, 1, "1f1b", f, b, p2p)
                assert zb.busy == pytest.approx(ref.busy), (pp, m)
                assert zb.total_time <= ref.total_time + 1e-9, (pp, m, f, b, w, p2p)
                assert zb.peak_in_flight == ref.peak_in_flight, (pp, m)
                assert max(zb.peak_awaiting_w) <= pp, (pp, m)
                checked += 1
    assert checked > 250


def test_zero_bubble_bubble_formula():
    # With F = B = W (1, 2 = 1 + 1, W = 1) every rank idles pp - 1 slots: (p-1)/(3m+p-1), a third
    # of 1F1B's (p-1)/(m+p-1) in time units; at pp=4, m=8: 3/27 = 0.111 vs 9/33 = 0.273.
    for pp in range(2, 9):
        for m in range(pp, 3 * pp + 1):
            res = simulate(pp, m, 1, "zb-h1", 1.0, 2.0, weight_time=1.0)
            assert res.bubble == pytest.approx([(pp - 1) / (3 * m + pp - 1)] * pp, abs=1e-9), (pp, m)
            assert res.total_time == pytest.approx(3 * m + pp - 1)
    assert simulate(4, 8, 1, "zb-h1").mean_bubble == pytest.approx(3 / 27)
    assert simulate(4, 8, 1, "1f1b").mean_bubble == pytest.approx(theoretical_bubble(4, 8))


def test_interleaved_zero_bubble_is_deadlock_free_and_beats_both_parents():
    # pp 2..8, m a multiple of pp, vpp 2..3, several B/W splits and link latencies: every list runs
    # to the end, with interleaved 1F1B's work and activations in flight, never slower than it (nor,
    # without link latency, than zb-h1; same total work), and at uniform F = B = W its idle share is
    # (pp-1)/(3 vpp m + pp-1) up to pp = 6 (half of zb-h1's at vpp = 2).
    checked = 0
    for pp in range(2, 9):
        for m in (pp, 2 * pp, 3 * pp):
            for vpp in (2, 3):
                for f, b, w, p2p in ((1.0, 2.0, 1.0, 0.0), (2.0, 3.0, 1.0, 0.0), (1.0, 2.0, 0.5, 0.3)):
                    izb = simulate(pp, m, vpp, "interleaved-zb", f, b, p2p, weight_time=w)
                    inter = simulate(pp, m, vpp, "interleaved-1f1b", f, b, p2p)
                    zb = simulate(pp, m, 1, "zb-h1", f, b, p2p, weight_time=w)
                    assert izb.busy == pytest.approx(inter.busy), (pp, m, vpp)
                    assert izb.total_time <= inter.total_time + 1e-9, (pp, m, vpp, f, b, w, p2p)
                    if p2p == 0:  # chunks cross vpp times more links: with latency zb-h1 can win
                        assert izb.total_time <= zb.total_time + 1e-9, (pp, m, vpp, f, b, w, p2p)
                    assert izb.peak_in_flight == inter.peak_in_flight, (pp, m, vpp)
                    checked += 1
                if pp <= 6:
                    res = simulate(pp, m, vpp, "interleaved-zb", 1.0, 2.0, weight_time=1.0)
                    assert res.mean_bubble == pytest.approx((pp - 1) / (3 * vpp * m + pp - 1), abs=1e-9), (pp, m)
    assert checked > 120
    assert simulate(4, 8, 2, "interleaved-zb").mean_bubble == pytest.approx(3 / 51)
    for r in range(4):  # with one chunk per rank it is zb-h1
        assert schedule_tasks("interleaved-zb", r, 4, 8) == schedule_tasks("zb-h1", r, 4, 8)


def test_interleaving_reduces_the_bubble():
    checked = 0
    for name, pp, m, vpp in CONFIGS:
        if name == "interleaved-1f1b" and vpp > 1:
            inter = simulate(pp, m, vpp, name)
            plain = simulate(pp, m, 1, "1f1b")
            assert inter.mean_bubble < plain.mean_bubble, (pp, m, vpp)
            assert inter.total_time < plain.total_time, (pp, m, vpp)
            checked += 1
    assert checked > 20


def test_p2p_time_delays_receives_only():
    res = simulate(4, 8, 1, "1f1b", p2p_time=0.5)
    base = simulate(4, 8, 1, "1f1b")
    assert res.busy == base.busy and res.total_time > base.total_time
    # GPipe's critical path crosses 2*(pp-1) links: forward chain and backward chain.
    g = simulate(4, 4, 1, "gpipe", p2p_time=0.5)
    assert g.total_time == pytest.approx(simulate(4, 4, 1, "gpipe").total_time + 2 * 3 * 0.5)


def test_interleaved_with_vpp1_is_1f1b():
    for pp in range(1, 6):
        for m in range(pp, 13, pp):
            for r in range(pp):
                assert schedule_tasks("interleaved-1f1b", r, pp, m) == schedule_tasks("1f1b", r, pp, m)


def test_compute_order():
    assert compute_order("1f1b", 3, 4, 2) == [Forward(0, 0), Backward(0, 0), Forward(1, 0), Backward(1, 0)]
    assert compute_order("zb-h1", 1, 2, 2) == [Forward(0, 0), Backward(0, 0), Forward(1, 0), Backward(1, 0),
                                                WeightGrad(0, 0), WeightGrad(1, 0)]


# ---- the simulator rejects broken lists --------------------------------------------------------

def test_deadlock_is_detected_and_names_ranks_and_tasks():
    # Rank 0 waits for a gradient before sending the activation rank 1 waits for.
    lists = [_parse("rG0 F0 sA0 B0 R"), _parse("rA0 F0 B0 sG0 R")]
    with pytest.raises(ScheduleError, match=r"deadlock.*stuck ranks \[0, 1\].*rank 0 at task 0 "
                                            r"RecvGradient\(microbatch=0, chunk=0\).*rank 1 at task 0 "
                                            r"RecvActivation\(microbatch=0, chunk=0\)"):
        simulate_tasks(lists)


@pytest.mark.parametrize("lists, message", [
    ([_parse("F0 sA0 sA0 rG0 B0 R"), _parse("rA0 F0 B0 sG0 R")], "sent twice"),
    ([_parse("F0 sA0 rG0 B0 R"), _parse("F0 B0 sG0 R")], "Forward before its RecvActivation"),
    ([_parse("F0 sA0 B0 R"), _parse("rA0 F0 B0 sG0 R")], "Backward before its RecvGradient"),
    ([_parse("F0 sA0 rG0 B0 R"), _parse("rA0 F0 sA0 B0 sG0 R")], "invalid on global stage 1"),
    ([_parse("F0 sA0 rG0 B0 R"), _parse("rA0 F0 R B0 sG0 R")], "ReduceGradients must be the last"),
    ([_parse("F0 sA0 F1 sA1 rG0 B0 R"), _parse("rA0 F0 B0 sG0 R")], "never received"),
    ([_parse("F0 sA0 R"), _parse("rA0 F0 R")], "forwards without a backward"),
    ([_parse("F0 sA0 W0 rG0 B0 R"), _parse("rA0 F0 B0 sG0 W0 R")], "WeightGrad run twice or before its Backward"),
    ([_parse("F0 sA0 rG0 B0 W0 W0 R"), _parse("rA0 F0 B0 sG0 W0 R")], "WeightGrad run twice"),
    ([_parse("F0 sA0 rG0 B0 R"), _parse("rA0 F0 B0 sG0 W0 R")], "backwards without a WeightGrad"),
])
def test_simulator_rejects_invalid_lists(lists, message):
    with pytest.raises(ScheduleError, match=message):
        simulate_tasks(lists)


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("zero-bubble", 0, 4, 8), r"unknown pipeline schedule 'zero-bubble'; valid: 'gpipe', '1f1b', 'interleaved-1f1b'"),
    (("1f1b", 0, 0, 8), r"pp \(pipeline-parallel size\) must be >= 1, got pp=0"),
    (("1f1b", 4, 4, 8), r"pp_rank=4 is out of range for pp=4; valid: 0..3"),
    (("1f1b", -1, 4, 8), r"pp_rank=-1 is out of range"),
    (("gpipe", 0, 4, 0), r"microbatches must be >= 1, got microbatches=0"),
    (("1f1b", 0, 4, 8, 2), r"vpp=2 needs an interleaved schedule \('interleaved-1f1b' or 'interleaved-zb'\); "
                           r"'1f1b' supports only vpp=1"),
    (("gpipe", 0, 4, 8, 2), r"vpp=2 needs an interleaved schedule .*; 'gpipe'"),
    (("interleaved-zb", 0, 4, 6, 2), r"'interleaved-zb' needs microbatches divisible by pp=4"),
    (("interleaved-1f1b", 0, 4, 8, 0), r"vpp \(virtual chunks per rank\) must be >= 1, got vpp=0"),
    (("interleaved-1f1b", 0, 4, 6, 2),
     r"microbatches divisible by pp=4, got microbatches=6; valid nearby values: 4, 8"),
    (("interleaved-1f1b", 0, 4, 2, 2), r"needs microbatches >= pp, got microbatches=2 < pp=4"),
    (("interleaved-1f1b", 0, 4, 6, 1), r"divisible by pp=4"),  # checked with vpp=1 too
    (("interleaved-1f1b", 0, 1, 4, 2), r"with vpp=2 needs pp >= 2"),
    (("1f1b", 0, 4.0, 8), r"pp must be an int, got 4.0"),
])
def test_schedule_errors(args, message):
    with pytest.raises(ScheduleError, match=message):
        schedule_tasks(*args)
    assert issubclass(ScheduleError, ValueError)


def test_theoretical_bubble():
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble(1, 5) == 0.0
    with pytest.raises(ScheduleError, match="microbatches must be an int >= 1, got microbatches=0"):
        theoretical_bubble(4, 0)


# ---- the documentation's diagrams are the simulator's output -------------------------------------

def test_doc_diagrams_match_simulation():
    doc = (Path(__file__).parents[1] / "docs" / "pipeline_schedules.md").read_text()
    blocks = re.findall(r"<!-- timeline: (\S+) pp=(\d+) m=(\d+) vpp=(\d+) -->\n```text\n(.*?)```", doc, re.S)
    assert len(blocks) >= 3
    for name, pp, m, vpp, body in blocks:
        assert body.rstrip("\n") == format_timeline(simulate(int(pp), int(m), int(vpp), name)), name
