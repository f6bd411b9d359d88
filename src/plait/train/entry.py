"""The function each launched rank runs for ``plait train``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from plait.checkpoint.format import CheckpointError
from plait.config import recipe_to_yaml, validate_recipe
from plait.config.load import parse_recipe_text
from plait.config.schema import Recipe
from plait.data.checks import check_model_vocab, check_samples, verify_prepared
from plait.data.errors import DataError
from plait.data.mixture import SourceSpec, load_mixture_index, prepare_mixture
from plait.data.prepare import prepare_dataset
from plait.data.prompt_prepare import (
    PromptDataset,
    check_prompts_fit,
    describe_prompts,
    prepare_prompts,
    prompts_directory,
    prompts_index,
)
from plait.data.sft_prepare import (
    RowDataset,
    RowFormat,
    RowsSettings,
    check_rows_tokenizer,
    prepare_rows,
    rows_directory,
)
from plait.data.tokenizer_files import file_sha256
from plait.launch import exit_worker_now, finish_worker, init_worker, local_world_size
from plait.train.trainer import Trainer


def prepare_data(recipe: Recipe, progress: bool = False) -> Path:
    """The prepared directory ``recipe.data`` names, made (or found) and checked for this run.

    ``data.source`` may be a corpus, text files or a directory written by ``plait data prepare``
    (used as it is); ``data.cache_dir`` is the cache the data is prepared into. The data is checked
    against its index, its tokenizer, ``data.seq_len`` (one sample in each split) and the model's
    vocabulary (every id below it). Called by ``plait train`` before launch and by every rank, so a
    problem is one :class:`~plait.data.errors.DataError` (or a ``ModelConfigError`` for a tokenizer
    larger than ``model.hf_path``'s vocabulary), both ``ValueError``, naming the file and the numbers.
    """
    d = recipe.data
    if d.format == "prompts":
        return prepare_prompt_rows(recipe, report=progress)
    if d.format != "text":
        return prepare_fine_tuning_rows(recipe, report=progress)
    if d.sources is not None:
        mixture = prepare_mixture([SourceSpec(s.source, s.weight, s.name, tuple(sorted(s.fields.items())), s.limit)
                                   for s in d.sources], tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                                  val_fraction=d.val_fraction, seed=recipe.run.seed, cache_dir=d.cache_dir,
                                  progress=progress, workers=d.num_workers)
        parts = [Path(p["directory"]) for p in load_mixture_index(mixture)["parts"]]
    else:
        mixture = None
        parts = [prepare_dataset(d.source, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                                 val_fraction=d.val_fraction, out_dir=None, seed=recipe.run.seed, progress=progress,
                                 cache_dir=d.cache_dir, fields={str(k): v for k, v in d.fields.items()},
                                 workers=d.num_workers)]
    for path in parts:
        data = verify_prepared(path)
        check_samples(data, d.seq_len)
        # the trainer builds the model from the same call, so this is the vocabulary it will have
        check_model_vocab(data, recipe.model.to_model_config(data.vocab_size).vocab_size)
    return mixture if mixture is not None else parts[0]


def prepare_fine_tuning_rows(recipe: Recipe, *, report: bool = False) -> Path:
    """The prepared rows of a ``data.format: sft`` or ``preference`` recipe (or the prepared directory it names),
    checked against ``data.tokenizer`` (the rows' tokenizer identity) and the model's vocabulary; ``report``
    prints what preparation kept and dropped."""
    d = recipe.data
    given = rows_directory(d.source)
    if given is not None:
        path = given
    else:
        kind: RowFormat = "preference" if d.format == "preference" else "sft"
        settings = RowsSettings(kind=kind, seq_len=d.seq_len, packing=d.packing, truncation=d.truncation,
                                train_on_prompt=d.train_on_prompt, skip_bad_rows=d.skip_bad_rows,
                                val_fraction=d.val_fraction, seed=recipe.run.seed,
                                fields=tuple(sorted(d.fields.items())))
        result = prepare_rows(d.source, d.tokenizer, settings, cache_dir=d.cache_dir)
        path = result.directory
        if report:
            print(f"data: {result.describe()} -> {path}", flush=True)
    check_rows_tokenizer(path, d.tokenizer)
    rows = RowDataset(path, "train")
    if rows.kind != d.format:
        raise DataError(f"data.source {d.source!r} holds {rows.kind} rows but data.format is {d.format!r}; "
                        f"set data.format={rows.kind} or give a source of {d.format} rows")
    if rows.seq_len != d.seq_len:
        raise DataError(f"data.source {d.source!r} holds rows of {rows.seq_len} tokens, not data.seq_len="
                        f"{d.seq_len}; prepare it again with this seq_len or set data.seq_len={rows.seq_len}")
    model_vocab = recipe.model.to_model_config(rows.vocab_size).vocab_size
    if rows.vocab_size > model_vocab:
        raise DataError(f"data.tokenizer has {rows.vocab_size} tokens but the model's vocabulary is {model_vocab}; "
                        f"use the model's own tokenizer")
    return path


def prepare_prompt_rows(recipe: Recipe, *, report: bool = False) -> Path:
    """The prepared prompts of a ``data.format: prompts`` recipe (or the prepared directory it names),
    checked against ``data.tokenizer`` (the prompts' tokenizer identity), ``grpo.eval_source``,
    ``data.seq_len`` with ``grpo.max_new_tokens`` and the model's vocabulary; ``report`` prints
    the splits."""
    d, g = recipe.data, recipe.grpo
    given = prompts_directory(d.source)
    if given is not None:
        path = given
        index = prompts_index(path) or {}
        if g.eval_source is not None and index.get("eval_source_sha256") != _sha256(g.eval_source):
            raise DataError(f"data.source {d.source!r} holds prompts prepared with another validation split than "
                            f"grpo.eval_source={g.eval_source!r}; remove grpo.eval_source, or prepare the prompts "
                            f"again from their .jsonl file")
    else:
        path = prepare_prompts(d.source, d.tokenizer, seq_len=d.seq_len, max_new_tokens=g.max_new_tokens,
                               val_fraction=d.val_fraction, seed=recipe.run.seed, eval_source=g.eval_source,
                               cache_dir=d.cache_dir, fields={str(k): v for k, v in d.fields.items()})
    if report:
        print(f"data: {describe_prompts(path)} -> {path}", flush=True)
    check_rows_tokenizer(path, d.tokenizer)
    check_prompts_fit(path, seq_len=d.seq_len, max_new_tokens=g.max_new_tokens)
    prompts = PromptDataset(path, "train")
    model_vocab = recipe.model.to_model_config(prompts.vocab_size).vocab_size
    if prompts.vocab_size > model_vocab:
        raise DataError(f"data.tokenizer has {prompts.vocab_size} tokens but the model's vocabulary is "
                        f"{model_vocab}; use the model's own tokenizer")
    return path


def _sha256(path: str) -> str | None:
    p = Path(path).expanduser()
    return file_sha256(p) if p.is_file() else None


#: errors a worker reports as one line (their messages name the file, field or step and the fix)
USER_ERRORS = (ValueError, CheckpointError, FloatingPointError)
#: the exit status of a worker stopped by one of them (as for a bad recipe in the parent)
USER_ERROR_STATUS = 2


def train_worker(recipe_yaml: str) -> None:
    """One rank of ``plait train``: validate the recipe for this world, prepare the data (rank 0
    first), train, and write the run's outputs; a user error exits with :data:`USER_ERROR_STATUS`."""
    threads = max(1, (os.cpu_count() or 1) // local_world_size())
    rank, world = init_worker(threads)
    try:
        resolved = validate_recipe(parse_recipe_text(recipe_yaml, "<recipe sent to the ranks>"), world)
        # Rank 0 prepares (or finds) the data first; the others then find it ready.
        if rank == 0:
            prepared = prepare_data(resolved.recipe)
        dist.barrier()
        if rank != 0:
            prepared = prepare_data(resolved.recipe)
        if rank == 0:
            out = Path(resolved.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "recipe.yaml").write_text(recipe_to_yaml(resolved, header="resolved recipe of this run"))
        trainer = Trainer(resolved, prepared, rank, world)
        final = trainer.fit()
        if trainer.stopped_by_signal:  # preempted: the checkpoint is written; leave quickly and cleanly
            exit_worker_now(0)  # the launcher is shutting down too; do not wait for it to collect a return value
        trainer.finish(final)
        if trainer.stopped_by_signal:  # stopped during the end-of-run outputs: leave as after a preemption
            exit_worker_now(0)
    except USER_ERRORS as e:
        # A problem of the run's inputs or numbers (bad data met mid-run, a checkpoint that does not
        # fit, a loss that became NaN): one line from the rank that met it, then a quick exit the
        # launcher reports by status alone. Other exceptions keep their traceback (a bug of plait).
        print(f"plait train: rank {rank}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        exit_worker_now(USER_ERROR_STATUS)
    finally:
        finish_worker()
