"""A packed row computes, for each of its samples, exactly what the sample computes alone.

Samples are packed back to back into rows with positions restarting at 0 in each sample
(``position_ids``), attention kept inside a sample (``segment_ids`` -> document mask) and no target
across a boundary (the label of each sample's first token is ``-100``). Checked in fp32 against the
samples run one by one, unpacked: logits, per-sample loss and per-sample weight gradients in one
process (Llama and Mistral, whose sliding window then acts inside each sample), and the whole
batch's loss and gradients under TP=2 with sequence parallelism and under PP=2 through the
pipeline runtime (the loss normalised by the global batch's target tokens).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from plait.data.batch import TokenBatch
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.registry import FAMILIES
from plait.pipeline.runtime import PipelineRuntime
from tp_gather import full_grads

SEQ = 16
LENGTHS = [(5, 9), (7, 6)]  # the samples of each packed row (the rest of a row is padding)
TOL = 1e-5


def _config(family: str = "llama"):
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "mistral":
        kw["sliding_window"] = 4  # shorter than every sample: the window matters inside each one
    if family == "gpt_neox":  # no grouped-query attention; partial rotary on the document positions
        kw.update(num_key_value_heads=4, partial_rotary_factor=0.5)
    if family == "gemma3":  # sliding layers with a window shorter than every sample, and full ones
        kw.update(head_dim=12, sliding_window=4, sliding_window_pattern=2)
    return FAMILIES[family].config_cls(**kw)


def _samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, labels) per sample; the first third of each sample is prompt (no loss)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for length in (n for row in LENGTHS for n in row):
        ids = torch.randint(1, 97, (length,), generator=gen)
        labels = ids.clone()
        labels[: max(1, length // 3)] = -100
        out.append((ids, labels))
    return out


def _packed(samples, only: int | None = None) -> dict[str, torch.Tensor]:
    """The samples packed into ``len(LENGTHS)`` rows; with ``only``, labels of that sample alone."""
    rows = len(LENGTHS)
    ids = torch.zeros(rows, SEQ, dtype=torch.long)
    labels = torch.full((rows, SEQ), -100, dtype=torch.long)
    positions = torch.zeros(rows, SEQ, dtype=torch.long)
    segments = torch.full((rows, SEQ), -1, dtype=torch.long)
    index = 0
    for r, lengths in enumerate(LENGTHS):
        at = 0
        for seg, n in enumerate(lengths):
            sample_ids, sample_labels = samples[index]
            ids[r, at:at + n] = sample_ids
            if only is None or only == index:
                labels[r, at:at + n] = sample_labels
            labels[r, at] = -100  # nothing predicts a sample's first token across the boundary
            positions[r, at:at + n] = torch.arange(n)
            segments[r, at:at + n] = seg
            at += n
            index += 1
    return {"ids": ids, "labels": labels, "position_ids": positions, "segment_ids": segments}


def _targets(samples) -> int:
    return sum(int((labels[1:] != -100).sum()) for _, labels in samples)


def _unpacked_reference(config, normalizer: float) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of every sample run alone (summed), divided by ``normalizer``."""
    model = build_model(config, single_process_mesh(), seed=3)
    loss = 0.0
    for ids, labels in _samples():
        step = model(ids[None], labels[None], loss_normalizer=normalizer)
        step.backward()
        loss += float(step.detach())
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_diff(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(grads) == set(reference)
    return max(float((grads[n] - reference[n]).abs().max()) for n in reference)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_neox", "gemma3"])
def test_each_packed_sample_equals_the_sample_alone(family):
    config = _config(family)
    model = build_model(config, single_process_mesh(), seed=3)
    samples = _samples()
    batch = _packed(samples)
    layout = {"position_ids": batch["position_ids"], "segment_ids": batch["segment_ids"]}
    with torch.no_grad():
        packed_logits = model(batch["ids"], **layout)
        index = 0
        for r, lengths in enumerate(LENGTHS):
            at = 0
            for n in lengths:
                alone = model(samples[index][0][None])[0]
                assert float((packed_logits[r, at:at + n] - alone).abs().max()) <= TOL
                at += n
                index += 1
    for i, (ids, labels) in enumerate(samples):
        model.zero_grad()
        alone = model(ids[None], labels[None], loss_normalizer=1.0)
        alone.backward()
        reference = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        one = _packed(samples, only=i)
        packed = model(one["ids"], one["labels"], position_ids=one["position_ids"],
                       segment_ids=one["segment_ids"], loss_normalizer=1.0)
        packed.backward()
        assert abs(float(packed.detach()) - float(alone.detach())) <= TOL * max(1.0, abs(float(alone.detach())))
        assert _max_diff({n: p.grad for n, p in model.named_parameters()}, reference) <= TOL


def test_packing_without_the_layout_would_differ():
    """The check above can fail: without positions and the document mask the packed samples see
    each other, and the logits move far beyond the tolerance."""
    model = build_model(_config(), single_process_mesh(), seed=3)
    samples = _samples()
    batch = _packed(samples)
    with torch.no_grad():
        leaked = model(batch["ids"])[0, 5:14]  # the second sample of row 0, attending to the first
        alone = model(samples[1][0][None])[0]
    assert float((leaked - alone).abs().max()) > 100 * TOL


def _tp_worker(rank: int, world: int, total: int) -> dict:
    mesh = ParallelMesh(world, rank, tp=world)
    model = build_model(_config(), mesh, seed=3, sequence_parallel=True)
    batch = _packed(_samples())
    loss = model(batch["ids"], batch["labels"], position_ids=batch["position_ids"],
                 segment_ids=batch["segment_ids"], loss_normalizer=float(total))
    loss.backward()
    return {"loss": float(loss.detach()), "grads": full_grads(model, mesh.info("tp"))}


def _pp_worker(rank: int, world: int, total: int) -> dict:
    mesh = ParallelMesh(world, rank, pp=world)
    config = _config()
    stages = build_stages(config, mesh, [[0, 1], [2, 3]], seed=3)
    runtime = PipelineRuntime(stages, mesh, schedule="1f1b", microbatches=len(LENGTHS), micro_batch_size=1,
                              seq_len=SEQ, hidden_size=config.hidden_size, sequence_parallel=False,
                              dtype=torch.float32)
    b = _packed(_samples())
    batch = TokenBatch(input_ids=b["ids"][:, None], labels=b["labels"][:, None],
                       position_ids=b["position_ids"][:, None], segment_ids=b["segment_ids"][:, None],
                       loss_tokens=total)
    loss = runtime.run(batch, train=True)
    grads = {n: p.grad.clone() for stage in stages for n, p in stage.named_parameters()}
    return {"loss": float(loss), "grads": grads, "last": stages[0].last}


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_packed_batch_under_tp_and_pp_equals_the_samples_alone(layout):
    total = _targets(_samples())
    ref_loss, ref_grads = _unpacked_reference(_config(), float(total))
    worker = _tp_worker if layout == "tp2-sp" else _pp_worker
    results = run_distributed(worker, 2, total)
    if layout == "tp2-sp":
        loss, grads = results[0]["loss"], results[0]["grads"]
    else:
        loss = next(r["loss"] for r in results if r["last"])
        grads = {n: g for r in results for n, g in r["grads"].items()}
    assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert _max_diff(grads, ref_grads) <= TOL
