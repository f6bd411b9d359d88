"""Data at the edges: ids beyond the vocabulary, damaged or inconsistent prepared data, too little text,
a prepared directory as ``data.source``, and ``data.cache_dir``.

Every check goes through ``plait.train.entry.prepare_data``, the function ``plait train`` calls before
launch and on every rank, or through ``plait data prepare``; both must report the same ``DataError``.
"""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

from plait.config import load_recipe
from plait.data.checks import check_model_vocab, verify_prepared
from plait.data.errors import DataError
from plait.data.prepare import prepare_dataset
from plait.data.token_shards import INDEX_FILE, TokenDataset, load_index
from plait.train.entry import prepare_data

VOCAB = 300  # a tiny byte-level BPE: trains in well under a second


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own default cache, so a test of ``data.cache_dir`` can see it left untouched."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "default-cache"))
    return tmp_path / "default-cache"


def _doc(i: int) -> str:
    return "\n".join(f"Record {i}, line {j}: a small brown dog {i + j} runs home." for j in range(6 + i % 5))


def _jsonl(path, docs, extra: str | None = None):
    with path.open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")
        if extra is not None:
            fh.write(extra + "\n")
    return path


def _recipe(source, *items: str):
    return load_recipe(None, [f"data.source={source}", f"data.vocab_size={VOCAB}", "data.seq_len=16", *items])


@pytest.fixture
def prepared(tmp_path):
    """A freshly prepared dataset of twelve short documents, in its own directory."""
    return prepare_dataset(_jsonl(tmp_path / "docs.jsonl", [_doc(i) for i in range(12)]), vocab_size=VOCAB,
                           out_dir=tmp_path / "prepared", progress=False)


def _edit_index(directory, change) -> None:
    path = directory / INDEX_FILE
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))


def _put_token(directory, split: str, position: int, value: int) -> None:
    """Overwrites one token of a split's first shard in place (the shard keeps its size)."""
    path = directory / f"{split}-00000.bin"
    tokens = np.fromfile(path, dtype=np.dtype(load_index(directory)["dtype"]))
    tokens[position] = value
    tokens.tofile(path)


# ---------------------------------------------------------------------- item 4: ids beyond the vocabulary

def test_prepare_records_the_largest_token_id(prepared):
    index = load_index(prepared)
    for split in ("train", "val"):
        tokens = TokenDataset(prepared, split, 1).shards
        assert index["splits"][split]["max_token_id"] == int(tokens.read(0, len(tokens)).max())
    assert verify_prepared(prepared).max_token_id == {s: index["splits"][s]["max_token_id"] for s in ("train", "val")}


def test_out_of_range_ids_refused_at_load_with_the_numbers(prepared):
    """Shards holding an id above the index's vocabulary: an index without the recorded maximum (written
    before it existed) is scanned at load; a recorded maximum that the shards contradict is caught on the
    host before the batch leaves the loader. Either way the numbers are in the message."""
    _put_token(prepared, "train", 3, 5000)
    with pytest.raises(DataError, match=r"train sample 0 holds token id 5000 >= vocab_size 300"):
        TokenDataset(prepared, "train", 16).batch([0])
    _edit_index(prepared, lambda ix: [ix["splits"][s].pop("max_token_id") for s in ("train", "val")])
    with pytest.raises(DataError, match=r"index\.json: the train split's max token id 5000 >= vocab_size 300"):
        prepare_data(_recipe(prepared))


def test_model_vocab_check_names_the_numbers(prepared):
    data = verify_prepared(prepared)
    top = max(data.max_token_id.values())
    check_model_vocab(data, top + 1)  # largest id and tokenizer fit: no error
    with pytest.raises(DataError, match=f"max token id {top} >= model vocab_size {top}"):
        check_model_vocab(data, top)


def test_tokenizer_that_disagrees_with_the_index_is_refused(prepared, tmp_path):
    other = prepare_dataset(_jsonl(tmp_path / "other.jsonl", [_doc(i) * 3 for i in range(12)]), vocab_size=400,
                            out_dir=tmp_path / "other", progress=False)
    shutil.copyfile(other / "tokenizer.json", prepared / "tokenizer.json")
    n = load_index(other)["vocab_size"]
    with pytest.raises(DataError, match=rf"tokenizer\.json: the tokenizer has {n} tokens but .*vocab_size 300"):
        prepare_data(_recipe(prepared))


# ------------------------------------------------------------------ item 9: one error path, one line, the file

@pytest.mark.parametrize("case", ["malformed_jsonl", "empty_file"])
def test_bad_sources_are_data_errors_naming_the_file(tmp_path, case):
    if case == "malformed_jsonl":
        source, where = _jsonl(tmp_path / "bad.jsonl", [_doc(0)], extra="{not json"), r"bad\.jsonl:2: invalid JSON"
    else:
        source = tmp_path / "empty.txt"
        source.write_text("")
        where = r"empty\.txt has no documents"
    with pytest.raises(DataError, match=where):
        prepare_data(_recipe(source))


def test_damaged_prepared_data_is_refused_before_launch(tmp_path):
    """The cached directory of a source, damaged after it was written, is refused when it is reused."""
    recipe = _recipe(_jsonl(tmp_path / "docs.jsonl", [_doc(i) for i in range(12)]))
    prepared = prepare_data(recipe)
    shard = prepared / "train-00000.bin"
    intact = shard.read_bytes()
    shard.write_bytes(intact[:-6])  # truncated
    with pytest.raises(DataError, match=r"train-00000\.bin: expected \d+ uint16 tokens .* found \d+ bytes"):
        prepare_data(recipe)
    shard.write_bytes(intact)
    _edit_index(prepared, lambda ix: ix["splits"]["val"].update(tokens=ix["splits"]["val"]["tokens"] + 1))
    with pytest.raises(DataError, match=r"index\.json: the val shards listed hold \d+ tokens, splits\.val\.tokens"):
        prepare_data(recipe)
    _edit_index(prepared, lambda ix: ix.pop("dtype"))
    with pytest.raises(DataError, match=r"index\.json: dtype None is not one of uint16, uint32"):
        prepare_data(recipe)


def test_corpus_shorter_than_one_sample_is_refused_before_launch(tmp_path):
    source = _jsonl(tmp_path / "docs.jsonl", [_doc(i) for i in range(12)])
    val = load_index(prepare_data(_recipe(source)))["splits"]["val"]["tokens"]
    prepare_data(_recipe(source, f"data.seq_len={val}"))
    with pytest.raises(DataError, match=f"the val split has {val} tokens, fewer than one sample of "
                                        f"data.seq_len={val + 1}"):
        prepare_data(_recipe(source, f"data.seq_len={val + 1}"))


def test_plait_data_prepare_reports_a_damaged_reused_directory(tmp_path, prepared, capsys):
    from plait.commands import data

    parser = argparse.ArgumentParser(prog="plait")
    data.add_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["data", "prepare", str(tmp_path / "docs.jsonl"), "--vocab-size", str(VOCAB),
            "--out", str(prepared), "--no-progress"]
    assert data.run(parser.parse_args(argv)) == 0
    capsys.readouterr()
    (prepared / "val-00000.bin").write_bytes(b"\0")
    assert data.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait data prepare: ") and err.count("\n") == 1 and "val-00000.bin" in err


# ----------------------------------------------------------- item 12: a prepared source, and data.cache_dir

def test_prepared_directory_as_source_is_used_as_is(prepared, tmp_path):
    before = sorted(p.name for p in prepared.iterdir())
    assert prepare_data(_recipe(prepared)) == prepared
    assert prepare_data(_recipe(prepared, f"data.tokenizer={prepared / 'tokenizer.json'}")) == prepared
    assert sorted(p.name for p in prepared.iterdir()) == before
    other = prepare_dataset(_jsonl(tmp_path / "other.jsonl", [f"Other text {i}: zebras, quartz." for i in range(12)]),
                            vocab_size=VOCAB, out_dir=tmp_path / "other", progress=False)
    with pytest.raises(DataError, match="is not the tokenizer of the prepared dataset"):
        prepare_data(_recipe(prepared, f"data.tokenizer={other / 'tokenizer.json'}"))


def test_cache_dir_is_honoured(tmp_path, cache, capsys):
    source = _jsonl(tmp_path / "docs.jsonl", [_doc(i) for i in range(12)])
    mine = tmp_path / "my cache"
    path = prepare_data(_recipe(source, f"data.cache_dir={mine}"))
    assert path.parent == mine / "datasets" and (mine / "tokenizers").is_dir()
    assert not cache.exists()
    from plait.commands import data

    parser = argparse.ArgumentParser(prog="plait")
    data.add_parser(parser.add_subparsers(dest="command", required=True))
    argv = ["data", "prepare", str(source), "--vocab-size", str(VOCAB), "--cache-dir", str(mine), "--no-progress"]
    assert data.run(parser.parse_args(argv)) == 0  # the same inputs and cache: the directory plait train made
    assert "reused existing directory" in capsys.readouterr().out
    assert not cache.exists()


def test_prepared_source_is_not_held_to_the_bpe_vocab_rule(tmp_path):
    """model.vocab_size is compared with a prepared directory's own tokenizer before launch, not with
    data.vocab_size (the size of a BPE that is never trained for it)."""
    from plait.config import validate_recipe

    src = tmp_path / "docs.jsonl"
    _jsonl(src, [_doc(i) for i in range(60)])
    prepared = prepare_data(load_recipe(None, [f"data.source={src}", f"data.vocab_size={VOCAB}", "data.seq_len=16"]))
    data = {"data": {"source": str(prepared), "seq_len": 16}, "model": {"vocab_size": VOCAB},
            "parallel": {"tp": 1, "sequence_parallel": False}}
    validate_recipe(data, 1)  # data.vocab_size keeps its default 2048 > model.vocab_size
