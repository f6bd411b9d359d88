"""Decoder-layer lists of each pipeline stage, the layout ``build_llama_stages`` takes."""

from __future__ import annotations

from typing import Any

from plait.plan.pipeline_split import plan_partition


def stage_layer_lists(config: Any, num_stages: int, seq_len: int, **kw) -> list[list[int]]:
    """Decoder-layer indices of each global stage, in order."""
    partition = plan_partition(config, num_stages, seq_len, **kw)
    prefix = "model.layers."
    return [[int(name[len(prefix):]) for name in stage if name.startswith(prefix)] for stage in partition.stages]
