"""The bubble each pipeline schedule is priced with: the closed forms against the simulator, and the
step-time model (``plait plan``) charging zb-h1 its own, smaller bubble instead of 1F1B's."""

from __future__ import annotations

import pytest

from plait.devices import get_device
from plait.models.llama import LlamaConfig
from plait.pipeline.schedules import ScheduleError
from plait.pipeline.simulate import schedule_bubble, simulate, theoretical_bubble
from plait.plan.degrees import ParallelDegrees
from plait.plan.timing import estimate_step_time


def test_schedule_bubble_is_the_simulated_one():
    for pp in range(2, 7):
        for m in range(1, 3 * pp + 1):
            for name in ("1f1b", "zb-h1"):
                simulated = simulate(pp, m, 1, name).mean_bubble
                assert schedule_bubble(name, pp, m) == pytest.approx(simulated), (name, pp, m)
    assert schedule_bubble("interleaved-1f1b", 4, 8, 2) == theoretical_bubble(4, 8, 2)
    assert schedule_bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)
    with pytest.raises(ScheduleError, match="microbatches must be an int >= 1"):
        schedule_bubble("zb-h1", 2, 0)


def test_step_time_prices_zb_h1_bubble():
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    # one layer per stage, given: the default split would trace the model (a second of start-up)
    kw = dict(micro_batch_size=1, seq_len=32, microbatches=8, peak=1e9, stage_layers=[[0], [1], [2], [3]])
    one_f_one_b = estimate_step_time(config, ParallelDegrees(pp=4), get_device("cpu"), **kw)
    zb = estimate_step_time(config, ParallelDegrees(pp=4, schedule="zb-h1"), get_device("cpu"), **kw)
    assert one_f_one_b.bubble_share == pytest.approx(3 / 11)
    assert zb.bubble_share == pytest.approx(3 / 27)
    assert zb.compute_s == one_f_one_b.compute_s and zb.total_s < one_f_one_b.total_s
