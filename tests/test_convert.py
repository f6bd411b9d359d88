"""``plait convert``: plait checkpoint -> Hugging Face -> plait, bit for bit; transformers loads the result."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from plait.checkpoint.convert import hf_to_plait, plait_to_hf
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.store import latest_checkpoint
from trainer_runs import corpus_dir, run_checkpointed

ITEMS = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.vocab_size=320", "data.seq_len=32",
         "parallel.tp=2", "parallel.sequence_parallel=false", "data.micro_batch_size=4", "scheduler.warmup_steps=1",
         "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.async_save=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint written by a TP=2 run (so its tensors are stored as slices) after 2 steps."""
    corpus = corpus_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp("run")
    results = run_checkpointed(corpus, out, ITEMS + ["model.tie_word_embeddings=false"], 2, 2, save_at=2)
    return latest_checkpoint(out / "checkpoints"), results[0]["weights"]


def _model_tensors(directory) -> dict[str, torch.Tensor]:
    with CheckpointReader(directory) as reader:
        out = {}
        for key, info in reader.tensors.items():
            if key.startswith("model/"):
                t = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
                reader.read_into("model", key[len("model/"):], t)
                out[key[len("model/"):]] = t
        return out


def test_plait_to_hf_to_plait_is_bitwise(trained, tmp_path):
    ckpt, weights = trained
    hf = plait_to_hf(ckpt, tmp_path / "hf", progress=False)
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    back = hf_to_plait(hf, tmp_path / "plait", progress=False)
    original, round_trip = _model_tensors(ckpt), _model_tensors(back)
    assert set(original) == set(round_trip) == set(weights)
    for name, t in original.items():
        assert torch.equal(t, round_trip[name]), name
        assert torch.equal(t, weights[name]), name  # the checkpoint holds the trained weights
    files = sorted(p.name for p in hf.glob("*.safetensors"))
    assert len(files) > 1, "files are cut at the largest tensor, so memory stays near one tensor"
    with safe_open(str(hf / files[0]), framework="pt") as f:
        assert all(not k.startswith("model/") for k in f.keys())


def test_transformers_loads_the_converted_model_and_generates(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    ckpt, weights = trained
    hf = plait_to_hf(ckpt, tmp_path / "hf", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    model.eval()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
    ids = torch.tensor([[1, 5, 9, 11]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 9)


def test_cli_describe_and_errors(trained, tmp_path):
    ckpt, _ = trained
    run = [sys.executable, "-m", "plait.cli", "convert"]
    info = subprocess.run(run + [str(ckpt.parent), "--info"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and '"step": 2' in info.stdout
    bad = subprocess.run(run + [str(tmp_path), str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "neither a plait checkpoint nor a Hugging Face directory" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_manifest_whose_model_config_does_not_describe_its_tensors_is_refused(trained, tmp_path):
    import json
    import shutil

    from plait.checkpoint.convert import plait_to_hf
    from plait.checkpoint.format import CheckpointError

    ckpt, _ = trained
    edited = tmp_path / ckpt.name
    shutil.copytree(ckpt, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["model_config"]["hidden_size"] = 128
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model_config does not describe the checkpoint's tensors"):
        plait_to_hf(edited, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
