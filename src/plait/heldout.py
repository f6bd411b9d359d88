"""Held-out scores a person can read: exact match of generated answers and preference accuracy.

A validation loss says little about whether a fine-tuned model *answers* better. These scores do:

* **exact match** (SFT rows): the conversation up to its last assistant turn is rendered with the
  chat template and a generation prompt, the model answers greedily until its end-of-turn token,
  and the answer counts when it equals the reference after stripping whitespace;
* **preference accuracy** (preference rows): the summed log-probability of the chosen answer's
  tokens is compared with the rejected one's, each after the same prompt; the mean margin
  (chosen minus rejected, in nats) is reported too.

Both run in one process on a full model (``load_scoring_model`` reads a Hugging Face directory, or
a PEFT adapter directory onto its base model).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from plait.data.chat_template import ChatTemplate, load_chat_template
from plait.data.errors import DataError
from plait.data.sft_rows import PreferenceRow, SFTRow, read_preference_rows, read_sft_rows
from plait.data.sft_tokenize import plain_tokenizer, preference_pair
from plait.data.tokenizer import load_tokenizer_file
from plait.generate import generate
from plait.lora import apply_lora, load_peft_adapter, read_peft_settings
from plait.materialize import load_from_hf
from plait.mesh import single_process_mesh
from plait.models.packaged import model_directory

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class ExactMatch:
    total: int
    correct: int
    examples: list[tuple[str, str, str]]  # (question, reference, answer) of the first few rows

    @property
    def score(self) -> float:
        return self.correct / self.total if self.total else 0.0


@dataclass(frozen=True)
class PreferenceAccuracy:
    total: int
    correct: int
    mean_margin: float

    @property
    def score(self) -> float:
        return self.correct / self.total if self.total else 0.0


def adapter_base(adapter: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """The Hugging Face directory an adapter applies to: ``base``, else the adapter's
    ``base_model_name_or_path`` (a packaged model's name resolves to its cached directory)."""
    path = Path(adapter)
    if base is None:
        found = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
        if not found:
            raise DataError(f"{path / ADAPTER_CONFIG} names no base model; give it with --base DIR")
        base = found
    base_path = model_directory(base)
    if not (base_path / "config.json").is_file():
        raise DataError(f"the adapter's base model {str(base_path)!r} is not a Hugging Face directory (no "
                        f"config.json); give the base with --base DIR")
    return base_path


def load_scoring_model(directory: str | os.PathLike, base: str | os.PathLike | None = None) -> tuple[nn.Module, Path]:
    """``(model, tokenizer directory)``: a Hugging Face model directory, or a PEFT adapter directory
    (``adapter_config.json``) loaded onto ``base`` (default: the adapter's ``base_model_name_or_path``)."""
    path = model_directory(directory)
    if not (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file():
        final = path / "final"
        if (final / "config.json").is_file() or (final / ADAPTER_CONFIG).is_file():
            raise DataError(f"{path} is a run directory; its model is {final}: give that directory")
    if not (path / ADAPTER_CONFIG).is_file():
        return load_from_hf(path, single_process_mesh()), path
    base_path = adapter_base(path, base)
    model = load_from_hf(base_path, single_process_mesh())
    apply_lora([model], read_peft_settings(path), seed=0)
    load_peft_adapter([model], path)
    tokenizer_dir = path if (path / "tokenizer.json").is_file() else base_path
    return model, tokenizer_dir


def _stop_ids(tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    ids = [tokenizer.token_to_id(t) for t in (template.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
           if t]
    return sorted({i for i in ids if i is not None})


def _prompt_and_answer(row: SFTRow, template: ChatTemplate) -> tuple[str, str, str]:
    """(rendered prompt, question text, reference answer) of an SFT row."""
    if row.messages is not None:
        history, last = row.messages[:-1], row.messages[-1]
        prompt = template.render([m.as_dict() for m in history], add_generation_prompt=True, where=row.where)
        question = next((m.content for m in reversed(history) if m.role == "user"), "")
        return prompt, question, last.content
    assert row.prompt is not None and row.completion is not None
    return row.prompt, row.prompt, row.completion


@torch.no_grad()
def exact_match(model: nn.Module, tokenizer_dir: Path, rows_file: str | os.PathLike, *, limit: int | None = None,
                max_new_tokens: int = 16, examples: int = 3) -> ExactMatch:
    """Greedy answers to the SFT rows of ``rows_file`` against their last assistant turn."""
    tokenizer = load_tokenizer_file(tokenizer_dir / "tokenizer.json")
    template = load_chat_template(tokenizer_dir / "tokenizer.json", tokenizer)
    rows, _ = read_sft_rows(rows_file)
    rows = rows[:limit] if limit is not None else rows
    stop = _stop_ids(tokenizer, template)
    plain = plain_tokenizer(tokenizer)
    correct, shown = 0, list[tuple[str, str, str]]()
    for row in rows:
        prompt, question, reference = _prompt_and_answer(row, template)
        ids = torch.tensor([plain.encode(prompt, add_special_tokens=False).ids])
        out = generate(model, ids, max_new_tokens, greedy=True, eos_id=stop)
        new = [t for t in out[0, ids.shape[1]:].tolist() if t not in stop]
        answer = plain.decode(new, skip_special_tokens=True).strip()
        correct += answer == reference.strip()
        if len(shown) < examples:
            shown.append((question, reference, answer))
    return ExactMatch(total=len(rows), correct=correct, examples=shown)


def _response_logprob(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum of log p(token t | tokens < t) over the tokens where ``mask`` is set."""
    logits = model(ids[None])[0].float()
    logp = F.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
    return float((logp * mask[1:].float()).sum())


@torch.no_grad()
def preference_accuracy(model: nn.Module, tokenizer_dir: Path, rows_file: str | os.PathLike, *,
                        limit: int | None = None) -> PreferenceAccuracy:
    """How often the chosen answer is more likely than the rejected one, after the same prompt."""
    tokenizer = plain_tokenizer(load_tokenizer_file(tokenizer_dir / "tokenizer.json"))
    template = load_chat_template(tokenizer_dir / "tokenizer.json", tokenizer)
    rows: list[PreferenceRow] = read_preference_rows(rows_file)[0]
    rows = rows[:limit] if limit is not None else rows
    model.eval()
    correct, margins = 0, []
    for row in rows:
        pair = preference_pair(row, tokenizer, template)
        scores = [_response_logprob(model, torch.from_numpy(s.input_ids.astype("int64")),
                                    torch.from_numpy(s.loss_mask)) for s in (pair.chosen, pair.rejected)]
        margins.append(scores[0] - scores[1])
        correct += scores[0] > scores[1]
    return PreferenceAccuracy(total=len(rows), correct=correct,
                              mean_margin=sum(margins) / len(margins) if margins else 0.0)
