"""A checkpoint is never half-trusted: corruption, missing files, wrong models, planted pickles,
processes killed mid-write, and retention all behave (single process, small model)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch

from builders import build_llama
from plait.checkpoint.format import CheckpointError, read_manifest, step_dir_name
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.store import apply_retention, complete_checkpoints, latest_checkpoint, remove_incomplete
from plait.checkpoint.writer import CheckpointWriter
from plait.comm.primitives import GroupInfo
from plait.data_parallel import DistributedOptimizer, OptimizerHyper
from plait.mesh import ParallelMesh
from plait.models.llama.config import LlamaConfig
from plait.precision import policy_for

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
SOLO = GroupInfo(None, 0, 1)


def _setup(**config):
    mesh = ParallelMesh(1, 0, create_groups=False)
    model = build_llama(LlamaConfig(**{**CONFIG, **config}), mesh)
    opt = DistributedOptimizer([model], policy_for("fp32"), OptimizerHyper(1e-3, 0.1, (0.9, 0.95), 1e-8),
                               dp=SOLO, tp=SOLO)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    opt.grads.mark_final()
    model(ids, ids).backward()
    opt.grads.finish()
    opt.step()
    return mesh, model, opt


def _save(root: Path, step: int, mesh, model, opt, **kw) -> Path:
    writer = CheckpointWriter(root, rank=0, world=1, **kw)
    snap = writer.snapshot(step, [model], opt, mesh, {"train_step": step}, {"cpu": torch.get_rng_state()})
    return writer.write(snap)


@pytest.fixture()
def saved(tmp_path):
    mesh, model, opt = _setup()
    return _save(tmp_path, 1, mesh, model, opt), model


def test_round_trip_reads_every_tensor_back(saved):
    directory, model = saved
    with CheckpointReader(directory) as reader:
        for name, p in model.named_parameters():
            out = torch.empty_like(p)
            reader.read_into("model", name, out)
            assert torch.equal(out, p), name
            assert reader.has("exp_avg", name) and reader.has("exp_avg_sq", name)
    manifest = read_manifest(directory)
    assert manifest["complete"] is True and manifest["step"] == 1
    assert set(manifest["files"]) == {"rank-00000.safetensors"}


def test_flipped_byte_names_the_file_and_checksum(saved):
    directory, model = saved
    path = directory / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    name = next(iter(dict(model.named_parameters())))
    with CheckpointReader(directory) as reader, pytest.raises(CheckpointError) as err:
        reader.read_into("model", name, torch.empty_like(dict(model.named_parameters())[name]))
    assert "rank-00000.safetensors" in str(err.value) and "sha256" in str(err.value)


def test_manifest_referencing_a_missing_file(saved):
    directory, _ = saved
    (directory / "rank-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match="references rank-00000.safetensors, which is missing"):
        CheckpointReader(directory)


def test_model_mismatch_names_the_first_tensor_and_both_shapes(saved, tmp_path):
    directory, _ = saved
    _, other, _ = _setup(intermediate_size=96)
    expected = {n: tuple(p.shape) for n, p in other.named_parameters()}
    with CheckpointReader(directory) as reader, pytest.raises(CheckpointError) as err:
        reader.check_model(expected)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "[64, 32]" in msg and "[96, 32]" in msg


def _edit(directory: Path, change) -> None:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _first(manifest: dict) -> dict:
    return manifest["tensors"]["model/model.embed_tokens.weight"]


@pytest.mark.parametrize(("change", "needle"), [
    (lambda m: m.update(tensors=[1, 2]), "entry tensors: input should be a valid dictionary"),
    (lambda m: _first(m).update(shape="big"), "entry tensors.model/model.embed_tokens.weight.shape"),
    (lambda m: _first(m).update(dtype="int4"), "dtype"),
    (lambda m: _first(m)["slices"][0].update(start=-3), "slices.0.start"),
    (lambda m: _first(m)["slices"][0].update(dim=0, length=999), "lies outside the tensor's shape"),
    (lambda m: m["files"]["rank-00000.safetensors"].update(bytes="many"), "files.rank-00000.safetensors.bytes"),
], ids=["tensors-list", "shape-text", "dtype", "negative-start", "slice-outside", "file-bytes"])
def test_an_edited_manifest_is_refused_by_entry(saved, change, needle):
    directory, _ = saved
    _edit(directory, change)
    with pytest.raises(CheckpointError, match="the manifest was edited or damaged") as err:
        read_manifest(directory)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_manifest_shape_the_file_does_not_hold_is_named_when_read(saved):
    directory, model = saved
    _edit(directory, lambda m: _first(m).update(shape=[3, 32]))
    weight = dict(model.named_parameters())["model.embed_tokens.weight"]
    with CheckpointReader(directory) as reader, pytest.raises(CheckpointError) as err:
        reader.read_into("model", "model.embed_tokens.weight", torch.empty(3, 32))
    assert "has shape [64, 32], the manifest says [3, 32]" in str(err.value), str(err.value)
    assert weight.shape == (64, 32)


class _Payload:
    """Unpickling this would create the marker file: the proof that nothing was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("fix_checksum", [False, True])
def test_a_planted_pickle_is_rejected_without_being_executed(saved, tmp_path, monkeypatch, fix_checksum):
    directory, model = saved
    marker = tmp_path / "pwned"
    path = directory / "rank-00000.safetensors"
    path.write_bytes(pickle.dumps(_Payload(str(marker))))
    if fix_checksum:  # even with a manifest forged to match, the file is parsed as safetensors only
        from plait.checkpoint.format import sha256_of

        manifest = json.loads((directory / "manifest.json").read_text())
        manifest["files"]["rank-00000.safetensors"]["sha256"] = sha256_of(path)
        (directory / "manifest.json").write_text(json.dumps(manifest))
    forbidden = pytest.fail
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: forbidden("pickle.loads called"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: forbidden("pickle.load called"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: forbidden("torch.load called"))
    name, p = next(iter(model.named_parameters()))
    with CheckpointReader(directory) as reader, pytest.raises(CheckpointError) as err:
        reader.read_into("model", name, torch.empty_like(p))
    assert "rank-00000.safetensors" in str(err.value)
    assert ("not a readable safetensors file" if fix_checksum else "sha256") in str(err.value)
    assert not marker.exists()


def _write_then_hang(root: str, ready: str) -> None:
    """Child: commit step 1, then start step 2 and hang while writing (killed by the parent)."""
    import plait.checkpoint.writer as W

    mesh, model, opt = _setup()
    _save(Path(root), 1, mesh, model, opt)
    real = W.save_file

    def slow(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        Path(ready).write_text("x")
        time.sleep(600)

    W.save_file = slow
    _save(Path(root), 2, mesh, model, opt)


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint(tmp_path):
    ready = tmp_path / "ready"
    proc = mp.get_context("spawn").Process(target=_write_then_hang, args=(str(tmp_path / "ck"), str(ready)))
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and proc.is_alive(), "the writer never started step 2"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    root = tmp_path / "ck"
    assert (root / (step_dir_name(2) + ".tmp")).is_dir()
    assert latest_checkpoint(root) == root / step_dir_name(1)
    assert [s for s, _ in complete_checkpoints(root)] == [1]
    assert remove_incomplete(root) == [root / (step_dir_name(2) + ".tmp")]
    assert not (root / (step_dir_name(2) + ".tmp")).exists()
    with CheckpointReader(latest_checkpoint(root)) as reader:
        assert reader.step == 1


def test_newest_is_found_by_manifest_not_by_time(tmp_path):
    mesh, model, opt = _setup()
    for step in (5, 3):
        _save(tmp_path, step, mesh, model, opt, keep=10)
    os.utime(tmp_path / step_dir_name(3))  # newer on disk, older in steps
    assert latest_checkpoint(tmp_path) == tmp_path / step_dir_name(5)
    manifest = json.loads((tmp_path / step_dir_name(5) / "manifest.json").read_text())
    manifest["complete"] = False
    (tmp_path / step_dir_name(5) / "manifest.json").write_text(json.dumps(manifest))
    assert latest_checkpoint(tmp_path) == tmp_path / step_dir_name(3)


def test_retention_keeps_the_newest_and_every_kth(tmp_path):
    mesh, model, opt = _setup()
    for step in range(1, 8):
        _save(tmp_path, step, mesh, model, opt, keep=2, keep_every=3)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [3, 6, 7]
    assert apply_retention(tmp_path, keep=1) == [tmp_path / step_dir_name(3), tmp_path / step_dir_name(6)]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [7]  # never the last complete one
    assert apply_retention(tmp_path, keep=1) == []


def test_a_commit_never_removes_a_later_step_other_ranks_are_writing(tmp_path):
    """Other ranks run ahead of rank 0's commit: cleaning up after step 2 must leave step 3's
    directory alone (deleting it made rank 0 wait forever for a part that had been removed)."""
    mesh, model, opt = _setup()
    stale, ahead = tmp_path / (step_dir_name(1) + ".tmp"), tmp_path / (step_dir_name(3) + ".tmp")
    stale.mkdir(parents=True)
    ahead.mkdir()
    (ahead / "part-00001.json").write_text("{}")
    _save(tmp_path, 2, mesh, model, opt)
    assert not stale.exists() and (ahead / "part-00001.json").exists()
