"""Dataset files as users keep them: Parquet, Arrow (save_to_disk), CSV, JSON and globs, with
columns of their own names (``data.fields``), tokenised into the same shards as JSONL, by any
number of worker processes; bad files are one line naming the file, the column and the columns."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from plait.config import check_recipe, load_recipe
from plait.config.load import DEFAULT_RECIPE
from plait.data.errors import DataError
from plait.data.prepare import prepare_dataset
from plait.data.sft_rows import read_preference_rows, read_sft_rows
from plait.data.token_shards import TokenShards
from plait.train.entry import prepare_data

TEXTS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + i)) for i in range(12)]


def _stream(path, split="train") -> np.ndarray:
    shards = TokenShards(path, split)
    return shards.read(0, shards.num_tokens)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """One BPE for every format, so equal texts give equal tokens."""
    root = tmp_path_factory.mktemp("tok")
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepared = prepare_dataset(root / "a.jsonl", vocab_size=300, progress=False, cache_dir=root / "cache")
    return prepared / "tokenizer.json"


def _prepare(source, tokenizer, tmp_path, **kw):
    return prepare_dataset(source, tokenizer=str(tokenizer), progress=False, cache_dir=tmp_path / "cache", **kw)


def test_every_format_gives_the_shards_of_jsonl(tmp_path, tokenizer):
    (tmp_path / "ref.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    reference = _prepare(tmp_path / "ref.jsonl", tokenizer, tmp_path)
    table = pa.table({"id": list(range(len(TEXTS))), "body": TEXTS})
    pq.write_table(table.slice(0, 5), tmp_path / "part-0.parquet", row_group_size=2)  # several record batches
    pq.write_table(table.slice(5), tmp_path / "part-1.parquet")
    pq.write_table(table, tmp_path / "all.parquet")
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "rows.csv").write_text("body,n\n" + "".join(f'"{t}",{i}\n' for i, t in enumerate(TEXTS)))
    (tmp_path / "rows.json").write_text(json.dumps([{"body": t} for t in TEXTS]))
    (tmp_path / "renamed.jsonl").write_text("".join(json.dumps({"body": t, "text": 5}) + "\n" for t in TEXTS))
    for source in ("all.parquet", "part-*.parquet", "saved", "rows.csv", "rows.json", "renamed.jsonl"):
        got = _prepare(str(tmp_path / source), tokenizer, tmp_path, fields={"text": "body"})
        for split in ("train", "val"):
            assert np.array_equal(_stream(got, split), _stream(reference, split)), (source, split)


def test_worker_processes_write_the_same_shards(tmp_path, tokenizer):
    docs = TEXTS * 30
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    one = _prepare(tmp_path / "big.jsonl", tokenizer, tmp_path, out_dir=tmp_path / "w1")
    two = _prepare(tmp_path / "big.jsonl", tokenizer, tmp_path, out_dir=tmp_path / "w2", workers=2)
    for split in ("train", "val"):
        assert np.array_equal(_stream(one, split), _stream(two, split))
    a, b = (json.loads((d / "index.json").read_text()) for d in (one, two))
    assert a["splits"] == b["splits"]


def test_bad_files_are_one_line_naming_file_and_columns(tmp_path, tokenizer):
    pq.write_table(pa.table({"body": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"body": ["a b c"], "id": [1]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"prompt": ["a"], "completion": ["b"]}), tmp_path / "sft.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    cases = {
        "empty.parquet": ("has no documents", {"text": "body"}),
        "numbers.parquet": ("column 'text' holds int64, not text", {}),
        "other.parquet": (r"other.parquet: no column 'text'; the file has columns \['body', 'id'\]", {}),
        "sft.parquet": ("its columns are sft rows: set data.format: sft", {}),
        "broken.parquet": ("broken.parquet: cannot be read as parquet", {}),
        "nothing-*.parquet": ("the pattern matches nothing", {}),
        "dict": (r"is a DatasetDict with the splits \['train'\]; name one of them", {}),
    }
    for name, (match, fields) in cases.items():
        with pytest.raises(DataError, match=match):
            _prepare(str(tmp_path / name), tokenizer, tmp_path, fields=fields)
    with pytest.raises(DataError, match=r"no 'body' \(data.fields.text\) field"):
        (tmp_path / "t.jsonl").write_text('{"text": "a"}\n')
        _prepare(tmp_path / "t.jsonl", tokenizer, tmp_path, fields={"text": "body"})
    # before launch: the recipe check names the field, the file and the fix
    with pytest.raises(ValueError, match="data.source: .*numbers.parquet.* holds int64, not text"):
        check_recipe(None, [f"data.source={tmp_path / 'numbers.parquet'}"])
    with pytest.raises(ValueError, match="data.source: .*data.format 'sft': .*numbers.parquet: no column 'messages'"):
        check_recipe(None, [f"data.source={tmp_path / 'numbers.parquet'}", "data.format=sft", "train.objective=sft",
                            f"data.tokenizer={tokenizer}"])
    with pytest.raises(ValueError, match="data.fields.*does not apply to the built-in corpus"):
        prepare_data(load_recipe(DEFAULT_RECIPE, ["data.fields={text: body}", f"data.cache_dir={tmp_path}"]))


def test_rows_from_parquet_with_renamed_columns(tmp_path):
    convo = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(3)]
    pq.write_table(pa.table({"conversation": convo, "extra": [1, 2, 3]}), tmp_path / "chat.parquet")
    rows, skipped = read_sft_rows(tmp_path / "chat.parquet", fields={"messages": "conversation"})
    assert [r.messages[1].content for r in rows] == ["a0", "a1", "a2"] and not skipped
    assert rows[2].where.endswith("chat.parquet:row 3")
    pq.write_table(pa.table({"q": ["p"], "good": ["x"], "bad": ["y"]}), tmp_path / "pref.parquet")
    rows, _ = read_preference_rows(str(tmp_path / "pref.parquet"),
                                   fields={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert (rows[0].prompt, rows[0].chosen, rows[0].rejected) == ("p", "x", "y")
    with pytest.raises(DataError, match=r"chat.parquet: no column 'messages'.*columns \['conversation', 'extra'\]"):
        read_sft_rows(tmp_path / "chat.parquet")
    pq.write_table(pa.table({"prompt": ["p", "q"], "completion": ["c", None]}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null.parquet:row 2: field 'completion': is missing"):
        read_sft_rows(tmp_path / "null.parquet")
