"""Elastic resize rules (no processes): dp follows the world size, the global batch is kept by
re-deriving the micro-batches, and a world that tp/pp/cp do not fit is refused."""

from __future__ import annotations

import pytest

from plait.cluster.elastic import ResizeError, fit_to_world
from plait.config import validate_recipe

RECIPE = {"parallel": {"tp": 2}, "data": {"micro_batch_size": 2, "global_batch_size": 8}}


def test_the_global_batch_is_kept_when_the_world_shrinks_or_grows():
    for world, microbatches in ((8, 1), (4, 2), (2, 4)):
        fitted, note = fit_to_world(RECIPE, world)
        resolved = validate_recipe(fitted, world, check_paths=False)
        assert (resolved.dp, resolved.recipe.parallel.microbatches, resolved.global_batch_size) == (
            world // 2, microbatches, 8)
        assert (note is None) == (microbatches == 1), note
    assert fit_to_world(RECIPE, 2)[1] == ("dp=1 at world size 2: parallel.microbatches 1 -> 4 keeps "
                                          "data.global_batch_size=8")
    assert RECIPE["parallel"] == {"tp": 2}  # the input is not changed


def test_fixed_degrees_and_unkeepable_batches_are_refused():
    with pytest.raises(ResizeError, match=r"not a multiple of tp\*pp\*cp = 2\*1\*1 = 2; a resize changes only"):
        fit_to_world(RECIPE, 3)
    with pytest.raises(ResizeError, match="data.global_batch_size=8 cannot be kept at dp=3"):
        fit_to_world(RECIPE, 6)
    fixed = {**RECIPE, "parallel": {"tp": 2, "dp": 2}}
    assert fit_to_world(fixed, 2) == (fixed, None)  # a fixed dp is left to validation, which names it
    no_gbs = {"parallel": {"tp": 2}}
    assert fit_to_world(no_gbs, 2) == (no_gbs, None)  # null global batch: it follows dp by definition
