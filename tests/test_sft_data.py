"""SFT and preference data: rows, chat templates, assistant-token masks, truncation and packing."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.data.chat_template import DEFAULT_SOURCE, ChatTemplate, load_chat_template
from plait.data.errors import DataError
from plait.data.packing import IGNORE_INDEX, PAD_SEGMENT, pack
from plait.data.sft_rows import (
    Message,
    describe_skipped,
    parse_preference_row,
    parse_sft_row,
    read_preference_rows,
    read_sft_rows,
)
from plait.data.sft_tokenize import (
    PreferencePair,
    Sample,
    preference_pair,
    render_conversation,
    sft_sample,
    tokenize_preference,
    tokenize_sft,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}"
               "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
               "{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": "I am a small model."}, {"role": "user", "content": "What can you do?"},
        {"role": "assistant", "content": "Answer questions, briefly."}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A byte-level BPE with ChatML markers as added tokens; trained in milliseconds."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = " ".join(m["content"] for m in CHAT) + " the quick brown fox jumps over the lazy dog system user assistant"
    tokenizer.train_from_iterator([text] * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def chatml(tok: Tokenizer) -> ChatTemplate:
    return load_chat_template(None, tok)


def _runs(sample: Sample) -> list[np.ndarray]:
    """The token ids of each maximal run of loss-bearing tokens."""
    mask = sample.loss_mask.astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [sample.input_ids[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _decoded_runs(tok: Tokenizer, sample: Sample) -> list[str]:
    return [tok.decode(run.tolist(), skip_special_tokens=False) for run in _runs(sample)]


def _write(tmp_path, lines: list[object], name: str = "rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ masks

def test_multi_turn_mask_is_exactly_the_assistant_turns_and_end_markers(tok, chatml):
    row = parse_sft_row({"messages": CHAT}, "chat.jsonl:1")
    sample = sft_sample(row, tok, chatml)
    assert chatml.source == DEFAULT_SOURCE
    assert _decoded_runs(tok, sample) == ["I am a small model.<|im_end|>", "Answer questions, briefly.<|im_end|>"]
    # The whole sample decodes to the template's rendering of the real conversation.
    assert tok.decode(sample.input_ids.tolist(), skip_special_tokens=False) == chatml.render(CHAT)
    # Negative control: the prompt-side text is not marked.
    unmarked = tok.decode(sample.input_ids[~sample.loss_mask].tolist(), skip_special_tokens=False)
    assert "Hello, who are you?" in unmarked and "small model" not in unmarked
    assert sft_sample(row, tok, chatml, train_on_prompt=True).loss_mask.all()


def test_template_from_tokenizer_config_list_and_its_end_marker(tmp_path, tok):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": LLAMA3_LIKE}, {"name": "tool_use", "template": "x"}],
        "bos_token": {"content": "<s>"}, "eos_token": "<|endoftext|>"}))
    template = load_chat_template(tmp_path / "tokenizer.json", tok)
    assert "tokenizer_config.json" in template.source and template.bos_token == "<s>"
    sample = sft_sample(parse_sft_row({"messages": CHAT}, "w:1"), tok, template)
    assert _decoded_runs(tok, sample) == ["I am a small model.<|eot_id|>", "Answer questions, briefly.<|eot_id|>"]
    assert load_chat_template(tmp_path, tok, name="tool_use").text == "x"
    with pytest.raises(DataError, match=r"no template named 'nope' \(found \['default', 'tool_use'\]\)"):
        load_chat_template(tmp_path, tok, name="nope")


LLAMA2_LIKE = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
               "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
               "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
               "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate') }}{% endif %}"
               "{% if loop.index0 == 0 and system_message != false %}"
               "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
               "{% else %}{% set content = message['content'] %}{% endif %}"
               "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
               "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
               "{% endfor %}")


def test_llama2_style_template_marks_the_answer_and_eos(tok):
    template = ChatTemplate(LLAMA2_LIKE, "llama2", bos_token="<s>", eos_token="<|endoftext|>")
    sample = sft_sample(parse_sft_row({"messages": CHAT}, "l:1"), tok, template)
    # The template's space before the answer is in the answer's first token (" I"): that token is the
    # model's to produce, so it counts (overlap, not containment).
    assert _decoded_runs(tok, sample) == [" I am a small model. <|endoftext|>",
                                          " Answer questions, briefly. <|endoftext|>"]


def test_end_marker_is_where_the_middle_and_last_turn_agree(tok):
    """A template closing the conversation with EOS: the middle turn's marker stops at ``<|im_end|>``."""
    template = ChatTemplate(load_chat_template(None, tok).text + "{% if not add_generation_prompt %}"
                            "<|endoftext|>{% endif %}", "chatml+eos", eos_token="<|endoftext|>")
    sample = sft_sample(parse_sft_row({"messages": CHAT}, "e:1"), tok, template)
    assert _decoded_runs(tok, sample) == ["I am a small model.<|im_end|>",
                                          "Answer questions, briefly.<|im_end|>\n<|endoftext|>"]


def test_template_without_end_marker_gets_eos_and_generation_tag_renders(tok):
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
                            "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
                            "plain", eos_token="<|endoftext|>")
    rendered = render_conversation(template, [Message(**m) for m in CHAT], where="r:1")
    assert [rendered.text[a:b] for a, _, b in rendered.spans] == ["I am a small model.<|endoftext|>",
                                                               "Answer questions, briefly.<|endoftext|>"]


def test_tojson_keeps_non_ascii_text():
    template = ChatTemplate("{{ messages[0]['content'] | tojson }}", "j")
    assert template.render([{"role": "user", "content": "café <b>"}]) == '"café <b>"'


def test_raw_prompt_completion_marks_completion_and_eos(tok, chatml):
    sample = sft_sample(parse_sft_row({"prompt": "Q: the fox?\nA:", "completion": " jumps"}, "r:1"), tok, chatml)
    assert _decoded_runs(tok, sample) == [" jumps<|endoftext|>"]


def test_preference_pair_masks_only_the_answer(tok, chatml):
    row = parse_preference_row({"messages": CHAT[:4], "chosen": [{"role": "assistant", "content": "Answer."}],
                                "rejected": "Nothing at all."}, "p:1")
    pair = preference_pair(row, tok, chatml)
    assert _decoded_runs(tok, pair.chosen) == ["Answer.<|im_end|>"]  # the earlier assistant turn is prompt
    assert _decoded_runs(tok, pair.rejected) == ["Nothing at all.<|im_end|>"]
    shared = int(np.argmax(pair.chosen.loss_mask))
    assert np.array_equal(pair.chosen.input_ids[:shared], pair.rejected.input_ids[:shared])
    raw = preference_pair(parse_preference_row({"prompt": "Q:", "chosen": " yes", "rejected": " no"}, "p:2"),
                          tok, chatml)
    assert _decoded_runs(tok, raw.chosen) == [" yes<|endoftext|>"]


# ------------------------------------------------------------------------------------------ malformed rows

BAD_SFT = [
    ({"text": "hi"}, r"rows.jsonl:1: field 'prompt': is missing \(found keys \['text'\]\); give 'messages'"),
    ({"prompt": "hi"}, r"field 'completion': is missing"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     r"field 'messages\[1\].role': is 'user' where 'assistant' was expected; start with an optional system turn"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
     r"messages\[1\].role': is 'system' .*\(system is allowed only as the first turn\)"),
    ({"messages": [{"role": "user", "content": "a"}]}, r"the last turn must be 'assistant'; end the conversation"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     r"field 'messages\[1\].role': is 'bot'; use one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]},
     r"field 'messages\[1\].content': is an empty assistant turn; give the assistant text"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 7}]},
     r"field 'messages\[1\].content': is a int, expected a string"),
    ({"messages": "hello"}, r"field 'messages': is a str, expected a list of messages"),
    ({"messages": [{"role": "user"}]}, r"field 'messages\[0\].content': is missing"),
    ({"prompt": 3, "completion": "x"}, r"field 'prompt': is a int, expected a string; write prompt as a JSON string"),
    ({"messages": [], "prompt": "a", "completion": "b"}, r"is given together with prompt/completion; keep one form"),
    ([1, 2], r"rows.jsonl:1: the line is a JSON list, expected an object"),
    ('{"messages": [', r"rows.jsonl:1: invalid JSON \(Expecting value at column 15\); write one JSON object"),
]


@pytest.mark.parametrize("line, match", BAD_SFT)
def test_malformed_sft_row_names_file_line_field_and_fix(tmp_path, line, match):
    with pytest.raises(DataError, match=match):
        read_sft_rows(_write(tmp_path, [line]))


BAD_PREFERENCE = [
    ({"prompt": "q", "chosen": "same", "rejected": "same"},
     r"prefs.jsonl:1: field 'rejected': equals 'chosen'; give two different answers"),
    ({"prompt": "q", "chosen": "a"}, r"field 'rejected': is missing"),
    ({"chosen": "a", "rejected": "b"}, r"field 'prompt': is missing .*give 'prompt' \(a string\) or 'messages'"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     r"field 'chosen': has roles \['user'\], expected one assistant message"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "chosen": "x",
      "rejected": "y"}, r"the last turn must be 'user'"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, r"field 'chosen': is an empty answer"),
]


@pytest.mark.parametrize("line, match", BAD_PREFERENCE)
def test_malformed_preference_row(tmp_path, line, match):
    with pytest.raises(DataError, match=match):
        read_preference_rows(_write(tmp_path, [line], "prefs.jsonl"))


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2: byte 15 of the line \(b'\\xe9'\) is not UTF-8; re-encode"):
        read_sft_rows(path)


def test_skip_bad_rows_counts_each_reason(tmp_path):
    good = {"messages": CHAT}
    path = _write(tmp_path, [good, "{oops", "", {"prompt": "a"}, {"messages": [{"role": "user", "content": "a"}]},
                             {"prompt": "a", "completion": "b"}, {"messages": [{"role": "user", "content": "a"},
                                                                               {"role": "assistant", "content": ""}]}])
    with path.open("ab") as fh:
        fh.write(b"\xff\n")
    rows, skipped = read_sft_rows(path, skip_bad_rows=True)
    assert [r.where.rsplit(":", 1)[1] for r in rows] == ["1", "6"]  # the blank line 3 is not a row
    assert skipped == Counter(bad_json=1, missing_field=1, role_order=1, empty_assistant=1, bad_utf8=1)
    assert describe_skipped(skipped).startswith("skipped 5 rows: 1 bad_json (not a JSON object), 1 bad_utf8")
    prefs = _write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "a"}, {"prompt": "q", "chosen": "a",
                                                                                "rejected": "b"}], "p.jsonl")
    pref_rows, pref_skipped = read_preference_rows(prefs, skip_bad_rows=True)
    assert len(pref_rows) == 1 and pref_skipped == Counter(chosen_equals_rejected=1)


# ------------------------------------------------------------------------------------------ templates

def test_template_that_fails_to_render_names_source_and_row(tok):
    refusing = ChatTemplate("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
                            "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", "my_template.jinja")
    row = parse_sft_row({"messages": CHAT}, "chat.jsonl:4")
    with pytest.raises(DataError, match=r"chat.jsonl:4: the chat template from my_template.jinja failed to render "
                                        r"this conversation \(TemplateError: no system role\)"):
        sft_sample(row, tok, refusing)
    with pytest.raises(DataError, match=r"chat template from bad.jinja: cannot be compiled"):
        ChatTemplate("{% for m in messages %}", "bad.jinja")
    twice = ChatTemplate("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", "twice")
    with pytest.raises(DataError, match=r"writes assistant turn 2 2 times instead of once"):
        sft_sample(row, tok, twice)


def test_unreadable_tokenizer_config(tmp_path, tok):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer_config.json: cannot be read as JSON"):
        load_chat_template(tmp_path, tok)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(DataError, match=r"chat_template is a int; expected a string or a list"):
        load_chat_template(tmp_path, tok)


# ------------------------------------------------------------------------------------------ truncation

def _long_row() -> list:
    return [parse_sft_row({"messages": CHAT}, "long.jsonl:1")]


def test_too_long_sample_under_each_truncation_mode(tok, chatml):
    full = sft_sample(_long_row()[0], tok, chatml)
    seq_len = len(full) - 5
    with pytest.raises(DataError, match=r"all 1 SFT samples were dropped \(dropped_too_long 1\); raise seq_len "
                                        rf"\(now {seq_len}\) or use truncation"):
        tokenize_sft(_long_row(), tok, chatml, seq_len=seq_len, truncation="drop")
    left, counts = tokenize_sft(_long_row(), tok, chatml, seq_len=seq_len, truncation="truncate_left")
    assert counts == Counter(samples=1, truncated_left=1)
    assert np.array_equal(left[0].input_ids, full.input_ids[5:])
    right, counts = tokenize_sft(_long_row(), tok, chatml, seq_len=seq_len, truncation="truncate_right")
    assert counts == Counter(samples=1, truncated_right=1)
    assert np.array_equal(right[0].input_ids, full.input_ids[:seq_len])
    first_loss = int(np.argmax(full.loss_mask))
    with pytest.raises(DataError, match=r"dropped_no_loss_tokens 1"):  # only prompt left after the cut
        tokenize_sft(_long_row(), tok, chatml, seq_len=first_loss, truncation="truncate_right")
    with pytest.raises(DataError, match=r"truncation 'cut' is not known; use one of drop, truncate_left"):
        tokenize_sft(_long_row(), tok, chatml, seq_len=seq_len, truncation="cut")


def test_pair_truncation_fits_both_in_one_row(tok, chatml):
    rows = [parse_preference_row({"messages": CHAT[:4], "chosen": "A long answer, the quick brown fox.",
                                  "rejected": "No."}, "p:1")]
    whole = preference_pair(rows[0], tok, chatml)
    seq_len = len(whole) - 6
    _, counts = tokenize_preference(rows, tok, chatml, seq_len=len(whole))
    assert counts == Counter(pairs=1)
    for mode in ("truncate_left", "truncate_right"):
        (pair,), counts = tokenize_preference(rows, tok, chatml, seq_len=seq_len, truncation=mode)
        assert len(pair) == seq_len and counts[mode.replace("truncate", "truncated")] == 1
        assert len(pair.rejected) == len(whole.rejected)  # the longer one is cut first
    with pytest.raises(DataError, match=r"all 1 preference pairs were dropped"):
        tokenize_preference(rows, tok, chatml, seq_len=seq_len, truncation="drop")


# ------------------------------------------------------------------------------------------ packing

def _random_samples(rng: np.random.Generator, n: int, high: int) -> list[Sample]:
    out = []
    for i in range(n):
        length = int(rng.integers(1, high))
        out.append(Sample(rng.integers(3, 300, length).astype(np.int32), rng.random(length) < 0.6, f"s:{i}"))
    return out


def _check_rows(packed, units, seq_len: int, pad_id: int) -> None:
    assert packed.input_ids.shape == packed.labels.shape == packed.segment_ids.shape == (packed.num_rows, seq_len)
    seen = sorted(i for members in packed.members for i in members)
    assert seen == list(range(len(units)))  # every unit exactly once
    for r, members in enumerate(packed.members):
        parts = [p for i in members for p in ((units[i].chosen, units[i].rejected)
                                              if isinstance(units[i], PreferencePair) else (units[i],))]
        at = 0
        for segment, sample in enumerate(parts):
            n = len(sample)
            window = slice(at, at + n)
            assert np.array_equal(packed.input_ids[r, window], sample.input_ids)  # intact and contiguous
            assert (packed.segment_ids[r, window] == segment).all()
            assert np.array_equal(packed.position_ids[r, window], np.arange(n))  # positions restart
            assert packed.labels[r, at] == IGNORE_INDEX  # nothing predicts across a boundary
            expected = np.where(sample.loss_mask, sample.input_ids, IGNORE_INDEX)[1:]
            assert np.array_equal(packed.labels[r, at + 1:at + n], expected)
            at += n
        assert (packed.segment_ids[r, at:] == PAD_SEGMENT).all() and (packed.labels[r, at:] == IGNORE_INDEX).all()
        assert (packed.input_ids[r, at:] == pad_id).all()


def test_packing_invariants_and_determinism():
    rng = np.random.default_rng(0)
    seq_len = 64
    samples = _random_samples(rng, 200, seq_len + 1)
    packed = pack(samples, seq_len, pad_id=0)
    _check_rows(packed, samples, seq_len, 0)
    assert packed.real_tokens == sum(len(s) for s in samples)
    assert packed.efficiency == packed.real_tokens / (packed.num_rows * seq_len) > 0.9
    again = pack(samples, seq_len, pad_id=0)
    assert again.members == packed.members and np.array_equal(again.labels, packed.labels)
    unpacked = pack(samples, seq_len, pad_id=1, packed=False)
    _check_rows(unpacked, samples, seq_len, 1)
    assert unpacked.num_rows == len(samples) and unpacked.efficiency < packed.efficiency


def test_pairs_share_a_row_adjacent_chosen_first():
    rng = np.random.default_rng(1)
    seq_len = 80
    flat = _random_samples(rng, 120, seq_len // 2)
    pairs = [PreferencePair(flat[2 * i], flat[2 * i + 1]) for i in range(60)]
    packed = pack(pairs, seq_len, pad_id=0)
    _check_rows(packed, pairs, seq_len, 0)  # segments 2k/2k+1 are the chosen/rejected of the k-th member
    assert max(len(m) for m in packed.members) > 1
    _check_rows(pack(pairs, seq_len, pad_id=0, packed=False), pairs, seq_len, 0)


def test_pack_refuses_mixed_or_oversized_units():
    s = Sample(np.arange(5, dtype=np.int32), np.ones(5, dtype=bool), "a.jsonl:3")
    with pytest.raises(DataError, match=r"samples and preference pairs together"):
        pack([s, PreferencePair(s, s)], 16, pad_id=0)
    with pytest.raises(DataError, match=r"a.jsonl:3: a pair of 10 tokens does not fit a row of seq_len 8"):
        pack([PreferencePair(s, s)], 8, pad_id=0)


def test_packed_labels_give_the_masked_tokens_and_end_markers(tok, chatml):
    """End to end: SFT rows to rows; the labels, shifted as the loss does, name only assistant tokens."""
    rows = [parse_sft_row({"messages": CHAT}, f"c:{i}") for i in range(3)]
    one = len(sft_sample(rows[0], tok, chatml))
    samples, _ = tokenize_sft(rows, tok, chatml, seq_len=2 * one + 1)
    packed = pack(samples, 2 * one + 1, pad_id=tok.token_to_id("<|endoftext|>"))
    assert packed.num_rows == 2 and packed.members[0] == (0, 1)
    targets = packed.labels[0][packed.labels[0] != IGNORE_INDEX]
    assert tok.decode(targets.tolist(), skip_special_tokens=False) == (
        "I am a small model.<|im_end|>Answer questions, briefly.<|im_end|>" * 2)


class _CountingTokenizer:
    """The tokenizer, counting the characters it is asked to encode (a Rust object cannot be patched)."""

    truncation = None
    padding = None

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.encoded_chars = inner, 0

    def get_vocab(self, with_added_tokens: bool = True):
        return self.inner.get_vocab(with_added_tokens=with_added_tokens)

    def encode(self, text: str, add_special_tokens: bool = True):
        self.encoded_chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)


def test_a_row_surely_too_long_is_dropped_without_being_tokenized(tok, chatml):
    huge = parse_sft_row({"messages": [{"role": "user", "content": "fox " * 200_000},
                                       {"role": "assistant", "content": "ok"}]}, "big:1")
    small = parse_sft_row({"messages": CHAT}, "small:2")
    counting = _CountingTokenizer(tok)
    samples, counts = tokenize_sft([huge, small], counting, chatml, seq_len=64)
    assert counts["dropped_too_long"] == 1 and counts["samples"] == 1
    assert counting.encoded_chars < 1000, "the 800 kB row was tokenized"
    assert np.array_equal(samples[0].input_ids, sft_sample(small, tok, chatml).input_ids)
    pair = parse_preference_row({"messages": [{"role": "user", "content": "hi"}], "chosen": "fox " * 100_000,
                                 "rejected": "no"}, "big:3")
    counting = _CountingTokenizer(tok)
    with pytest.raises(DataError, match="all 1 preference pairs were dropped"):
        tokenize_preference([pair], counting, chatml, seq_len=64)
    assert counting.encoded_chars == 0
    # a row the byte bound cannot rule out is still tokenized and measured exactly
    counting = _CountingTokenizer(tok)
    with pytest.raises(DataError, match="dropped_too_long 1"):
        tokenize_sft([parse_sft_row({"messages": CHAT}, "c:1")], counting, chatml, seq_len=24)
    assert counting.encoded_chars > 0
