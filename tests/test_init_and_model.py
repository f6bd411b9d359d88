"""Layout-invariant initialisation, fx traceability and bad-input errors of the Llama model."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed


def _config(**kw):
    from plait.models.llama import LlamaConfig

    base = dict(vocab_size=77, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32, attention_bias=True)
    base.update(kw)
    return LlamaConfig(**base)


def _full_weights(rank, world, cfg_kw):
    from builders import build_llama
    from plait.mesh import ParallelMesh
    from plait.models.llama.parallelize import kv_replication_for
    from plait.parallel_state import full_state_dict

    cfg = _config(**cfg_kw)
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(cfg, world))
    model = build_llama(cfg, mesh, seed=42)
    return full_state_dict(model, mesh.info("tp"))


@pytest.mark.parametrize("cfg_kw", [{}, pytest.param({"tie_word_embeddings": True}, marks=pytest.mark.slow)],
                         ids=["untied", "tied"])  # tied: also by tests/test_materialize.py at TP=2 x PP=2
def test_initial_weights_identical_for_tp_1_2_4(cfg_kw):
    from builders import build_llama
    from plait.mesh import single_process_mesh

    ref = dict(build_llama(_config(**cfg_kw), single_process_mesh(), seed=42).named_parameters())
    for world in (2, 4):  # TP=4 with 6 heads also exercises head padding and KV replication
        for rank, full in enumerate(run_distributed(_full_weights, world, cfg_kw)):
            assert set(full) == set(ref)
            for name, tensor in full.items():
                assert torch.equal(tensor, ref[name].detach()), f"tp={world} rank {rank}: {name} differs"


def test_init_depends_on_seed_and_name():
    from builders import build_llama
    from plait.mesh import single_process_mesh

    a = dict(build_llama(_config(), single_process_mesh(), seed=1).named_parameters())
    b = dict(build_llama(_config(), single_process_mesh(), seed=2).named_parameters())
    q0, q1 = a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    assert not torch.equal(q0, b["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(48))


def test_fx_traces_with_decoder_layers_as_leaves():
    import torch.fx

    from builders import build_llama
    from plait.mesh import single_process_mesh
    from plait.models.llama.model import LlamaDecoderLayer

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, LlamaDecoderLayer) or super().is_leaf_module(m, qualname)

    model = build_llama(_config(), single_process_mesh(), seed=0)
    optional = ("labels", "position_ids", "segment_ids", "loss_normalizer")  # the plain next-token path
    graph = Tracer().trace(model, concrete_args={**dict.fromkeys(optional), "logits_to_keep": 0})
    gm = torch.fx.GraphModule(model, graph)
    calls = [n.target for n in graph.nodes if n.op == "call_module"]
    assert calls.count("model.layers.0") == 1 and calls.count("model.layers.1") == 1
    ids = torch.randint(0, 77, (2, 10))
    assert torch.equal(gm(ids), model(ids))


@pytest.mark.parametrize(
    "kw,needle",
    [(dict(num_attention_heads=6, num_key_value_heads=4),
      "num_attention_heads=6 is not divisible by num_key_value_heads=4"),
     (dict(hidden_size=50), "hidden_size=50 is not divisible by num_attention_heads=6"),
     (dict(vocab_size=0), "model.vocab_size=0 must be a positive integer"),
     (dict(rope_scaling={"rope_type": "yarn"}), "rope_scaling.rope_type='yarn' is not supported")],
)
def test_bad_model_configs(kw, needle):
    from plait.models.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=needle):
        _config(**kw)


def _fake_build(rank, world, tp, kv_rep, cfg_kw):
    import torch.distributed as dist

    from plait.mesh import ParallelMesh
    from plait.models.llama import LlamaForCausalLM
    from plait.models.llama.parallelize import parallelize

    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        mesh = ParallelMesh(world, rank, tp=tp, kv_replication=kv_rep)
        with torch.device("meta"):
            model = LlamaForCausalLM(_config(**cfg_kw))
        parallelize(model, mesh)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world,tp,kv_rep,cfg_kw,needle",
    [(8, 8, 1, {}, "tp=8 exceeds num_attention_heads=6"),
     (4, 4, 1, {}, "mesh was built with kv_replication=1; build the mesh with kv_replication=2"),
     (4, 4, 4, dict(intermediate_size=90), "intermediate_size=90 is not divisible by tp=4"),
     (2, 2, 2, dict(num_key_value_heads=6), r"kv_replication=2 is not valid .* valid values: \[1\]")],
)
def test_bad_tp_layouts_are_named(world, tp, kv_rep, cfg_kw, needle):
    with pytest.raises(ValueError, match=needle):
        _fake_build(0, world, tp, kv_rep, cfg_kw)
