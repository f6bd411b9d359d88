"""plait's Llama against transformers on the same Hugging Face checkpoint, at TP=1/2/4.

Why: the HF directory is the interchange format, so parity is checked *through* it: transformers
builds and saves a random model, plait loads the directory (each rank reading only its slices)
and must give the same logits; plait then saves from TP=2 and both libraries read that back.

Tolerance (all parity checks): max |diff| <= 1e-5 in fp32. The weights are bitwise identical;
what differs is only the order of floating-point sums (SDPA kernel vs transformers' attention,
GQA expansion, TP partial sums reduced over ranks), which perturbs O(1) logits of these tiny
2-layer models by ~1e-7..1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from builders import build_llama
from distributed import run_distributed
from model_weights import randomize
from plait.materialize import load_from_hf
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.hf_io import (
    CheckpointMismatchError,
    load_hf_config,
    load_hf_weights,
    save_hf_checkpoint,
)
from plait.models.llama.parallelize import kv_replication_for

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
BASE = dict(num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=128)
CONFIGS: dict[str, dict] = {
    # odd vocab: vocabulary padding at TP=2; tied embeddings (HF saves no lm_head.weight)
    "tied_mha": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=4, tie_word_embeddings=True),
    "untied_gqa_bias": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    # 4 heads / 1 KV head: KV replication at TP=2; explicit head_dim != hidden/heads; llama3 rope
    "mqa_llama3": dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    # 6 heads: head padding at TP=4
    "heads6": dict(vocab_size=99, hidden_size=48, intermediate_size=64, num_attention_heads=6,
                   num_key_value_heads=2, tie_word_embeddings=False),
}
QWEN2 = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=False, use_sliding_window=False)


def _make_hf(kind: str, cfg: dict, out: Path, seed: int, **save_kw) -> torch.nn.Module:
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE, **cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, **cfg))
    randomize(model, seed)
    model.eval()
    model.save_pretrained(out, **save_kw)
    return model


def _ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """``{name: (hf dir, input ids, transformers logits)}`` for every config."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    specs = [(n, "llama", c) for n, c in CONFIGS.items()] + [("qwen2", "qwen2", QWEN2)]
    for i, (name, kind, cfg) in enumerate(specs):
        # one checkpoint written sharded with an index, to cover that reader path
        kw = {"max_shard_size": "40KB"} if name == "untied_gqa_bias" else {}
        hf = _make_hf(kind, cfg, root / name, seed=i, **kw)
        ids = _ids(cfg["vocab_size"], seed=100 + i)
        with torch.no_grad():
            out[name] = (root / name, ids, hf(ids).logits)
    assert (root / "untied_gqa_bias" / "model.safetensors.index.json").is_file()
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@torch.no_grad()
def _plait_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_from_hf(path, single_process_mesh())(ids)


@pytest.mark.parametrize("name", list(CONFIGS) + ["qwen2"])
def test_tp1_matches_transformers(checkpoints, name):
    path, ids, ref = checkpoints[name]
    assert _max_diff(_plait_logits(path, ids), ref) <= TOL


def test_qwen2_config_maps_biases(checkpoints):
    c = load_hf_config(checkpoints["qwen2"][0])
    assert c.attention_bias and not c.o_proj_bias


def test_tied_checkpoint_that_also_stores_lm_head(checkpoints, tmp_path):
    """Some tied HF checkpoints keep an ``lm_head.weight`` copy; it must be accepted."""
    path, ids, ref = checkpoints["tied_mha"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _max_diff(_plait_logits(tmp_path, ids), ref) <= TOL


def test_tp1_save_overwrites_atomically(checkpoints, tmp_path):
    """Without torch.distributed the caller writes; a second save (allowed to replace) replaces the
    first, no temp left, and plait's ownership marker is the only extra file."""
    path, ids, ref = checkpoints["untied_gqa_bias"]
    model = load_from_hf(path, single_process_mesh())
    out = tmp_path / "ckpt"
    for _ in range(2):
        save_hf_checkpoint(model, out, single_process_mesh().info("tp"), replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out.iterdir()) == [".plait-output.json", "config.json", "model.safetensors"]
    assert "lm_head.weight" in load_file(out / "model.safetensors")  # untied: the head is kept
    assert _max_diff(_plait_logits(out, ids), ref) <= TOL


# ------------------------------------------------------------------------ multi-rank
def _tp_worker(rank: int, world: int, jobs: list[tuple]) -> dict[str, torch.Tensor]:
    """Load each checkpoint at TP=world, run it, optionally save it back (from all ranks)."""
    out = {}
    for name, path, ids, save_to, sp in jobs:
        config = load_hf_config(path)
        mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
        model = load_from_hf(path, mesh, sequence_parallel=sp)
        with torch.no_grad():
            out[name] = model(ids)
        if save_to is not None:
            save_hf_checkpoint(model, save_to, mesh.info("tp"), max_shard_bytes=30_000)
    return out


def _check_ranks(results: list[dict], checkpoints: dict, key_to_ckpt: dict[str, str]) -> None:
    for key, ckpt in key_to_ckpt.items():
        ref = checkpoints[ckpt][2]
        for rank, res in enumerate(results):
            diff = _max_diff(res[key], ref)
            assert diff <= TOL, f"{key} rank {rank}: max diff {diff}"


@torch.no_grad()
def _check_round_trip(saved: Path, path: Path, ids: torch.Tensor, ref: torch.Tensor) -> None:
    assert (saved / "model.safetensors.index.json").is_file()  # 30 kB shards force the index
    hf = transformers.LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert _max_diff(hf(ids).logits, ref) <= TOL
    assert _max_diff(_plait_logits(saved, ids), ref) <= TOL
    if load_hf_config(path).tie_word_embeddings:
        assert "lm_head.weight" not in json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]


def test_tp2_matches_transformers_and_round_trips(checkpoints, tmp_path):
    names = ["tied_mha", "untied_gqa_bias", "mqa_llama3", "qwen2"]
    saves = {"tied_mha": tmp_path / "tied_mha", "mqa_llama3": tmp_path / "mqa_llama3",
             "untied_gqa_bias": tmp_path / "untied_gqa_bias"}
    jobs = [(n, checkpoints[n][0], checkpoints[n][1], saves.get(n), False) for n in names]
    jobs.append(("mqa_llama3_sp", checkpoints["mqa_llama3"][0], checkpoints["mqa_llama3"][1], None, True))
    results = run_distributed(_tp_worker, 2, jobs)
    _check_ranks(results, checkpoints, {**{n: n for n in names}, "mqa_llama3_sp": "mqa_llama3"})
    for name, saved in saves.items():
        path, ids, ref = checkpoints[name]
        _check_round_trip(saved, path, ids, ref)


def test_tp4_head_padding_matches_transformers_and_round_trips(checkpoints, tmp_path):
    path, ids, ref = checkpoints["heads6"]
    results = run_distributed(_tp_worker, 4, [("heads6", path, ids, tmp_path / "heads6", False)])
    _check_ranks(results, checkpoints, {"heads6": "heads6"})
    _check_round_trip(tmp_path / "heads6", path, ids, ref)


# ------------------------------------------------------------------------ bad input
def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("*.safetensors*"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("change,tensor,found,expected,field", [
    ({"intermediate_size": 128}, "model.layers.0.mlp.gate_proj.weight", [96, 64], [128, 64], "intermediate_size"),
    ({"num_key_value_heads": 2}, "model.layers.0.self_attn.k_proj.weight", [64, 64], [32, 64], "num_key_value_heads"),
    ({"vocab_size": 100}, "model.embed_tokens.weight", [101, 64], [100, 64], "vocab_size"),
])
def test_shape_mismatch_names_tensor_shapes_and_field(checkpoints, tmp_path, change, tensor, found, expected, field):
    bad = _copy_with_config(checkpoints["tied_mha"][0], tmp_path / "bad", **change)
    with pytest.raises(CheckpointMismatchError) as err:
        load_from_hf(bad, single_process_mesh())
    msg = str(err.value)
    assert tensor in msg and str(found) in msg and str(expected) in msg and field in msg, msg


def test_mismatch_detected_before_any_data_is_read(checkpoints, tmp_path):
    """Only the last layer's down_proj is wrong; no parameter may have been written."""
    path = checkpoints["tied_mha"][0]
    bad = _copy_with_config(path, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    model = build_llama(load_hf_config(bad), single_process_mesh(), init=False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    with pytest.raises(CheckpointMismatchError, match=r"down_proj\.weight.*\[64, 95\].*\[64, 96\].*intermediate_size"):
        load_hf_weights(model, bad)
    assert all(p.isnan().all() for p in model.parameters())


def test_missing_tensors_are_named(checkpoints, tmp_path):
    bad = _copy_with_config(checkpoints["tied_mha"][0], tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.norm\.weight"):
        load_from_hf(bad, single_process_mesh())


@pytest.mark.parametrize("change,pattern", [
    ({"tie_word_embeddings": False}, r"lm_head\.weight.*tie_word_embeddings"),
    ({"num_hidden_layers": 3}, r"model\.layers\.2\..*num_hidden_layers"),
    ({"num_hidden_layers": 1}, r"model\.layers\.1\..*more layers than num_hidden_layers=1"),
    ({"attention_bias": True}, r"q_proj\.bias.*attention_bias"),
])
def test_config_that_disagrees_on_tensor_set(checkpoints, tmp_path, change, pattern):
    bad = _copy_with_config(checkpoints["tied_mha"][0], tmp_path / "bad", **change)
    with pytest.raises(CheckpointMismatchError, match=pattern):
        load_from_hf(bad, single_process_mesh())


def test_directory_without_config_or_weights(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_from_hf(tmp_path, single_process_mesh())
    (tmp_path / "config.json").write_text((checkpoints["tied_mha"][0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_from_hf(tmp_path, single_process_mesh())


def test_qwen2_style_saves_as_qwen2(checkpoints, tmp_path):
    """q/k/v biases without an output bias are written as a Qwen2 directory transformers loads."""
    path, ids, ref = checkpoints["qwen2"]
    model = load_from_hf(path, single_process_mesh())
    save_hf_checkpoint(model, tmp_path / "out", single_process_mesh().info("tp"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen2"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert _max_diff(hf(ids).logits, ref) <= TOL


def test_sliding_window_qwen2_is_rejected():
    from plait.models.errors import ModelConfigError
    from plait.models.llama.config import LlamaConfig

    with pytest.raises(ModelConfigError, match="use_sliding_window=true is not supported"):
        LlamaConfig.from_hf_dict({"model_type": "qwen2", "use_sliding_window": True, "vocab_size": 10,
                                  "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                  "num_attention_heads": 2})
