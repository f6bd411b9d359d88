"""Mixtral and Qwen3-MoE against transformers, through Hugging Face directories.

transformers builds, randomises and saves a tiny model; plait reads the directory and must give
the same logits and next-token loss (fp32, max |diff| <= 1e-5: the weights are bitwise the same,
only the order of sums differs), the same load-balancing loss per layer as transformers'
``load_balancing_loss_func``, and, for one layer (where transformers' pooled-over-layers aux loss
is the per-layer one), the same gradients of ``loss + coef * aux`` in every parameter. plait's
save must write back the same tensors bitwise and a config transformers reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_weights import randomize
from plait.materialize import build_model, build_stages, load_from_hf
from plait.mesh import single_process_mesh
from plait.models.errors import ModelConfigError
from plait.models.hf_io import load_hf_config, save_hf_checkpoint
from plait.models.mixtral import MixtralConfig
from plait.models.qwen3_moe import Qwen3MoeConfig
from plait.nn.moe import MoELayer, MoEStats

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

TOL = 1e-5
SEQ = 12
BASE = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral": ("mixtral", dict(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "mixtral_1layer_window": ("mixtral", dict(vocab_size=61, hidden_size=32, intermediate_size=16,
                                              num_hidden_layers=1, num_local_experts=5, num_experts_per_tok=2,
                                              sliding_window=5, tie_word_embeddings=True)),
    # a dense first layer, no renormalisation, top-3 of 6, explicit head_dim
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=67, hidden_size=32, intermediate_size=24, moe_intermediate_size=8,
                                    num_hidden_layers=3, num_experts=6, num_experts_per_tok=3, head_dim=16,
                                    mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False)),
    "qwen3_moe_norm": ("qwen3_moe", dict(vocab_size=67, hidden_size=32, intermediate_size=24,
                                         moe_intermediate_size=8, num_hidden_layers=2, num_experts=4,
                                         num_experts_per_tok=2, head_dim=8, norm_topk_prob=True,
                                         tie_word_embeddings=True)),
}


def _hf_model(kind: str, cfg: dict) -> torch.nn.Module:
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**BASE, **cfg))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**BASE, **cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, object, torch.nn.Module]]:
    """``{name: (hf dir, input ids, transformers output with router logits, transformers model)}``."""
    root = tmp_path_factory.mktemp("moe_families")
    out = {}
    for i, (name, (kind, cfg)) in enumerate(CONFIGS.items()):
        model = _hf_model(kind, cfg)
        randomize(model, seed=i)
        model.eval().save_pretrained(root / name)
        ids = torch.randint(0, cfg["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(100 + i))
        with torch.no_grad():
            out[name] = (root / name, ids, model(ids, labels=ids, output_router_logits=True), model)
    return out


def _moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_registry_reads_both_model_types(checkpoints):
    assert isinstance(load_hf_config(checkpoints["mixtral"][0]), MixtralConfig)
    config = load_hf_config(checkpoints["qwen3_moe"][0])  # transformers 5 wrote num_local_experts
    assert isinstance(config, Qwen3MoeConfig) and config.num_experts == 6 and config.moe_layer_ids() == [1, 2]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_aux_loss_match_transformers(checkpoints, name):
    path, ids, ref, _ = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    layers = _moe_layers(model)
    assert len(layers) == len(ref.router_logits)
    with torch.no_grad():
        assert _max_diff(model(ids), ref.logits) <= TOL
        coef = load_hf_config(path).router_aux_loss_coef
        ce = ref.loss - coef * ref.aux_loss
        assert abs(model(ids, ids).item() - ce.item()) <= TOL
        for layer in layers:
            layer.stats = MoEStats.zeros(layer.num_experts, torch.device("cpu"))
        model.train()  # stats are kept for training forwards; no dropout in these configs
        model(ids, ids)
    ours = torch.stack([layer.stats.aux for layer in layers])
    k = load_hf_config(path).num_experts_per_tok
    theirs = torch.stack([load_balancing_loss_func((logits,), layer.num_experts, k)
                          for logits, layer in zip(ref.router_logits, layers, strict=True)])
    assert _max_diff(ours, theirs) <= 1e-6
    if len(layers) == 1:  # transformers pools its aux loss over layers: the same for one layer
        assert abs(ours[0].item() - ref.aux_loss.item()) <= 1e-6


def _hf_grad(hf: torch.nn.Module, name: str) -> torch.Tensor:
    """The gradient of plait's ``name`` from transformers' fused expert tensors."""
    params = dict(hf.named_parameters())
    if ".experts." not in name:
        key = name.replace("block_sparse_moe", "mlp")
        return params[key].grad if key in params else params["model.embed_tokens.weight"].grad
    prefix, rest = name.split(".experts.")
    prefix = prefix.replace("block_sparse_moe", "mlp")
    e, proj = int(rest.split(".")[0]), rest.split(".")[1]
    gate_up, down = params[f"{prefix}.experts.gate_up_proj"].grad, params[f"{prefix}.experts.down_proj"].grad
    half = gate_up.shape[1] // 2
    return {"w1": gate_up[e, :half], "w3": gate_up[e, half:], "w2": down[e]}[proj]


def test_one_layer_gradients_of_loss_plus_aux_match_transformers(checkpoints):
    """The aux loss reaches the router through the layer's backward (not through the returned
    loss) exactly as transformers' ``loss + coef * aux`` does, in every parameter."""
    path, ids, _, hf = checkpoints["mixtral_1layer_window"]
    coef = 0.25  # large, so a missing or mis-scaled aux gradient would show
    hf.config.router_aux_loss_coef = coef
    hf.router_aux_loss_coef = coef
    hf.train()
    hf.zero_grad()
    hf(ids, labels=ids, output_router_logits=True).loss.backward()
    model = load_from_hf(path, single_process_mesh()).train()
    (layer,) = _moe_layers(model)
    layer.aux_loss_scale = coef
    model(ids, ids).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["model.layers.0.block_sparse_moe.gate.weight"].abs().sum() > 0
    for name, g in grads.items():
        assert _max_diff(g, _hf_grad(hf, name)) <= TOL, name
    layer.aux_loss_scale = 0.0  # negative control: without the aux gradient the router's differs
    model.zero_grad()
    model(ids, ids).backward()
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert _max_diff(dict(model.named_parameters())[router].grad, _hf_grad(hf, router)) > 1e-4


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_norm"])
def test_hf_round_trip_is_bitwise(checkpoints, tmp_path, name):
    path, ids, ref, _ = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    out = tmp_path / "saved"
    save_hf_checkpoint(model, out, single_process_mesh().info("tp"))
    before, after = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == CONFIGS[name][0]
    hf_cls = transformers.MixtralForCausalLM if name.startswith("mixtral") else transformers.Qwen3MoeForCausalLM
    with torch.no_grad():
        assert _max_diff(hf_cls.from_pretrained(out, dtype=torch.float32).eval()(ids).logits, ref.logits) <= TOL
        assert torch.equal(load_from_hf(out, single_process_mesh())(ids), model(ids))


@pytest.mark.parametrize("config", [
    MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, max_position_embeddings=32),
    Qwen3MoeConfig(vocab_size=50, hidden_size=32, intermediate_size=24, moe_intermediate_size=8, head_dim=8,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                   num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=32),
], ids=["mixtral", "qwen3_moe"])
def test_one_stage_is_the_full_model_and_init_is_by_name(config):
    mesh = single_process_mesh()
    full = build_model(config, mesh, seed=3)
    (stage,) = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=3)
    full_params, stage_params = dict(full.named_parameters()), dict(stage.named_parameters())
    assert list(stage_params) == list(full_params)
    for name, p in full_params.items():
        assert torch.equal(stage_params[name], p), name
    assert sum(p.numel() for p in full_params.values()) == config.num_parameters()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(stage(ids, 8, ids), full(ids, ids))


def test_bad_expert_configs_name_the_field():
    kw = dict(vocab_size=50, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ModelConfigError, match=r"model.num_experts_per_tok=5 exceeds model.num_local_experts=4"):
        MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=5)
    with pytest.raises(ModelConfigError, match=r"model.router_jitter_noise"):
        MixtralConfig(**kw, router_jitter_noise=0.1)
    with pytest.raises(ModelConfigError, match=r"model.mlp_only_layers holds \[3\]"):
        Qwen3MoeConfig(**kw, head_dim=8, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[3])
    assert Qwen3MoeConfig.from_hf_dict(Qwen3MoeConfig(**kw, head_dim=8, num_experts=4, num_experts_per_tok=2)
                                       .to_hf_dict()).num_experts == 4


# ------------------------------------------------------------------------------ tensor parallelism
def _tp_worker(rank: int, world: int, path: str, ids: torch.Tensor) -> tuple:
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from tp_gather import full_grads

    config = load_hf_config(path)
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
    model = load_from_hf(path, mesh)
    with torch.no_grad():
        logits = model(ids)
    model(ids, ids).backward()
    return logits, full_grads(model, mesh.info("tp"))


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tp2_logits_and_gradients_equal_one_process(checkpoints, name):
    """Experts stay whole on each TP rank (see plait.models.mixtral.parallelize): the logits equal
    transformers' and every gradient (replicated MoE parameters included) equals one process's."""
    from distributed import run_distributed

    path, ids, ref, _ = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    model(ids, ids).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for logits, got in run_distributed(_tp_worker, 2, str(path), ids):
        assert _max_diff(logits, ref.logits) <= TOL
        assert set(got) == set(grads)
        for n, g in grads.items():
            assert _max_diff(got[n], g) <= TOL, n
