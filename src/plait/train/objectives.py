"""The training objectives as loop plug-ins: what the validation score is and what the interval adds.

``lm`` (plain text) and ``sft`` (prompt/completion rows) both train the next-token loss of the
output module; they differ in what a summary can compare against (plain text has a unigram
baseline, rows score their targets only). The preference objectives (``dpo``, ``ipo``, ``orpo``,
``simpo``) put a :class:`~plait.post_training.head.PreferenceHead` on the last stage (wired into
the runtime's hooks by :mod:`plait.train.preference`) and read their pair metrics from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.comm.primitives import GroupInfo
from plait.data.baseline import unigram_loss
from plait.data.mixture import MixtureDataset
from plait.pipeline.runtime import PipelineRuntime
from plait.post_training.head import PreferenceHead
from plait.train.evaluation import evaluate, evaluate_preference
from plait.train.plugins import Objective
from plait.train.run_state import Dataset


@dataclass(frozen=True)
class Validation:
    """What every objective's validation runs over: the same sequences under every layout
    (:mod:`plait.train.evaluation`)."""

    runtime: PipelineRuntime
    dataset: Dataset
    global_batch: int
    batches: int
    microbatches: int
    micro_batch_size: int
    dp: GroupInfo
    pp: GroupInfo

    def batch_plan(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "batches": self.batches, "microbatches": self.microbatches,
                "micro_batch_size": self.micro_batch_size, "dp": self.dp, "pp": self.pp}


class NextTokenObjective(Objective):
    """``lm`` and ``sft``: the validation loss and perplexity. ``baseline_of``: a prepared
    plain-text directory whose unigram loss the summary compares the run with (``None``: rows)."""

    def __init__(self, name: str, validation: Validation, baseline_of: Path | None = None,
                 vocab_size: int = 0) -> None:
        self.name, self.validation = name, validation
        self.baseline_of, self.vocab_size = baseline_of, vocab_size

    def evaluate(self) -> dict[str, float]:
        v = self.validation
        if isinstance(v.dataset, MixtureDataset):
            return self._evaluate_mixture(v.dataset)
        val = evaluate(v.runtime, v.dataset, **v.batch_plan())
        return {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}

    def _evaluate_mixture(self, mixture: MixtureDataset) -> dict[str, float]:
        """Each source's own validation split, scored as a plain one (``val_loss/<name>``); ``val_loss``
        is their mean weighted by the mixture's weights (what the blend trains towards)."""
        v = self.validation
        per_source = {name: evaluate(v.runtime, part, **v.batch_plan())
                      for name, part in zip(mixture.names, mixture.parts, strict=True)}
        val = sum(w * per_source[n] for n, w in zip(mixture.names, mixture.weights, strict=True))
        return {"val_loss": val, "val_perplexity": math.exp(min(val, 50.0)),
                **{f"val_loss/{name}": loss for name, loss in per_source.items()}}

    def summary_lines(self, final: dict[str, Any]) -> list[str]:
        if self.baseline_of is None:
            return []
        baseline = unigram_loss(self.baseline_of, self.vocab_size)
        line = f"unigram baseline val loss {baseline:.4f} (a model ignoring context)"
        if "val_loss" in final:
            line += f"; this run: {final['val_loss']:.4f}"
        return [line]


class PreferenceObjective(Objective):
    """``dpo``, ``ipo``, ``orpo``, ``simpo``: the head's pair metrics over the interval (pair
    weighted; the step losses stay in ``loss``) and its validation scores."""

    def __init__(self, name: str, head: PreferenceHead, validation: Validation) -> None:
        self.name, self.head, self.validation = name, head, validation

    def interval_metrics(self, step: int) -> dict[str, float]:
        v = self.validation
        pairs = self.head.read("train", v.pp, v.dp)
        pairs.pop("loss", None)
        return pairs

    def evaluate(self) -> dict[str, float]:
        v = self.validation
        return evaluate_preference(v.runtime, self.head, v.dataset, **v.batch_plan())
