"""Tokenized SFT samples and preference pairs, with exactly the assistant's tokens marked for the loss.

How assistant tokens are found, for any chat template:

1. The conversation is rendered with each assistant turn's content replaced by a unique sentinel
   (private-use characters the data may not contain). The sentinels' positions in the text say where
   each assistant turn's content goes; the text trained on is that rendering with the contents put
   back verbatim, so character spans of the assistant contents are known exactly.
2. Each turn's end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, `` </s>``...) is what the template
   writes after the content when that turn ends the conversation, trailing whitespace removed, and
   kept only as far as the full rendering agrees. It belongs to the loss so that the model learns
   to stop. A template that writes nothing after an assistant turn gets the tokenizer's end-of-text
   token inserted there.
3. The text is tokenized once (no special tokens added: the template writes its own) and a token is
   loss-bearing when its character range (``tokenizers``' ``Encoding.offsets``) overlaps an answer,
   or lies within an answer and its end marker. Overlap for the answer, because byte-level BPE
   attaches the preceding space to a word: in ``"Assistant: Hi"`` the token ``" Hi"`` is the first
   one the model has to produce; containment for the marker, so that a marker cut inside a token
   does not pull in the next turn's opening token.

Limits: a template that transforms assistant content (``| trim``, dropping ``<think>`` sections of
earlier turns, escaping) is trained on the content as the row gives it, not as transformed; a
template that does not write the content through, or writes it twice, is refused with an error. A
token that straddles the start of a span (a merge of template text and content) is counted as
assistant. ``train_on_prompt=True`` marks every token.

Raw ``prompt``/``completion`` rows take no template: the text is ``prompt + completion + EOS`` with
the completion and EOS loss-bearing. Preference pairs are two samples, prompt+chosen and
prompt+rejected, with only the answer (and its end marker) loss-bearing.

Samples longer than ``seq_len`` are dropped, or cut from the left (the start of the prompt goes)
or the right (the end of the answer goes); all of it is counted, and a sample left without a
loss-bearing token is dropped and counted. A pair must fit in one row with both its samples (the
packer keeps them together), so its limit is the two lengths' sum; see :func:`fit_pair`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from tokenizers import Tokenizer

from plait.data.chat_template import ChatTemplate
from plait.data.errors import DataError
from plait.data.sft_rows import Message, PreferenceRow, SFTRow
from plait.data.tokenizer import find_eos

TRUNCATION_MODES = ("drop", "truncate_left", "truncate_right")
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"
_TRUNCATED = {"truncate_left": "truncated_left", "truncate_right": "truncated_right"}


@dataclass(frozen=True, eq=False)
class Sample:
    """One tokenized sequence: ``input_ids`` (int32) and ``loss_mask`` (bool), same length; ``where``
    is the row's ``file:line``. ``loss_mask[t]`` says token t is a target (the model learns to
    produce it from the tokens before it)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    where: str

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, eq=False)
class PreferencePair:
    """The two samples of a preference row: prompt+chosen and prompt+rejected."""

    chosen: Sample
    rejected: Sample

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass(frozen=True)
class Rendered:
    """Text to tokenize and its loss-bearing spans ``(start, answer_end, end)``, sorted: the answer is
    ``text[start:answer_end]`` and its end marker ``text[answer_end:end]``."""

    text: str
    spans: tuple[tuple[int, int, int], ...]


def _sentinel(i: int) -> str:
    return f"{_SENTINEL_OPEN}{i}{_SENTINEL_CLOSE}"


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):  # noqa: B905 -- the strings differ in length by design
        if x != y:
            break
        n += 1
    return a[:n]


def _end_marker(template: ChatTemplate, masked: list[dict[str, str]], i: int, full: str, after: int,
                where: str) -> str:
    """What the template writes after assistant turn ``i``'s content when the turn ends (see module doc)."""
    alone = full if i == len(masked) - 1 else template.render(masked[:i + 1], where=where)
    closing = alone[_locate(template, alone, i, where) + len(_sentinel(i)):].rstrip()
    marker = _common_prefix(closing, full[after:])
    if len(marker) < len(closing) and any(c.isspace() for c in marker):
        # The texts part inside what follows the marker (``<|im_end|>\n<|`` of ``<|endoftext|>`` and
        # ``<|im_start|>``): keep the marker up to the last whitespace before the parting.
        marker = marker[:max(k for k, c in enumerate(marker) if c.isspace())]
    return marker.rstrip()


def _locate(template: ChatTemplate, full: str, i: int, where: str) -> int:
    """Where assistant turn ``i``'s sentinel is in the rendering; it must be there exactly once."""
    found = full.count(_sentinel(i))
    if found != 1:
        raise DataError(f"{where}: the chat template from {template.source} writes assistant turn {i} {found} "
                        f"times instead of once, so its tokens cannot be found; use a template that writes each "
                        f"message's content once, unchanged")
    return full.index(_sentinel(i))


def _inserted_eos(template: ChatTemplate, where: str) -> str:
    """The end-of-text token, for a template that writes nothing after an assistant turn."""
    if not template.eos_token:
        raise DataError(f"{where}: the chat template from {template.source} ends an assistant turn with nothing "
                        f"and no end-of-text token is known; use a template with an end-of-turn marker")
    return template.eos_token


def render_conversation(template: ChatTemplate, messages: Sequence[Message], *, where: str,
                        loss_turns: Literal["all", "last"] = "all") -> Rendered:
    """The conversation's text and the spans of its assistant turns (content and end marker).

    ``loss_turns="last"`` keeps only the last assistant turn's span (preference answers)."""
    if any(_SENTINEL_OPEN in m.content for m in messages):
        raise DataError(f"{where}: the text holds the private-use character U+E000, which plait uses to find "
                        f"assistant turns; remove it from the row")
    masked = [{"role": m.role, "content": _sentinel(i) if m.role == "assistant" else m.content}
              for i, m in enumerate(messages)]
    full = template.render(masked, where=where)
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    pieces: list[str] = []
    spans: list[tuple[int, int, int]] = []
    length = cursor = 0
    for i in sorted(turns, key=lambda i: full.find(_sentinel(i))):
        at = _locate(template, full, i, where)
        after = at + len(_sentinel(i))
        marker = _end_marker(template, masked, i, full, after, where)
        # The marker follows in full[after:]; a template without one gets EOS inserted here.
        content = messages[i].content
        answer = content + ("" if marker else _inserted_eos(template, where))
        pieces += [full[cursor:at], answer]
        length += at - cursor
        spans.append((length, length + len(content), length + len(answer) + len(marker)))
        length += len(answer)
        cursor = after
    pieces.append(full[cursor:])
    if loss_turns == "last":
        spans = [max(spans)]
    return Rendered("".join(pieces), tuple(sorted(spans)))


def render_raw(prompt: str, completion: str, eos_token: str) -> Rendered:
    """``prompt + completion + EOS``, the completion and EOS loss-bearing (no template)."""
    text = prompt + completion + eos_token
    return Rendered(text, ((len(prompt), len(prompt) + len(completion), len(text)),))


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer without truncation or padding (a ``tokenizer.json`` may carry either, which would
    cut or pad conversations silently); a copy when it has them, so the caller's stays as it was."""
    if tokenizer.truncation is None and tokenizer.padding is None:
        return tokenizer
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def tokenize_rendered(tokenizer: Tokenizer, rendered: Rendered, *, where: str,
                      train_on_prompt: bool = False) -> Sample:
    """Token ids of the text and the mask of loss-bearing tokens: those overlapping an answer, and
    those lying within an answer and its end marker (a marker cut inside a token, as a common
    prefix can be, does not pull in the next turn's first token)."""
    encoding = tokenizer.encode(rendered.text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int32)
    if train_on_prompt:
        return Sample(ids, np.ones(len(ids), dtype=bool), where)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    real = ends > starts  # tokens added with no text (zero-width offsets) belong to no span
    for start, answer_end, end in rendered.spans:
        mask |= real & (starts < answer_end) & (ends > start)
        mask |= real & (starts >= start) & (ends <= end)
    return Sample(ids, mask, where)


def _cut(sample: Sample, keep: int, mode: str) -> Sample:
    """The sample cut to ``keep`` tokens: its end kept (truncate_left) or its start (truncate_right)."""
    part = slice(len(sample) - keep, None) if mode == "truncate_left" else slice(0, keep)
    return Sample(sample.input_ids[part], sample.loss_mask[part], sample.where)


def fit_sample(sample: Sample, seq_len: int, truncation: str, counts: Counter[str]) -> Sample | None:
    """The sample within ``seq_len`` under the truncation mode, or None (dropped); counted."""
    if len(sample) > seq_len:
        if truncation == "drop":
            counts["dropped_too_long"] += 1
            return None
        sample = _cut(sample, seq_len, truncation)
        counts[_TRUNCATED[truncation]] += 1
    if not sample.loss_mask.any():
        counts["dropped_no_loss_tokens"] += 1
        return None
    return sample


def fit_pair(pair: PreferencePair, seq_len: int, truncation: str, counts: Counter[str]) -> PreferencePair | None:
    """The pair with both samples together within ``seq_len``, or None (dropped); counted.

    The longer sample is shortened first, then both alike, until they fit together: from the start
    (truncate_left: the prompt goes first) or from the end (truncate_right: the answer's end goes)."""
    chosen, rejected = pair.chosen, pair.rejected
    excess = len(chosen) + len(rejected) - seq_len
    if excess > 0:
        if truncation == "drop":
            counts["dropped_too_long"] += 1
            return None
        keep_c, keep_r = _shrink_longer(len(chosen), len(rejected), seq_len)
        chosen, rejected = _cut(chosen, keep_c, truncation), _cut(rejected, keep_r, truncation)
        counts[_TRUNCATED[truncation]] += 1
    if not (chosen.loss_mask.any() and rejected.loss_mask.any()):
        counts["dropped_no_loss_tokens"] += 1
        return None
    return PreferencePair(chosen, rejected)


def _shrink_longer(a: int, b: int, total: int) -> tuple[int, int]:
    """Lengths ``<= (a, b)`` summing to ``total`` (``< a + b``), taken from the longer first."""
    low = min(a, b, total // 2)
    high = total - low
    return (high, low) if a >= b else (low, high)


def _check_mode(truncation: str, seq_len: int) -> None:
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"truncation {truncation!r} is not known; use one of {', '.join(TRUNCATION_MODES)}")
    if seq_len < 2:
        raise DataError(f"seq_len {seq_len} is too short for a sample; use at least 2")


def _none_left(kind: str, total: int, counts: Counter[str], seq_len: int) -> DataError:
    return DataError(f"all {total} {kind} were dropped ({describe_counts(counts)}); raise seq_len (now "
                     f"{seq_len}) or use truncation truncate_left/truncate_right")


def _eos_text(template: ChatTemplate, tokenizer: Tokenizer) -> str:
    return template.eos_token or find_eos(tokenizer)[0]


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token can stand for, bounded above by the UTF-8 length of the
    longest entry of the vocabulary (added tokens included): a text of ``n`` bytes then needs at
    least ``n / longest`` tokens, which tells a surely too long row without tokenizing it."""
    return max((len(token.encode("utf-8")) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def _surely_longer(texts: Sequence[str], seq_len: int, longest: int | None) -> bool:
    """Whether ``texts`` together need more than ``seq_len`` tokens, by their bytes alone."""
    return longest is not None and sum(len(t.encode("utf-8")) for t in texts) > seq_len * longest


def render_sft_row(row: SFTRow, tokenizer: Tokenizer, template: ChatTemplate) -> Rendered:
    """One row's text and answer spans (the template's rendering, or prompt + completion + EOS)."""
    if row.messages is not None:
        return render_conversation(template, row.messages, where=row.where)
    assert row.prompt is not None and row.completion is not None, "SFTRow holds messages or prompt+completion"
    return render_raw(row.prompt, row.completion, _eos_text(template, tokenizer))


def sft_sample(row: SFTRow, tokenizer: Tokenizer, template: ChatTemplate, *,
               train_on_prompt: bool = False) -> Sample:
    """One row tokenized, before any truncation."""
    return tokenize_rendered(tokenizer, render_sft_row(row, tokenizer, template), where=row.where,
                             train_on_prompt=train_on_prompt)


def render_preference_row(row: PreferenceRow, tokenizer: Tokenizer,
                          template: ChatTemplate) -> tuple[Rendered, Rendered]:
    """The chosen and the rejected conversation, rendered; the answer alone is loss-bearing."""
    def one(answer: str) -> Rendered:
        if row.conversation is not None:
            messages = (*row.conversation, Message("assistant", answer))
            return render_conversation(template, messages, where=row.where, loss_turns="last")
        assert row.prompt is not None, "PreferenceRow holds a conversation or a prompt"
        return render_raw(row.prompt, answer, _eos_text(template, tokenizer))
    return one(row.chosen), one(row.rejected)


def preference_pair(row: PreferenceRow, tokenizer: Tokenizer, template: ChatTemplate) -> PreferencePair:
    """One preference row as two samples, before any truncation; the answer alone is loss-bearing."""
    chosen, rejected = render_preference_row(row, tokenizer, template)
    return PreferencePair(tokenize_rendered(tokenizer, chosen, where=row.where),
                          tokenize_rendered(tokenizer, rejected, where=row.where))


def tokenize_sft(rows: Iterable[SFTRow], tokenizer: Tokenizer, template: ChatTemplate, *, seq_len: int,
                 truncation: str = "drop", train_on_prompt: bool = False) -> tuple[list[Sample], Counter[str]]:
    """Samples of the rows that fit ``seq_len`` (after truncation) and counts: ``samples`` kept,
    ``dropped_too_long``, ``truncated_left``/``truncated_right``, ``dropped_no_loss_tokens``."""
    _check_mode(truncation, seq_len)
    tokenizer = plain_tokenizer(tokenizer)
    # a row dropped anyway is not tokenized whole first (a long one would cost ~200 bytes a character)
    longest = longest_token_bytes(tokenizer) if truncation == "drop" else None
    samples: list[Sample] = []
    counts: Counter[str] = Counter()
    total = 0
    for row in rows:
        total += 1
        rendered = render_sft_row(row, tokenizer, template)
        if _surely_longer([rendered.text], seq_len, longest):
            counts["dropped_too_long"] += 1
            continue
        fitted = fit_sample(tokenize_rendered(tokenizer, rendered, where=row.where, train_on_prompt=train_on_prompt),
                            seq_len, truncation, counts)
        if fitted is not None:
            samples.append(fitted)
    counts["samples"] = len(samples)
    if total and not samples:
        raise _none_left("SFT samples", total, counts, seq_len)
    return samples, counts


def tokenize_preference(rows: Iterable[PreferenceRow], tokenizer: Tokenizer, template: ChatTemplate, *,
                        seq_len: int, truncation: str = "drop") -> tuple[list[PreferencePair], Counter[str]]:
    """Pairs whose two samples fit one row of ``seq_len`` together, and counts as for :func:`tokenize_sft`."""
    _check_mode(truncation, seq_len)
    tokenizer = plain_tokenizer(tokenizer)
    pairs: list[PreferencePair] = []
    counts: Counter[str] = Counter()
    total = 0
    longest = longest_token_bytes(tokenizer) if truncation == "drop" else None
    for row in rows:
        total += 1
        chosen, rejected = render_preference_row(row, tokenizer, template)
        if _surely_longer([chosen.text, rejected.text], seq_len, longest):
            counts["dropped_too_long"] += 1
            continue
        pair = PreferencePair(tokenize_rendered(tokenizer, chosen, where=row.where),
                              tokenize_rendered(tokenizer, rejected, where=row.where))
        fitted = fit_pair(pair, seq_len, truncation, counts)
        if fitted is not None:
            pairs.append(fitted)
    counts["pairs"] = len(pairs)
    if total and not pairs:
        raise _none_left("preference pairs", total, counts, seq_len)
    return pairs, counts


def describe_counts(counts: Counter[str]) -> str:
    """One line for the report, e.g. ``samples 98, dropped_too_long 2``."""
    return ", ".join(f"{key} {n}" for key, n in sorted(counts.items()) if n) or "nothing"

