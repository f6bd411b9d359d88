"""Prepared fine-tuning rows on disk: split by row, masks and packing kept, keyed reuse, refusals."""

from __future__ import annotations

import json

import pytest

from chat_task import task_with_tokenizer
from plait.data.errors import DataError
from plait.data.packing import IGNORE_INDEX
from plait.data.sft_prepare import RowDataset, RowsSettings, prepare_rows, rows_directory
from plait.data.tasks import write_task_files


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_with_tokenizer(tmp_path_factory.mktemp("task"), seed=1, train=60, heldout=10, vocab_size=300)


def test_task_files_are_deterministic_and_heldout_is_disjoint(tmp_path, task):
    _, paths = task
    again = write_task_files(tmp_path, seed=1, train=60, heldout=10)
    assert again["sft_train"].read_text() == paths["sft_train"].read_text()
    questions = {json.loads(line)["messages"][1]["content"] for line in paths["sft_train"].read_text().splitlines()}
    held = {json.loads(line)["messages"][1]["content"] for line in paths["sft_heldout"].read_text().splitlines()}
    assert len(questions) == 60 and len(held) == 10 and not questions & held
    pair = json.loads(paths["preference_train"].read_text().splitlines()[0])
    assert pair["chosen"] != pair["rejected"]


@pytest.mark.parametrize("packing", [True, False])
def test_sft_rows_keep_masks_and_count_targets(tmp_path, task, packing):
    root, paths = task
    settings = RowsSettings(kind="sft", seq_len=256, packing=packing, val_fraction=0.1)
    report = prepare_rows(paths["sft_train"], root / "tokenizer.json", settings, out_dir=tmp_path / "rows")
    assert not report.reused
    if not packing:
        assert report.rows["val"] == 6  # 10% of 60 rows held out, one sample per row
    data = RowDataset(report.directory, "train")
    batch = data.batch(list(range(len(data))))
    labels = batch["labels"]
    # every target is a token of an answer or the end marker: the question is never a target
    assert int((labels != IGNORE_INDEX).sum()) > 0
    assert data.targets(list(range(len(data)))) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    if packing:
        assert report.efficiency["train"] > 0.5
        assert int(batch["segment_ids"].max()) >= 1  # several samples share a row
    else:
        assert int(batch["segment_ids"].max()) == 0
    starts = batch["position_ids"] == 0
    assert bool((labels[starts] == IGNORE_INDEX).all())  # nothing predicts across a sample boundary
    again = prepare_rows(paths["sft_train"], root / "tokenizer.json", settings, out_dir=tmp_path / "rows")
    assert again.reused
    assert rows_directory(tmp_path / "rows") == tmp_path / "rows"


def test_preference_rows_keep_pairs_in_one_row(tmp_path, task):
    root, paths = task
    settings = RowsSettings(kind="preference", seq_len=512)
    report = prepare_rows(paths["preference_train"], root / "tokenizer.json", settings, out_dir=tmp_path / "pref")
    data = RowDataset(report.directory, "train")
    seg = data.batch(list(range(len(data))))["segment_ids"]
    for row in seg:
        ids = set(row[row >= 0].tolist())
        assert len(ids) % 2 == 0  # chosen 2k and rejected 2k+1 together


def test_refuses_a_foreign_directory_and_a_non_jsonl_source(tmp_path, task):
    root, paths = task
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    settings = RowsSettings(kind="sft", seq_len=64)
    with pytest.raises(DataError, match="does not replace what it did not write"):
        prepare_rows(paths["sft_train"], root / "tokenizer.json", settings, out_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(DataError, match="tokenizer.json:1: invalid JSON"):  # a .json file is read as rows
        prepare_rows(root / "tokenizer.json", root / "tokenizer.json", settings, out_dir=tmp_path / "x")
    with pytest.raises(DataError, match="suffix '.yaml' is not a row file"):
        (tmp_path / "rows.yaml").write_text("a: 1\n")
        prepare_rows(tmp_path / "rows.yaml", root / "tokenizer.json", settings, out_dir=tmp_path / "x")
    with pytest.raises(DataError, match="needs the model's tokenizer.json"):
        prepare_rows(paths["sft_train"], root / "missing.json", settings, out_dir=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_too_few_rows_is_an_error(tmp_path, task):
    root, paths = task
    one = tmp_path / "one.jsonl"
    one.write_text(paths["sft_train"].read_text().splitlines()[0] + "\n")
    with pytest.raises(DataError, match="at least 2 are needed"):
        prepare_rows(one, root / "tokenizer.json", RowsSettings(kind="sft", seq_len=64), out_dir=tmp_path / "y")
