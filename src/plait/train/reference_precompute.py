"""``preference.reference: precompute``: one forward pass of the initial model over the prepared
pairs, stored in the prepared directory and reused by every later run with the same model.

The pass runs at the start of a run, before a checkpoint is restored, on the policy's own stages
with every LoRA adapter disabled and dropout off: the model it scores with is exactly what the
``frozen`` and ``adapters_off`` references compute every step (the initial base model), so the
three modes give the same losses (tested). Nothing is held in memory during training beyond the
table's pairs of each batch, and no reference pass runs in the step.

Every data-parallel rank scores its share of each global batch of rows through the run's own
pipeline schedule (forward only); the last stage's first tensor-parallel rank fills its pairs
into a table that one sum over all ranks completes (each pair is filled exactly once, checked).
Rank 0 writes it (:func:`plait.data.reference_table.write_table`); the key
(:func:`reference_identity`) names the initial model and numerics, so a run of another model
computes its own table and never replaces this one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from plait.config.schema import Recipe
from plait.data.reference_table import load_table, pair_offsets, reference_key, table_path, write_table
from plait.data.sft_prepare import RowDataset
from plait.lora import adapters_disabled
from plait.outputs.ownership import OutputDirError, probe_writable
from plait.post_training.head import PreferenceHead
from plait.train.preference import eval_mode
from plait.train.run_state import RunState


def reference_identity(r: Recipe) -> dict[str, Any]:
    """What determines the reference log-probabilities besides the rows: the model section (its
    architecture, or ``hf_path`` with its weight files' sizes and modification times), the run seed
    (random initialisation is a function of seed and parameter name), the precision section, and
    how a LoRA base is quantized (the policy with its adapters off scores the pairs)."""
    identity: dict[str, Any] = {"model": r.model.model_dump(mode="json"), "seed": r.run.seed,
                                "precision": r.precision.model_dump(mode="json")}
    if r.lora.quantized:  # the scoring base is the quantized one
        identity["quantize_base"] = [r.lora.quantize_base, r.lora.quantize_block_size]
    if r.model.hf_path is not None:
        root = Path(r.model.hf_path).expanduser().resolve()
        identity["hf_path"] = str(root)
        identity["weights"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
                               for p in sorted(root.glob("*.safetensors"))]
    return identity


def _writes_table(state: RunState) -> bool:
    """The ranks whose scores enter the table: the last pipeline stage's first TP rank of each DP replica."""
    return any(stage.last for stage in state.runtime.stages) and state.mesh.info("tp").rank == 0


@torch.no_grad()
def compute_table(state: RunState, head: PreferenceHead, dataset: RowDataset) -> np.ndarray:
    """``[pairs, 2]`` reference sums of every pair of ``dataset`` (see the module doc), through
    the policy's runtime with its adapters off and ``head`` keeping the last stage's sums."""
    assert dataset.row_pairs is not None, "preference rows"
    runtime, stages = state.runtime, state.runtime.stages
    r = state.recipe
    microbatches, rows_per_microbatch = r.parallel.microbatches, r.data.micro_batch_size
    dp = state.mesh.info("dp")
    share = microbatches * rows_per_microbatch
    global_batch = share * dp.size
    offsets, row_pairs, n = pair_offsets(dataset.row_pairs), dataset.row_pairs, len(dataset)
    table = torch.zeros(dataset.total_pairs, 2, dtype=torch.float32)
    filled = torch.zeros(dataset.total_pairs, dtype=torch.int32)
    writer = _writes_table(state)
    for start in range(0, n, global_batch):
        positions = list(range(start, start + global_batch))
        indices = [i if i < n else 0 for i in positions]  # the last batch is padded with row 0, not stored
        lo = dp.rank * share
        mine, mine_positions = indices[lo:lo + share], positions[lo:lo + share]
        batch = dataset.token_batch(mine, indices, microbatches).to(state.device)
        with adapters_disabled(stages), eval_mode(stages), head.collecting_reference():
            runtime.execute(batch, train=False)
        if not writer:
            continue
        for m in range(microbatches):
            got = head.take_reference(m)
            assert got is not None, "the last stage stores every micro-batch's reference"
            values = torch.stack(got, dim=1).float().cpu()
            cursor = 0
            for k in range(m * rows_per_microbatch, (m + 1) * rows_per_microbatch):
                row, pairs = mine[k], int(row_pairs[mine[k]])
                if mine_positions[k] < n:
                    table[offsets[row]:offsets[row] + pairs] = values[cursor:cursor + pairs]
                    filled[offsets[row]:offsets[row] + pairs] += 1
                cursor += pairs
    if state.world > 1:
        both = torch.cat([table.double(), filled.double()[:, None]], dim=1).to(state.device)
        dist.all_reduce(both)
        table, filled = both[:, :2].float().cpu(), both[:, 2].round().int().cpu()
    if not bool((filled == 1).all()):
        raise RuntimeError(f"reference pass: {int((filled != 1).sum())} of {len(filled)} pairs were not scored "
                           f"exactly once")
    return table.numpy()


def attach_precomputed_reference(state: RunState, head: PreferenceHead, prepared_dir: str | Path) -> None:
    """Give both splits of the run their reference table: read it when the prepared directory holds
    one for this model, else compute and store it (rank 0 writes; every rank waits for the file)."""
    key = reference_key(reference_identity(state.recipe))
    for dataset in (state.train_data, state.val_data):
        assert isinstance(dataset, RowDataset), "precompute needs preference rows (checked by the recipe rules)"
        table = load_table(prepared_dir, key, dataset.split, dataset.total_pairs)
        if table is None:
            started = time.perf_counter()
            table = compute_table(state, head, dataset)
            if state.rank == 0:
                try:
                    path = write_table(prepared_dir, key, dataset.split, table)
                except OSError as e:
                    raise OSError(f"preference.reference=precompute stores the reference log-probabilities in the "
                                  f"prepared data directory {prepared_dir}, which cannot be written ({e}); make it "
                                  f"writable, or use preference.reference=frozen") from e
                print(f"reference log-probabilities of {dataset.total_pairs} {dataset.split} pairs computed in "
                      f"{time.perf_counter() - started:.1f} s -> {path}", flush=True)
            if state.world > 1:
                dist.barrier(group=state.control)
        elif state.rank == 0:
            print(f"reference log-probabilities of the {dataset.split} pairs reused from "
                  f"{table_path(prepared_dir, key, dataset.split)}", flush=True)
        dataset.attach_reference(table)


def check_reference_storable(recipe: Recipe, prepared_dir: str | Path) -> None:
    """Before launch: when a split has no stored table for this model yet, the prepared directory
    must take one (a read-only directory would fail only after the reference pass)."""
    key = reference_key(reference_identity(recipe))
    if all(table_path(prepared_dir, key, split).is_file() for split in ("train", "val")):
        return
    try:
        probe_writable(table_path(prepared_dir, key, "train").parent, what="the prepared data directory")
    except OutputDirError as e:
        raise OutputDirError(f"preference.reference=precompute stores the reference log-probabilities beside the "
                             f"prepared rows, and {e}; make it writable, prepare the rows elsewhere (data.cache_dir), "
                             f"or use preference.reference=frozen") from None


__all__ = ["attach_precomputed_reference", "check_reference_storable", "compute_table", "reference_identity"]
