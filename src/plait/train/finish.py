"""The end of every run, whatever the layout or objective: the final model, the sample, then (the
writing rank) the files describing the model's use, the plots, the summary.

A stop signal that arrives after training ended (all ranks agree) skips the slow parts, so the
run leaves before a preemption's grace period ends; the training checkpoints are kept and a run
with ``checkpoint.resume=auto`` writes the outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.config.schema import TrainSection
from plait.context_parallel.apply import whole_sequences
from plait.data.prompt_prepare import PromptDataset
from plait.data.tokenizer_files import copy_model_use_files
from plait.inference import generate, model_context
from plait.pipeline.stages_lm import StagesCausalLM
from plait.train.final_export import model_use_sources
from plait.train.report import plot_run, summary_table
from plait.train.run import Run

#: ``train.sample_prompt``'s default (a plain-text run's); a prompts run samples its own prompt instead
DEFAULT_SAMPLE_PROMPT = TrainSection().sample_prompt


def stopped_before(run: Run, what: str, step: int) -> bool:
    """Whether a stop signal ended the run or came after training ended (collective): then
    ``what``, slow end-of-run work, is skipped."""
    signals = run.signals
    if signals.stopped_by:
        return True
    signum = signals.requested()
    if signum:
        signals.stopped_by = signum
        if run.is_writer:
            print(f"stopped by signal {signum} after training ended at step {step}: {what} and the rest of "
                  f"the end-of-run outputs are skipped (the training checkpoints are in "
                  f"{run.state.resolved.save_dir}; run again with checkpoint.resume=auto to write them)", flush=True)
    return bool(signum)


def sample_text(run: Run, should_stop: Callable[[], bool] | None = None) -> str:
    """``train.sample_tokens`` tokens generated after ``train.sample_prompt`` (every rank takes
    part; ``should_stop``, a collective, may end it early). A sample that would run past the
    model's context is shortened to fit it, and the run says so."""
    st, t = run.state, run.state.recipe.train
    tokenizer = st.train_data.tokenizer()
    prompt = tokenizer.encode(t.sample_prompt).ids or [st.train_data.eos_id]
    if isinstance(st.val_data, PromptDataset) and len(st.val_data) and t.sample_prompt == DEFAULT_SAMPLE_PROMPT:
        prompt = st.val_data.ids(0)  # a prompts run answers its first evaluation prompt, in its chat template
    model = StagesCausalLM(st.stages, st.mesh)
    tokens = t.sample_tokens
    context = model_context(model)
    if context is not None and len(prompt) + tokens > context:
        tokens = max(context - len(prompt), 0)
        if run.is_writer:
            print(f"train.sample_tokens={t.sample_tokens}: the prompt is {len(prompt)} tokens and the model's context "
                  f"max_position_embeddings={context}, so the sample has {tokens} tokens", flush=True)
    with whole_sequences(st.stages):  # every cp rank generates from the whole prompt (no-op at cp=1)
        ids = generate(model, torch.tensor([prompt[-context:] if context else prompt]), tokens,
                       top_k=40, top_p=0.95, temperature=0.8, seed=st.recipe.run.seed, eos_id=st.train_data.eos_id,
                       should_stop=should_stop)
    return tokenizer.decode(ids[0].tolist())


def finish_run(run: Run, final: dict[str, Any]) -> None:
    """The final model (``checkpoint.save_final``), the sample (``train.sample_tokens=0``: none,
    and no ``sample.txt``), then on the writing rank the model-use files, plots and summary."""
    st = run.state
    r, resolved = st.recipe, st.resolved
    step = final.get("final_step", r.train.steps)
    if r.checkpoint.save_final and not stopped_before(run, "the final export", step):
        run.export.export(step)
    sample = None
    if r.train.sample_tokens > 0 and not stopped_before(run, "the sample", step):
        sample = sample_text(run, lambda: stopped_before(run, "the sample", step))
        if run.signals.stopped_by:  # cut short: no partial sample is written
            sample = None
    if not run.is_writer:
        return
    out = run.out
    # the tokenizer, chat template, special tokens and generation defaults travel with the model (the
    # final export wrote them into checkpoint.dir already; a run resumed from an older checkpoint gets them here)
    copy_model_use_files(out, *model_use_sources(st))
    if r.checkpoint.save_final and Path(resolved.checkpoint_dir).is_dir():
        copy_model_use_files(resolved.checkpoint_dir, *model_use_sources(st))
    metrics_file = out / "metrics.jsonl"
    if r.logging.plot and metrics_file.exists():
        plot_run(metrics_file, out / "loss.png")
    for plugin in st.plugins:
        plugin.write_outputs(out, final)
    summary = summary_table(metrics_file, st.start_step) if metrics_file.exists() else json.dumps(final, indent=1)
    for line in st.objective.summary_lines(final) + [s for p in st.plugins for s in p.summary_lines(final)]:
        summary += "\n" + line
    (out / "summary.txt").write_text(summary + "\n")
    print("\n" + summary, flush=True)
    if r.checkpoint.save_final:
        print(f"final {run.export.what}: {resolved.checkpoint_dir}", flush=True)
    if sample is not None:
        (out / "sample.txt").write_text(sample + "\n")
        print(f"\nsample ({r.train.sample_tokens} tokens after {r.train.sample_prompt!r}):\n{sample}\n", flush=True)
    print(f"outputs in {out}", flush=True)
