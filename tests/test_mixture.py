"""Weighted mixtures (``data.sources``): exact per-source counts, determinism, every source seen
whole before it repeats, one tokenizer, and training that is the same under DP and after a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from distributed import run_distributed
from plait.config import check_recipe, load_recipe, recipe_data
from plait.config.load import DEFAULT_RECIPE
from plait.data.mixture import (
    MixtureDataset,
    MixtureError,
    MixtureSampler,
    SourceSpec,
    blend_counts,
    blend_pattern,
    prepare_mixture,
)
from plait.data.prepare import prepare_dataset
from plait.train.entry import prepare_data
from trainer_runs import _checkpoint_worker, max_relative


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=5), st.sampled_from([64, 1000, 4096]))
def test_every_prefix_of_the_blend_is_within_two_samples_of_its_share(weights, period):
    assume(min(weights) / sum(weights) * period >= 1)  # smaller shares are refused (below)
    counts = blend_counts(weights, period)
    assert counts.sum() == period and (counts > 0).all()
    share = np.asarray(weights) / sum(weights) * period
    assert (np.abs(counts - share) < 1).all()  # largest remainders
    sources, ordinals = blend_pattern(counts)
    seen = np.zeros(len(counts))
    for k, s in enumerate(sources, 1):
        assert ordinals[k - 1] == seen[s]  # each source's positions in order
        seen[s] += 1
        assert (np.abs(seen - counts * k / period) < 2).all(), (k, seen)


def test_sampler_counts_are_exact_and_each_source_is_seen_whole_before_repeating():
    sizes, weights = [7, 50, 13], [0.5, 0.3, 0.2]
    sampler = MixtureSampler(sizes, weights, global_batch_size=20, seed=3, period=100)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = [i for step in range(25) for i in sampler.indices(step)]  # 500 samples = 5 periods
    source = np.searchsorted(offsets, flat, side="right") - 1
    assert np.bincount(source).tolist() == [250, 150, 100]
    for s, n in enumerate(sizes):
        local = np.asarray(flat)[source == s] - offsets[s]
        for epoch in range(len(local) // n):  # every epoch of a source is a permutation of all its samples
            assert sorted(local[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    again = MixtureSampler(sizes, weights, global_batch_size=20, seed=3, period=100)
    assert again.indices(17) == sampler.indices(17)  # a pure function of (seed, step): resuming needs the step
    assert MixtureSampler(sizes, weights, 20, seed=4, period=100).indices(17) != sampler.indices(17)
    ranks = [i for r in range(4) for mb in sampler.rank_indices(9, r, 4, 1) for i in mb]
    assert ranks == sampler.indices(9)  # the DP slices concatenate to the global batch


def _mixture_items(cache, out):
    return ["data.sources=[{source: shakespeare, weight: 3, limit: 3}, {source: bible, weight: 1, name: kjv, "
            "limit: 4}]", "data.vocab_size=320", "data.seq_len=32", f"data.cache_dir={cache}",
            f"run.output_dir={out}", "model.hidden_size=64", "model.intermediate_size=128",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.num_hidden_layers=2",
            "scheduler.warmup_steps=0", "logging.progress_bar=false", "logging.tensorboard=false",
            "checkpoint.async_save=false", "parallel.tp=1", "parallel.sequence_parallel=false"]


def test_mixture_trains_the_same_under_dp_and_after_a_resume(tmp_path):
    cache = tmp_path / "cache"
    base = _mixture_items(cache, tmp_path / "a") + ["train.steps=4", "data.global_batch_size=8",
                                                    "data.micro_batch_size=8"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, base)))
    mixture = MixtureDataset(prepared, "train", 32)
    assert mixture.names == ["shakespeare", "kjv"] and mixture.weights == [0.75, 0.25]
    straight = run_distributed(_checkpoint_worker, 1, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, base)), prepared,
                               4, -1)
    split = _mixture_items(cache, tmp_path / "b") + ["train.steps=4", "data.global_batch_size=8", "parallel.dp=2",
                                                     "data.micro_batch_size=4"]
    first = run_distributed(_checkpoint_worker, 2, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, split)), prepared,
                            2, 2)
    resumed = split + ["checkpoint.resume=auto"]
    second = run_distributed(_checkpoint_worker, 2, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, resumed)), prepared,
                             2, -1)
    assert second[0]["start"] == 2
    losses = first[0]["losses"] + second[0]["losses"]
    assert max_relative(losses, straight[0]["losses"]) < 1e-5, (losses, straight[0]["losses"])


def test_mixture_refusals(tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "a.txt").write_text("one two three\n" * 200 + "<|endoftext|>" + "four five\n" * 200)
    a = prepare_dataset(tmp_path / "a.txt", vocab_size=260, progress=False, cache_dir=cache)
    b = prepare_dataset(tmp_path / "a.txt", vocab_size=270, progress=False, cache_dir=cache)
    with pytest.raises(MixtureError, match="data.sources use different tokenizers"):
        prepare_mixture([SourceSpec(str(a), 1.0, "a"), SourceSpec(str(b), 1.0, "b")], cache_dir=cache)
    with pytest.raises(MixtureError, match="name two sources 'a'"):
        prepare_mixture([SourceSpec(str(a), 1.0, "a"), SourceSpec(str(tmp_path / "a.txt"), 1.0, "a")],
                        tokenizer=str(a / "tokenizer.json"), cache_dir=cache)
    with pytest.raises(MixtureError, match="below one sample in"):
        blend_counts([1.0, 1e-9])
    mixture = prepare_mixture([SourceSpec(str(a), 2.0, "a"), SourceSpec(str(tmp_path / "a.txt"), 1.0, "plain")],
                              cache_dir=cache)  # a prepared source's tokenizer becomes the mixture's
    index = json.loads((mixture / "index.json").read_text())
    assert [p["weight"] for p in index["parts"]] == pytest.approx([2 / 3, 1 / 3])
    assert (mixture / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    problems = {
        "data.sources.0.weight": ["data.sources=[{source: shakespeare, weight: 0}, {source: bible, weight: 1}]"],
        "data.sources.1.weight": ["data.sources=[{source: shakespeare, weight: 1}, {source: bible, weight: -2}]"],
        "data.sources: ": ["data.sources=[{source: shakespeare, weight: 1}]"],
        "data.source: 'bible' — is given together with data.sources": [
            "data.sources=[{source: shakespeare, weight: 1}, {source: bible, weight: 1}]", "data.source=bible"],
        "data.sources.1.source: .*matches nothing": [
            f"data.sources=[{{source: shakespeare, weight: 1}}, {{source: '{tmp_path}/*.parquet', weight: 1}}]"],
        "data.sources: .*takes effect only when data.format is 'text'": [
            "data.sources=[{source: shakespeare, weight: 1}, {source: bible, weight: 1}]", "data.format=sft",
            "train.objective=sft", f"data.tokenizer={a / 'tokenizer.json'}"],
    }
    for match, items in problems.items():
        with pytest.raises(ValueError, match=match):
            check_recipe(None, items)
