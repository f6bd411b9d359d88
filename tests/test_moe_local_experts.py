"""Expert parallelism builds only the local experts: allocation, initialisation, Hugging Face import.

Under ``parallel.ep > 1`` the builder removes the other ranks' experts from the meta model, so a
rank must (a) hold exactly its experts, with bitwise the values one process gives them, (b) read
from a Hugging Face directory the bytes of its experts and the dense tensors only, with the values
a one-process load gives, and (c) allocate fewer parameters by exactly the other experts' share.

The fast tests build each rank of an EP mesh in this process (a mesh without process groups: the
build itself communicates nothing); the slow one does the same on two gloo ranks through
``build_stages`` (what the trainer calls) and also runs a forward of the built EP model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import plait.init
import plait.models.hf_io as hf_io
from distributed import run_distributed
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.models.mixtral import MixtralConfig
from plait.models.qwen3_moe import Qwen3MoeConfig
from plait.nn.moe import MoELayer

SEED = 5
E = 4  # experts per MoE layer


def _mixtral() -> MixtralConfig:
    return MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2,
                         max_position_embeddings=32, tie_word_embeddings=False)


def _qwen3_moe() -> Qwen3MoeConfig:  # a dense first layer: its MLP is no expert and every rank holds it
    return Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=24, moe_intermediate_size=8,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=E, num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=32,
                          tie_word_embeddings=True)


CONFIGS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe}


def _expert_of(name: str) -> int | None:
    """The global expert index of a parameter or checkpoint tensor name (``None``: not an expert)."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _local(rank: int, ep: int) -> set[int]:
    return set(range(rank * E // ep, (rank + 1) * E // ep))


def _ep_mesh(rank: int, ep: int, *, create_groups: bool = False) -> ParallelMesh:
    return ParallelMesh(ep, rank, dp=ep, ep=ep, create_groups=create_groups)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _check_rank_holds_its_experts(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                                  rank: int, ep: int) -> None:
    """Exactly the dense parameters and this rank's experts, each bitwise equal to one process's."""
    expected = {n for n in ref if _expert_of(n) is None or _expert_of(n) in _local(rank, ep)}
    assert set(params) == expected
    assert {_expert_of(n) for n in params} - {None} == _local(rank, ep)
    for name, value in params.items():
        assert value.device.type == "cpu"
        assert torch.equal(value, ref[name]), name


# ------------------------------------------------------------------- (a) fresh initialisation
@pytest.mark.parametrize("family", list(CONFIGS))
def test_each_ep_rank_initialises_only_its_experts_with_the_one_process_values(family, monkeypatch):
    config = CONFIGS[family]()
    ref = _params(build_model(config, single_process_mesh(), seed=SEED))
    initialised: list[str] = []
    real_fill = plait.init.fill_initial_

    def spy(out, name, *args):
        initialised.append(name)
        real_fill(out, name, *args)

    monkeypatch.setattr(plait.init, "fill_initial_", spy)
    for ep in (2, 4):
        for rank in range(ep):
            initialised.clear()
            model = build_model(config, _ep_mesh(rank, ep), seed=SEED)
            _check_rank_holds_its_experts(_params(model), ref, rank, ep)
            assert sorted(initialised) == sorted(_params(model)), "initialised exactly the held parameters"
            layers = [m for m in model.modules() if isinstance(m, MoELayer)]
            assert layers and all(m.experts.local_ids == sorted(_local(rank, ep)) for m in layers)
            assert all(m.num_experts == E for m in layers)  # routing still over every expert


def test_pipeline_stages_of_an_ep_rank_hold_only_its_experts():
    """PP=2 x EP=2: each stage of each rank holds its layers' dense parameters and its experts."""
    config = _mixtral()
    refs = [_params(stage) for pp_rank in range(2)
            for stage in build_stages(config, ParallelMesh(2, pp_rank, pp=2, create_groups=False), [[0], [1]],
                                      seed=SEED)]
    for rank in range(4):
        mesh = ParallelMesh(4, rank, pp=2, dp=2, ep=2, create_groups=False)
        (stage,) = build_stages(config, mesh, [[0], [1]], seed=SEED)
        _check_rank_holds_its_experts(_params(stage), refs[mesh.pp_rank], mesh.info("ep").rank, 2)


# ------------------------------------------------------------------- (c) parameter memory
def _expert_numel(config: Any) -> int:
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return 3 * config.hidden_size * width


@pytest.mark.parametrize("family", list(CONFIGS))
def test_an_ep_rank_allocates_fewer_parameters_by_the_other_experts_share(family):
    config = CONFIGS[family]()
    moe_layers = len(config.moe_layer_ids())
    full = sum(p.numel() for p in build_model(config, single_process_mesh(), seed=SEED).parameters())
    for ep in (2, 4):
        for rank in range(ep):
            built = sum(p.numel() for p in build_model(config, _ep_mesh(rank, ep), seed=SEED).parameters())
            assert built == full - moe_layers * (E - E // ep) * _expert_numel(config)
    dense = full - moe_layers * E * _expert_numel(config)
    assert dense > 0 and full > dense  # the expert share is a real part of the model (a sanity check)


# ------------------------------------------------------------------- (b) Hugging Face import
class _SpySlice:
    def __init__(self, inner: Any, name: str, read: list[str]) -> None:
        self.inner, self.name, self.read = inner, name, read

    def get_shape(self) -> Any:  # the header only: no tensor bytes
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.read.append(self.name)
        return self.inner[index]


class _SpyHandle:
    """A ``safe_open`` handle that records the tensors whose data is read."""

    def __init__(self, inner: Any, read: list[str]) -> None:
        self.inner, self.read = inner, read

    def __enter__(self) -> _SpyHandle:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> _SpySlice:
        return _SpySlice(self.inner.get_slice(name), name, self.read)

    def get_tensor(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self.inner.get_tensor(name)


def spy_safe_open(read: list[str]) -> Any:
    real = hf_io.safe_open

    def opened(*args: Any, **kwargs: Any) -> _SpyHandle:
        return _SpyHandle(real(*args, **kwargs), read)

    return opened


def _hf_dir(config: Any, path: Path) -> Path:
    """An EP=1 model saved in several safetensors files (experts spread over them)."""
    model = build_model(config, single_process_mesh(), seed=SEED + 1)
    save_hf_checkpoint(model, path, single_process_mesh().info("tp"), max_shard_bytes=8 * 1024)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def _check_reads(read: list[str], keys: set[str], rank: int, ep: int) -> None:
    """Every dense tensor and exactly this rank's experts' tensors read, each once."""
    assert len(read) == len(set(read)), "a tensor read twice"
    assert {_expert_of(k) for k in read} - {None} == _local(rank, ep)
    assert set(read) == {k for k in keys if _expert_of(k) is None or _expert_of(k) in _local(rank, ep)}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_hf_import_reads_only_the_local_experts_and_equals_the_one_process_load(family, tmp_path, monkeypatch):
    config = CONFIGS[family]()
    path = _hf_dir(config, tmp_path / "hf")
    read: list[str] = []
    monkeypatch.setattr(hf_io, "safe_open", spy_safe_open(read))
    ref = _params(build_model(config, single_process_mesh(), hf_path=path))
    keys = set(read)
    assert {_expert_of(k) for k in keys} - {None} == set(range(E))  # one process reads every expert
    for ep in (2, 4):
        for rank in range(ep):
            read.clear()
            model = build_model(config, _ep_mesh(rank, ep), hf_path=path)
            _check_reads(read, keys, rank, ep)
            _check_rank_holds_its_experts(_params(model), ref, rank, ep)


def test_hf_import_under_ep_still_checks_every_expert_against_the_config(tmp_path):
    """The other ranks' experts are not read, but a wrong shape among them still fails the build."""
    config = _mixtral()
    path = _hf_dir(config, tmp_path / "hf")
    wrong = dataclasses.replace(config, intermediate_size=8)
    with pytest.raises(hf_io.CheckpointMismatchError, match=r"layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight"):
        build_model(wrong, _ep_mesh(1, 2), hf_path=path)  # expert 0 is rank 0's


# ------------------------------------------------------------------- two gloo ranks
def _worker(rank: int, world: int, path: str) -> dict:
    mesh = _ep_mesh(rank, world, create_groups=True)
    config = _mixtral()
    fresh = build_stages(config, mesh, [[0, 1]], seed=SEED)
    numel = sum(p.numel() for p in fresh[0].parameters())
    read: list[str] = []
    hf_io.safe_open = spy_safe_open(read)  # this process only
    (loaded,) = build_stages(config, mesh, [[0, 1]], hf_path=path)
    ids = torch.randint(0, 64, (2, 1, 8), generator=torch.Generator().manual_seed(3))[rank]
    loss = loaded(ids, ids.shape[1], ids)  # the built stage exchanges tokens over the expert group by itself
    loss.backward()
    grads = {n: p.grad.clone() for n, p in loaded.named_parameters() if _expert_of(n) is not None}
    return {"fresh": _params(fresh[0]), "numel": numel, "read": read, "loaded": _params(loaded),
            "loss": loss.detach(), "expert_grads": grads}


@pytest.mark.slow  # two spawned processes: 5-15 s on the shared 2-core machine
def test_two_gloo_ep_ranks_build_and_import_only_their_experts(tmp_path, monkeypatch):
    config = _mixtral()
    path = _hf_dir(config, tmp_path / "hf")
    results = run_distributed(_worker, 2, str(path))
    fresh_ref = _params(build_model(config, single_process_mesh(), seed=SEED))
    full = sum(v.numel() for v in fresh_ref.values())
    read: list[str] = []
    monkeypatch.setattr(hf_io, "safe_open", spy_safe_open(read))
    model = build_model(config, single_process_mesh(), hf_path=path)
    keys = set(read)
    loaded_ref = _params(model)
    ids = torch.randint(0, 64, (2, 1, 8), generator=torch.Generator().manual_seed(3))
    losses = [model(ids[r], ids[r]) for r in range(2)]  # each rank's tokens are its own micro-batch
    sum(losses).backward()
    for rank, res in enumerate(results):
        _check_rank_holds_its_experts(res["fresh"], fresh_ref, rank, 2)
        assert res["numel"] == full - 2 * (E - E // 2) * _expert_numel(config)
        _check_reads(res["read"], keys, rank, 2)
        _check_rank_holds_its_experts(res["loaded"], loaded_ref, rank, 2)
        assert torch.allclose(res["loss"], losses[rank].detach(), rtol=1e-6, atol=1e-6)
        assert set(res["expert_grads"]) == {n for n in res["loaded"] if _expert_of(n) is not None}
        for name, grad in res["expert_grads"].items():
            assert torch.allclose(grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-6), name
