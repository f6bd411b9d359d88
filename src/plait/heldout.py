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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from plait.data.chat_template import ChatTemplate, load_chat_template
from plait.data.errors import DataError
from plait.data.prompt_prepare import PromptRow, read_prompt_rows, render_prompt
from plait.data.sft_rows import PreferenceRow, SFTRow, read_preference_rows, read_sft_rows
from plait.data.sft_tokenize import plain_tokenizer, preference_pair
from plait.data.tokenizer import load_tokenizer_file
from plait.inference import StopRules, generate_tokens
from plait.lora import apply_lora, load_peft_adapter, read_peft_settings
from plait.lora.peft_io import BASE_SUBDIR
from plait.materialize import load_from_hf
from plait.mesh import single_process_mesh
from plait.models.family import config_of
from plait.models.packaged import model_directory
from plait.quantize import quantize_as_recorded

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class ExactMatch:
    total: int
    correct: int
    examples: list[tuple[str, str, str]]  # (question, reference, answer) of the first few rows
    #: rows whose prompt fills the model's context (scored as wrong: no room for an answer)
    too_long: int = 0
    #: rows whose answer budget the context cut below ``max_new_tokens``
    capped: int = 0

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
    adapter_config = read_adapter_config(path / ADAPTER_CONFIG)  # before the base model loads
    if base is None:
        found = adapter_config.get("base_model_name_or_path")
        if not isinstance(found, str) or not found:
            raise DataError(f"{path / ADAPTER_CONFIG} names no base model; give it with --base DIR")
        base = found
    base_path = model_directory(base)
    if not base_path.exists() and (path / BASE_SUBDIR / "config.json").is_file():
        base_path = path / BASE_SUBDIR  # the adapter directory was moved with the base written inside it
    if not (base_path / "config.json").is_file():
        raise DataError(f"the adapter's base model {str(base_path)!r} is not a Hugging Face directory (no "
                        f"config.json); give the base with --base DIR")
    return base_path


def read_adapter_config(path: Path) -> dict:
    """The JSON object of an adapter's ``adapter_config.json``, or a :class:`DataError` naming it."""
    try:
        loaded = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}); "
                        f"save the adapter again") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); save the "
                        f"adapter again") from None
    if not isinstance(loaded, dict):
        raise DataError(f"{path}: holds a JSON {type(loaded).__name__}, not the object of a PEFT adapter config")
    return loaded


def scoring_model_dir(directory: str | os.PathLike, base: str | os.PathLike | None = None, *,
                      need_tokenizer: bool = False) -> tuple[Path, Path | None, Path]:
    """``(model directory, base directory or None, tokenizer directory)`` of a scoring model,
    checked without loading anything: it exists and is a directory, it is not a run directory, an
    adapter's ``adapter_config.json`` reads and names a base that is a Hugging Face directory, and
    (with ``need_tokenizer``) the tokenizer the scores read is there. Each problem is a
    :class:`DataError` naming the path."""
    path = model_directory(directory)
    if not path.exists():
        raise DataError(f"{path}: no such directory; give a Hugging Face directory (config.json, *.safetensors, "
                        f"tokenizer.json), a packaged model's name or a LoRA adapter directory (adapter_config.json)")
    if not path.is_dir():
        raise DataError(f"{path} is a file, not a model directory; give a Hugging Face directory (config.json, "
                        f"*.safetensors, tokenizer.json) or a LoRA adapter directory (adapter_config.json)")
    if not (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file():
        final = path / "final"
        if (final / "config.json").is_file() or (final / ADAPTER_CONFIG).is_file():
            raise DataError(f"{path} is a run directory; its model is {final}: give that directory")
    base_path = adapter_base(path, base) if (path / ADAPTER_CONFIG).is_file() else None
    tokenizer_dir = path if base_path is None or (path / "tokenizer.json").is_file() else base_path
    if need_tokenizer and ((path / "config.json").is_file() or base_path is not None):
        if not (tokenizer_dir / "tokenizer.json").is_file():
            raise DataError(f"{tokenizer_dir} has no tokenizer.json; the scores need the model's tokenizer: copy "
                            f"it into {path}")
    return path, base_path, tokenizer_dir


def load_scoring_model(directory: str | os.PathLike, base: str | os.PathLike | None = None) -> tuple[nn.Module, Path]:
    """``(model, tokenizer directory)``: a Hugging Face model directory, or a PEFT adapter directory
    (``adapter_config.json``) loaded onto ``base`` (default: the adapter's ``base_model_name_or_path``)."""
    path, base_path, tokenizer_dir = scoring_model_dir(directory, base)
    if base_path is None:
        return load_from_hf(path, single_process_mesh()), path
    model = load_from_hf(base_path, single_process_mesh())
    apply_lora([model], read_peft_settings(path), seed=0)
    load_peft_adapter([model], path)
    quantize_as_recorded([model], path)  # a QLoRA adapter is scored on the base it was trained on
    return model, tokenizer_dir


def scoring_template(tokenizer_dir: Path, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template of the tokenizer directory; an unreadable template file is a
    :class:`DataError` naming it (compile errors already are)."""
    try:
        return load_chat_template(tokenizer_dir / "tokenizer.json", tokenizer)
    except (OSError, UnicodeDecodeError) as e:
        where = getattr(e, "filename", None) or tokenizer_dir / "chat_template.jinja"
        raise DataError(f"chat template {where} cannot be read as UTF-8 text ({' '.join(str(e).split())}); fix "
                        f"it, or remove it to use plait's default ChatML template") from None


def answer_stop_ids(tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """The ids that end an assistant answer under ``template`` (its end-of-turn and end-of-text tokens)."""
    ids = [tokenizer.token_to_id(t) for t in (template.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>")
           if t]
    return sorted({i for i in ids if i is not None})


def _prompt_and_answer(row: SFTRow | PromptRow, template: ChatTemplate) -> tuple[str, str, str]:
    """(rendered prompt, question text, reference answer) of an SFT row or a prompt row (GRPO's:
    its ``answer`` is the reference)."""
    if isinstance(row, PromptRow):
        users = [m.content for m in row.conversation or () if m.role == "user"]
        return render_prompt(row, template), users[-1] if users else row.prompt or "", row.answer
    if row.messages is not None:
        history, last = row.messages[:-1], row.messages[-1]
        prompt = template.render([m.as_dict() for m in history], add_generation_prompt=True, where=row.where)
        question = next((m.content for m in reversed(history) if m.role == "user"), "")
        return prompt, question, last.content
    assert row.prompt is not None and row.completion is not None
    return row.prompt, row.prompt, row.completion


@overload
def scoring_rows(kind: Literal["sft"], rows_file: str | os.PathLike, limit: int | None = None) -> list[SFTRow]: ...


@overload
def scoring_rows(kind: Literal["preference"], rows_file: str | os.PathLike,
                 limit: int | None = None) -> list[PreferenceRow]: ...


@overload
def scoring_rows(kind: Literal["prompts"], rows_file: str | os.PathLike,
                 limit: int | None = None) -> list[PromptRow]: ...


def scoring_rows(kind: Literal["sft", "preference", "prompts"], rows_file: str | os.PathLike,
                 limit: int | None = None) -> list[SFTRow] | list[PreferenceRow] | list[PromptRow]:
    """The first ``limit`` rows of ``rows_file`` (all when ``None``), read and checked before any
    model loads; a file without rows is a :class:`DataError` (a score of nothing means nothing).
    ``prompts``: GRPO's prompt rows, scored against their ``answer``."""
    rows: list[SFTRow] | list[PreferenceRow] | list[PromptRow]
    if kind == "prompts":
        rows = read_prompt_rows(rows_file)
    else:
        rows = read_sft_rows(rows_file)[0] if kind == "sft" else read_preference_rows(rows_file)[0]
    if not rows:
        raise DataError(f"{rows_file}: no rows to score (the file is empty or only blank lines); give a .jsonl of "
                        f"held-out {'SFT' if kind == 'sft' else kind} rows, e.g. from `plait data task`")
    return rows[:limit] if limit is not None else rows


def _rows(kind: Literal["sft", "preference"], rows: str | os.PathLike | Sequence, limit: int | None) -> list:
    if isinstance(rows, (str, os.PathLike)):
        return scoring_rows(kind, rows, limit)
    return list(rows)[:limit] if limit is not None else list(rows)


#: prompts decoded together by :func:`exact_match` (one batch of the decoding engine)
EVAL_BATCH = 32


@torch.no_grad()
def exact_match(model: nn.Module, tokenizer_dir: Path, rows_file: str | os.PathLike | Sequence[SFTRow | PromptRow], *,
                limit: int | None = None, max_new_tokens: int = 16, examples: int = 3,
                batch_size: int = EVAL_BATCH) -> ExactMatch:
    """Greedy answers to the SFT rows of ``rows_file`` (a path, or rows from :func:`scoring_rows`)
    against their last assistant turn.

    The rows are decoded ``batch_size`` at a time by the KV-cache engine, in order of prompt
    length (so a batch pads little); greedy tokens do not depend on the batch, so the score is
    the one row-by-row decoding gives. Each answer is capped at ``max_new_tokens`` and at what
    the model's context leaves after its prompt."""
    tokenizer = load_tokenizer_file(tokenizer_dir / "tokenizer.json")
    template = scoring_template(tokenizer_dir, tokenizer)
    rows: list[SFTRow | PromptRow] = _rows("sft", rows_file, limit)
    stop = answer_stop_ids(tokenizer, template)
    plain = plain_tokenizer(tokenizer)
    context = config_of(model).max_position_embeddings
    rendered = [_prompt_and_answer(row, template) for row in rows]
    prompts = [plain.encode(prompt, add_special_tokens=False).ids for prompt, _, _ in rendered]
    answers: list[list[int]] = [[] for _ in rows]
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    rules = StopRules(eos_ids=frozenset(stop))
    too_long = sum(len(p) >= context for p in prompts)
    capped = sum(0 < context - len(p) < max_new_tokens for p in prompts)
    for start in range(0, len(order), batch_size):
        batch = [i for i in order[start:start + batch_size] if context - len(prompts[i]) > 0]
        if not batch:
            continue
        budgets = [min(max_new_tokens, context - len(prompts[i])) for i in batch]
        for i, done in zip(batch, generate_tokens(model, [prompts[i] for i in batch], budgets, stop=rules),
                           strict=True):
            answers[i] = done.tokens
    correct, shown = 0, list[tuple[str, str, str]]()
    for (_, question, reference), tokens in zip(rendered, answers, strict=True):
        answer = plain.decode([t for t in tokens if t not in stop], skip_special_tokens=True).strip()
        correct += answer == reference.strip()
        if len(shown) < examples:
            shown.append((question, reference, answer))
    return ExactMatch(total=len(rows), correct=correct, examples=shown, too_long=too_long, capped=capped)


def _response_logprob(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum of log p(token t | tokens < t) over the tokens where ``mask`` is set."""
    logits = model(ids[None])[0].float()
    logp = F.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
    return float((logp * mask[1:].float()).sum())


@torch.no_grad()
def preference_accuracy(model: nn.Module, tokenizer_dir: Path,
                        rows_file: str | os.PathLike | Sequence[PreferenceRow], *,
                        limit: int | None = None) -> PreferenceAccuracy:
    """How often the chosen answer is more likely than the rejected one, after the same prompt
    (``rows_file``: a path, or rows from :func:`scoring_rows`)."""
    tokenizer = plain_tokenizer(load_tokenizer_file(tokenizer_dir / "tokenizer.json"))
    template = scoring_template(tokenizer_dir, tokenizer)
    rows: list[PreferenceRow] = _rows("preference", rows_file, limit)
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
