"""The DeepSeek-V3 family (``model_type: deepseek_v3``) against transformers' ``DeepseekV3ForCausalLM``.

The tiny checkpoints hold what differs from Llama: multi-head latent attention with a query
bottleneck and YaRN scaling (``mscale_all_dim`` scales the softmax) and with a direct query
projection, q/k/v/o biases and non-interleaved rotary (DeepSeek-V2-Lite's shape); a dense first
layer, then MoE layers with shared experts and the sigmoid router, group-limited, with random
balancing biases (``e_score_correction_bias``) so that they change the choice.

Shown here: logits and loss at TP=1 (1e-5 relative, fp32) with negative controls; refusals by
name; a bitwise Hugging Face round trip (balancing biases included) that transformers reads; a
multi-token-prediction module equal to transformers' ``MtpLayer``, its loss in the gradient and
not in the returned loss, its names in DeepSeek's layout; logits and gradients (prediction modules
included) at TP=2, with and without sequence parallelism; 4 logged steps at PP=2 (losses and MTP
losses) and 20 steps with prediction modules at PP=2 and at TP=2 x EP=2 (slow) equal to one
process's; cp and LoRA refusals and their slow parity runs; the planner's parameters, FLOPs,
activations and pipeline split; the cluster recipe's dry run (slow). Cached decoding (the latent
cache) is in tests/test_kv_cache.py, the planner's widths in tests/test_family_shapes.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from plait.materialize import build_model, build_stages, load_from_hf
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from plait.models.deepseek_v3.model import MtpStats, mtp_inputs
from plait.models.errors import ModelConfigError
from plait.models.hf_io import load_hf_config, save_hf_checkpoint
from plait.models.registry import FAMILIES, family_for_model_type
from tp_gather import full_grads
from trainer_runs import corpus_dir, max_relative, merged_weights, run_recipe, weight_errors

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SEQ = 12
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
              num_attention_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
              qk_nope_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
              num_mtp_layers=0, tie_word_embeddings=False)
CONFIGS: dict[str, dict] = {
    # the query bottleneck, YaRN, interleaved rotary, top-2 of 4 groups of 2 experts, renormalised and scaled
    "v3": dict(q_lora_rank=24, rope_parameters=YARN, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    # DeepSeek-V2-Lite's shape: direct queries, no group limit, two shared experts, biases, half-split rotary
    "lite": dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False,
                 n_shared_experts=2, attention_bias=True, routed_scaling_factor=1.0),
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and every router's balancing bias random (a zero bias would change no choice)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{name: (hf dir, input ids, transformers logits, transformers loss)}``."""
    root = tmp_path_factory.mktemp("deepseek_v3")
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**COMMON, **cfg))
        _randomize(model, seed=i)
        model.eval().save_pretrained(root / name)
        ids = torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(100 + i))
        with torch.no_grad():
            result = model(ids, labels=ids)
        out[name] = (root / name, ids, result.logits, result.loss)
    return out


# ------------------------------------------------------------------------------ one process
def test_registry_and_config_json(checkpoints):
    assert family_for_model_type("deepseek_v3") is FAMILIES["deepseek_v3"]
    c = load_hf_config(checkpoints["v3"][0])
    assert isinstance(c, DeepseekV3Config)
    # transformers writes num_key_value_heads=128 and head_dim=qk_rope_head_dim: MLA implies both
    assert (c.num_key_value_heads, c.head_dim, c.qk_head_dim) == (4, 8, 24)
    assert c.rope_scaling == {k: v for k, v in YARN.items() if k != "rope_theta"} and c.rope_type == "yarn"
    assert (c.q_lora_rank, c.n_group, c.topk_group, c.moe_layer_ids()) == (24, 4, 2, [1, 2])
    assert c.softmax_scale == pytest.approx(24 ** -0.5 * (1 + 0.1 * torch.log(torch.tensor(4.0)).item()) ** 2)
    lite = load_hf_config(checkpoints["lite"][0])
    assert lite.q_lora_rank is None and not lite.rope_interleave and lite.shared_expert_intermediate_size == 16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp1_logits_and_loss_match_transformers(checkpoints, name):
    path, ids, ref_logits, ref_loss = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    with torch.no_grad():
        logits, loss = model(ids), model(ids, ids)
    print(f"{name}: logits {_relative(logits, ref_logits):.1e}, loss {_relative(loss, ref_loss):.1e}")
    assert _relative(logits, ref_logits) <= TOL
    assert _relative(loss, ref_loss) <= TOL
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_the_balancing_bias_the_interleave_and_the_yarn_scale_matter(checkpoints):
    """Negative controls: each changes the logits, so the parity above checks it."""
    path, ids, ref, _ = checkpoints["v3"]
    base = load_hf_config(path)
    loaded = load_from_hf(path, single_process_mesh())
    weights = {**loaded.state_dict()}
    biases = [n for n in weights if n.endswith("gate.expert_bias")]
    assert len(biases) == 2 and all(weights[n].abs().sum() > 0 for n in biases)  # read from the checkpoint
    changes = {"bias": {}, "interleave": dict(rope_interleave=False),
               "mscale": dict(rope_scaling=dict(base.rope_scaling, mscale_all_dim=0.0, mscale=0.0))}
    for what, change in changes.items():
        model = DeepseekV3ForCausalLM(DeepseekV3Config.from_hf_dict(base.to_hf_dict() | change))
        state = dict(weights)
        if what == "bias":
            state.update({n: torch.zeros_like(weights[n]) for n in biases})
        model.load_state_dict(state)
        with torch.no_grad():
            assert _relative(model(ids), ref) > 1e-3, what


def test_refusals_name_the_field():
    base = dict(model_type="deepseek_v3", **{k: v for k, v in COMMON.items() if k != "num_mtp_layers"},
                n_group=4, topk_group=2)
    DeepseekV3Config.from_hf_dict(base)
    refused = {
        "scoring_func": dict(scoring_func="softmax"), "topk_method": dict(topk_method="greedy"),
        "moe_layer_freq": dict(moe_layer_freq=2),
        "n_group": dict(n_group=3), "topk_group": dict(topk_group=1, num_experts_per_tok=3),
        "hidden_act": dict(hidden_act="gelu"), "first_k_dense_replace": dict(first_k_dense_replace=4),
        "num_nextn_predict_layers": dict(num_nextn_predict_layers=-1),
        "rope_scaling": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        "kv_lora_rank": {},
    }
    for field, change in refused.items():
        data = base | change
        if field == "kv_lora_rank":
            del data["kv_lora_rank"]
        with pytest.raises(ModelConfigError, match=field):
            DeepseekV3Config.from_hf_dict(data)
    # Hugging Face's head_dim is derived (transformers overwrites it); a recipe's must agree
    recipe = {k: v for k, v in base.items() if k not in ("model_type", "num_mtp_layers")}
    with pytest.raises(ModelConfigError, match="head_dim"):
        DeepseekV3Config(**recipe, head_dim=16)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_round_trip_is_bitwise(checkpoints, tmp_path, name):
    path, ids, ref, _ = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    out = tmp_path / "saved"
    save_hf_checkpoint(model, out, single_process_mesh().info("tp"))
    before, after = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before) and any(k.endswith("e_score_correction_bias") for k in after)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3" and saved["scoring_func"] == "sigmoid"
    with torch.no_grad():
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert _relative(hf(ids).logits, ref) <= TOL
        assert torch.equal(load_from_hf(out, single_process_mesh())(ids), model(ids))


def _tiny(**changes) -> DeepseekV3Config:
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
              v_head_dim=12, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
              topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=2, tie_word_embeddings=False)
    return DeepseekV3Config(**{**kw, **changes})


# ------------------------------------------------------------------------------ multi-token prediction
def test_a_prediction_module_is_transformers_mtp_layer():
    """One module's hidden state (after its output norm) equals transformers' ``MtpLayer`` built on
    DeepSeek-V3's decoder layer, with the same weights and inputs."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf_config = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS["v3"], "num_mtp_layers": 1})
    config = DeepseekV3Config.from_hf_dict(hf_config.to_dict())
    model = build_model(config, single_process_mesh(), seed=2).eval()
    (module,) = model.mtp
    theirs = MtpLayer(hf_config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, config.num_hidden_layers).eval()
    ours = {n.replace("shared_head.norm.", "post_norm.").replace("gate.expert_bias", "gate.e_score_correction_bias"):
            t for n, t in module.state_dict().items()}
    names = {n: n.split(".", 1)[1] if n.startswith("mtp_block.") else n for n in theirs.state_dict()}
    fused = {"mtp_block.mlp.experts.gate_up_proj", "mtp_block.mlp.experts.down_proj"}
    state = {n: ours[k] for n, k in names.items() if n not in fused}
    experts = range(config.n_routed_experts)
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        (ours[f"mlp.experts.{e}.gate_proj.weight"], ours[f"mlp.experts.{e}.up_proj.weight"])) for e in experts])
    state["mtp_block.mlp.experts.down_proj"] = torch.stack([ours[f"mlp.experts.{e}.down_proj.weight"]
                                                            for e in experts])
    theirs.load_state_dict(state)
    gen = torch.Generator().manual_seed(4)
    previous, embedded = torch.randn(2, SEQ, 32, generator=gen), torch.randn(2, SEQ, 32, generator=gen)
    hf_rope = transformers.DeepseekV3ForCausalLM(hf_config).model.rotary_emb
    positions = torch.arange(SEQ).unsqueeze(0)
    with torch.no_grad():
        expected = theirs(embedded, previous, hf_rope(previous, positions), None, positions, None)
        side = model.decoder.block_inputs(previous, SEQ, None, None)
        got = module.shared_head.norm(module.predict(previous, embedded, *side))
    assert _relative(got, expected) <= TOL


def test_mtp_inputs_skip_unknown_tokens_and_other_samples():
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    tokens, target = mtp_inputs(labels, None, 1)
    assert tokens.tolist() == [[11, 12, 13, 14, 15, 0]]  # position t reads token t + 1
    assert target.tolist() == [[-100, 12, 13, 14, 15, -100]]  # position t's target (at t + 1) is token t + 2
    masked = torch.tensor([[-100, -100, 12, 13, 14, 15]])  # an SFT prompt: tokens 0 and 1 are not labelled
    tokens, target = mtp_inputs(masked, None, 1)
    assert tokens.tolist() == [[0, 12, 13, 14, 15, 0]] and target.tolist() == [[-100, -100, 13, 14, 15, -100]]
    packed = torch.tensor([[0, 0, 0, 1, 1, 1]])  # two samples: no target crosses into the next one
    _, target = mtp_inputs(labels, packed, 1)
    assert target.tolist() == [[-100, 12, -100, -100, 15, -100]]


def test_the_mtp_loss_is_in_the_gradient_not_in_the_loss():
    config = _tiny()
    model = build_model(config, single_process_mesh(), seed=5).train()
    model.mtp_stats = MtpStats.zeros(2, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))
    loss = model(ids, ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        assert torch.equal(loss, model.eval()(ids, ids))  # the returned loss is the next-token loss
    assert all(f"mtp.{k}.eh_proj.weight" in grads for k in (0, 1))
    # the same gradient from the objective written out: next-token loss + weight * mean of the depths' losses
    model.train().zero_grad()
    decoder = model.decoder
    h = decoder(ids)
    side = decoder.block_inputs(h, 10, None, None)
    depths, previous = [], h
    for k, module in enumerate(model.mtp, start=1):
        tokens, target = mtp_inputs(ids, None, k)
        previous = module.predict(previous, decoder.embedding(tokens), *side)
        depths.append(model.output(model.head(module.shared_head.norm(previous)), target))
    (model.output(model.head(h), ids) + config.mtp_loss_weight * torch.stack(depths).mean()).backward()
    for name, g in grads.items():
        assert _relative(g, dict(model.named_parameters())[name].grad) <= 1e-6, name
    s = model.mtp_stats
    assert torch.allclose(s.loss_sum / s.targets, torch.stack(depths).detach()) and s.targets.tolist() == [16, 14]


def test_mtp_names_are_deepseeks_layout(tmp_path):
    config = _tiny()
    model = build_model(config, single_process_mesh(), seed=7)
    save_hf_checkpoint(model, tmp_path, single_process_mesh().info("tp"))
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"model.layers.3.enorm.weight", "model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
            "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.4.mlp.gate.e_score_correction_bias"} <= names
    assert not any(n.startswith("mtp.") for n in names)
    again = load_from_hf(tmp_path, single_process_mesh())
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_checkpoint_without_its_prediction_modules_builds_none(tmp_path):
    """transformers writes ``num_nextn_predict_layers`` but saves no prediction module: the model
    is built without them, and says so; a checkpoint holding only some of them is refused."""
    from safetensors.torch import save_file

    hf_config = transformers.DeepseekV3Config(**{**COMMON, **CONFIGS["lite"], "num_mtp_layers": 2})
    transformers.DeepseekV3ForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    with pytest.warns(UserWarning, match="no prediction module"):
        assert load_hf_config(tmp_path / "hf").num_nextn_predict_layers == 0
    with pytest.warns(UserWarning, match="no prediction module"):
        built = load_from_hf(tmp_path / "hf", single_process_mesh())
    assert len(built.mtp) == 0 and not any(n.startswith("mtp.") for n, _ in built.named_parameters())

    model = build_model(_tiny(), single_process_mesh(), seed=7)
    save_hf_checkpoint(model, tmp_path / "ours", single_process_mesh().info("tp"))
    assert load_hf_config(tmp_path / "ours").num_nextn_predict_layers == 2  # plait's export holds both
    weights = load_file(tmp_path / "ours" / "model.safetensors")
    save_file({n: t for n, t in weights.items() if not n.startswith("model.layers.4.")},
              tmp_path / "ours" / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"num_nextn_predict_layers=2 .* only at layers \[3\]"):
        load_hf_config(tmp_path / "ours")


def test_units_and_the_one_stage_pipeline():
    from plait.pipeline.trace import trace_units

    config = _tiny()
    with torch.device("meta"):
        meta = DeepseekV3ForCausalLM(config)
    assert trace_units(meta) == FAMILIES["deepseek_v3"].units(config)
    mesh = single_process_mesh()
    full = build_model(config, mesh, seed=3)
    (stage,) = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=3)
    assert list(dict(stage.named_parameters())) == list(dict(full.named_parameters()))
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    full_loss, stage_loss = full(ids, ids), stage(ids, 8, ids)
    # built on meta and allocated, the balancing biases start at zero (not at what the memory held)
    for model in (full, stage):
        assert all(torch.equal(b, torch.zeros_like(b)) for n, b in model.named_buffers() if n.endswith("expert_bias"))
    assert torch.equal(stage_loss, full_loss)
    full_loss.backward()
    stage_loss.backward()
    stage_grads = {n: p.grad for n, p in stage.named_parameters()}
    for name, p in full.named_parameters():
        assert torch.equal(p.grad, stage_grads[name]), name  # the prediction modules' included


# ------------------------------------------------------------------------------ several ranks
def _grads(model: torch.nn.Module, ids: torch.Tensor, tp=None) -> dict[str, torch.Tensor]:
    model.train()(ids, ids).backward()
    return full_grads(model, tp) if tp is not None else {n: p.grad for n, p in model.named_parameters()}


def _tp_worker(rank: int, world: int, jobs: list[tuple]) -> dict:
    out = {}
    for key, path, ids, task, sp in jobs:
        mesh = ParallelMesh(world, rank, tp=world)
        if isinstance(path, DeepseekV3Config):
            model = build_model(path, mesh, seed=11, sequence_parallel=sp)
        else:
            model = load_from_hf(path, mesh, sequence_parallel=sp)
        if task == "logits":
            with torch.no_grad():
                out[key] = model.eval()(ids)
        else:
            out[key] = _grads(model, ids, mesh.info("tp"))
    return out


def test_tp2_logits_and_gradients_equal_one_process(checkpoints):
    """Both checkpoints (logits and gradients) and a model with two prediction modules (gradients:
    the modules' loss reaches every weight), each with and without sequence parallelism."""
    mtp = _tiny()
    mtp_ids = torch.randint(0, mtp.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    sources = {n: (checkpoints[n][0], checkpoints[n][1]) for n in CONFIGS} | {"mtp": (mtp, mtp_ids)}
    jobs = []
    for name, (source, ids) in sources.items():
        for sp in (False, True):
            if name != "mtp":
                jobs.append((f"{name}_{sp}", source, ids, "logits", sp))
            jobs.append((f"g_{name}_{sp}", source, ids, "grads", sp))
    results = run_distributed(_tp_worker, 2, jobs)
    worst = {"logits": 0.0, "grads": 0.0}
    for name, (source, ids) in sources.items():
        if name == "mtp":
            reference = build_model(mtp, single_process_mesh(), seed=11)
        else:
            reference = load_from_hf(source, single_process_mesh())
            ref_logits = checkpoints[name][2]
        ref_grads = _grads(reference, ids)
        for sp in (False, True):
            for rank, res in enumerate(results):
                if name != "mtp":
                    diff = _relative(res[f"{name}_{sp}"], ref_logits)
                    worst["logits"] = max(worst["logits"], diff)
                    assert diff <= TOL, (name, sp, rank, diff)
                got = res[f"g_{name}_{sp}"]
                assert set(got) == set(ref_grads)
                for param, g in got.items():
                    diff = _relative(g, ref_grads[param])
                    worst["grads"] = max(worst["grads"], diff)
                    assert diff <= TOL, (name, sp, rank, param, diff)
    print("tp2 worst relative differences:", worst)


# ------------------------------------------------------------------------------ recipes and the trainer
DEEPSEEK = ["model.family=deepseek_v3", "model.num_attention_heads=4", "model.q_lora_rank=16", "model.kv_lora_rank=16",
            "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=8", "model.v_head_dim=16",
            "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
            "model.n_group=2", "model.topk_group=1", "model.first_k_dense_replace=1",
            "model.num_nextn_predict_layers=1", "model.routed_scaling_factor=1.0"]
STEPS = 20
TRAIN = DEEPSEEK + ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=4",
                    "model.tie_word_embeddings=false", "data.vocab_size=320", "data.seq_len=32",
                    "data.micro_batch_size=2", "parallel.microbatches=4", "parallel.sequence_parallel=false",
                    "optimizer.grad_clip=1.0", "scheduler.warmup_steps=2", "optimizer.lr=3e-3", "parallel.tp=1",
                    "logging.progress_bar=false", "logging.tensorboard=false", "moe.router_bias_update_rate=0.001"]


def test_recipe_builds_deepseek_v3():
    from plait.config import check_recipe
    from plait.models.flops import model_flops_per_token

    resolved = check_recipe(None, DEEPSEEK, 2)
    config = resolved.model_config(300)
    assert isinstance(config, DeepseekV3Config) and resolved.family == "deepseek_v3"
    assert (config.q_lora_rank, config.num_nextn_predict_layers, config.moe_layer_ids()) == (16, 1, [1, 2, 3])
    assert config.num_parameters() == resolved.num_parameters(300)
    assert resolved.flops_per_token(300) == model_flops_per_token(config, resolved.recipe.data.seq_len)
    direct = check_recipe(None, [i for i in DEEPSEEK if "q_lora_rank" not in i], 2).model_config(300)
    assert direct.q_lora_rank is None  # null: the direct query projection


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    corpus = corpus_dir(tmp_path_factory)
    ref = run_recipe(corpus, tmp_path_factory.mktemp("one"), TRAIN, 1, STEPS)[0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, "the reference must learn for the comparison to mean anything"
    return corpus, ref


#: relative weight tolerance: partial sums in another order, amplified by 20 AdamW steps
WEIGHT_TOL = {"pp2": 1e-5, "tp2-ep2": 5e-5}


@pytest.mark.parametrize("name,overrides,world", [
    pytest.param("pp2", ["parallel.pp=2"], 2, marks=pytest.mark.slow),
    pytest.param("tp2-ep2", ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                                "data.micro_batch_size=1"], 4,  # dp=2 replicas of 1 sequence: the same global batch
                 marks=pytest.mark.slow),
])
def test_20_steps_match_one_process(single_run, tmp_path, name, overrides, world):
    corpus, ref = single_run
    results = run_recipe(corpus, tmp_path, TRAIN + overrides, world, STEPS)
    worst = max(max_relative(r["losses"], ref["losses"]) for r in results if any(r["losses"]))
    errors = weight_errors(merged_weights(results), ref["weights"])
    print(f"{name}: max relative loss difference {worst:.2e}, worst weight {max(errors.values()):.2e}")
    assert worst <= 1e-5, [r["losses"] for r in results]
    assert any(k.startswith("mtp.0.") for k in errors)  # the prediction module trained, and equally
    for key, err in errors.items():
        assert err <= WEIGHT_TOL[name], f"{key}: relative weight difference {err:.2e}"


def _fit_worker(rank, world, recipe_yaml, prepared):
    import yaml

    from plait.config import validate_recipe
    from plait.train.trainer import Trainer

    torch.manual_seed(0)
    Trainer(validate_recipe(yaml.safe_load(recipe_yaml), world), prepared, rank, world).fit()


def _logged(corpus, out: Path, items: list[str], world: int) -> list[dict]:
    import yaml

    from plait.config import load_recipe, recipe_data
    from plait.config.load import DEFAULT_RECIPE
    from plait.train.entry import prepare_data

    items = items + [f"data.source={corpus}", f"run.output_dir={out}"]
    prepared = str(prepare_data(load_recipe(DEFAULT_RECIPE, items)))
    run_distributed(_fit_worker, world, yaml.safe_dump(recipe_data(DEFAULT_RECIPE, items)), prepared)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tokens_per_s" in r]


def test_the_mtp_loss_is_logged_apart_and_alike_under_pp2(tmp_path_factory, tmp_path):
    """The training loop logs ``mtp_loss`` (and one per depth) beside the next-token loss; the
    pipeline's last stage holds the modules, and the interval means (and the losses) equal one
    process's (the default suite's PP=2 check; the 20-step one is slow)."""
    corpus = corpus_dir(tmp_path_factory)
    items = TRAIN + ["model.num_nextn_predict_layers=2", "train.steps=4", "train.log_every=2", "train.eval_every=4",
                     "train.eval_batches=1", "train.sample_tokens=0"]
    one = _logged(corpus, tmp_path / "one", items, 1)
    two = _logged(corpus, tmp_path / "pp2", items + ["parallel.pp=2"], 2)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert {"mtp_loss", "mtp_loss/depth1", "mtp_loss/depth2"} <= set(a) and a["mtp_loss"] != a["loss"]
        assert a["mtp_loss"] == pytest.approx((a["mtp_loss/depth1"] + a["mtp_loss/depth2"]) / 2, rel=1e-6)
        for key in ("loss", "mtp_loss", "mtp_loss/depth1", "mtp_loss/depth2"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
    assert one[1]["mtp_loss"] < one[0]["mtp_loss"]  # the modules learn


# ------------------------------------------------------------------------------ the planner
@pytest.mark.parametrize("degrees,q_lora_rank,bias", [
    *((d, 16, False) for d in (dict(), dict(tp=2), dict(pp=2), dict(tp=2, pp=2), dict(dp=2, ep=2),
                               dict(tp=2, dp=2, ep=2))),
    (dict(tp=2), None, True), (dict(tp=2, pp=2), None, True),
    *(pytest.param(d, None, True, marks=pytest.mark.slow) for d in (dict(), dict(pp=2), dict(dp=2, ep=2),
                                                                    dict(tp=2, dp=2, ep=2))),
])
def test_planner_parameter_counts_equal_the_built_shards(degrees, q_lora_rank, bias):
    """Latent attention (compressions whole, expansions split by heads), the dense and the sparse
    layers, and on the last stage the prediction modules: every rank's count is its built model's."""
    from plait.moe.expert_parallel import apply_expert_parallel
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import chunk_expert_parameter_count, local_shapes, rank_chunks, rank_parameter_count
    from plait.plan.pipeline_split import plan_partition

    config = _tiny(num_hidden_layers=4, q_lora_rank=q_lora_rank, attention_bias=bias, o_proj_bias=bias)
    layout = ParallelDegrees(**degrees)
    for rank in range(layout.world):
        mesh = ParallelMesh(layout.world, rank, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                            create_groups=False)
        if layout.pp == 1:
            modules = [build_model(config, mesh, device="meta", init=False)]
        else:
            modules = build_stages(config, mesh, plan_partition(config, layout.pp, 64).stage_layers(), device="meta",
                                   init=False)
        apply_expert_parallel(modules, mesh.info("ep"))
        built = sum(p.numel() for m in modules for p in m.parameters())
        experts = sum(p.numel() for m in modules for n, p in m.named_parameters() if ".experts." in n)
        assert rank_parameter_count(config, layout, 64, mesh.pp_rank) == built, (degrees, rank)
        sh = local_shapes(config, layout)
        chunks = rank_chunks(config, layout, 64, mesh.pp_rank)
        assert sum(chunk_expert_parameter_count(config, sh, ch) for ch in chunks) == experts, (degrees, rank)


def test_model_flops_count_the_latent_heads_and_the_prediction_modules():
    """``6 N`` over the active parameters (prediction modules' experts too) plus the attention's
    ``6 H (Q_k + Q_v) S`` for every block, prediction modules included."""
    from plait.models.flops import model_flops_per_token

    config = _tiny()
    h, n, S = config.hidden_size, config.num_attention_heads, 64
    blocks = config.num_hidden_layers + config.num_nextn_predict_layers
    sparse = blocks - config.first_k_dense_replace
    unused = sparse * (config.n_routed_experts - config.num_experts_per_tok) * 3 * h * config.moe_intermediate_size
    active = config.num_parameters() - config.vocab_size * h - unused
    attention = 6 * blocks * n * (config.qk_head_dim + config.v_head_dim) * S
    assert model_flops_per_token(config, S) == 6 * active + attention


def _math_path_extra(config: DeepseekV3Config, tokens: int, B: int, S: int, heads: int, core: int, c: int) -> int:
    """What PyTorch's CPU attention saves for one latent-attention block beyond the flash /
    memory-efficient kernels the planner prices: its math path (taken when the value width differs
    from the query's) keeps the ``B n S^2`` probabilities and contiguous copies of the values instead
    of the view of ``kv_b_proj``'s output and the logsumexp; the core runs in ``core`` bytes (fp32
    under CPU autocast: the rotary tables promote the queries and keys and the math path is not cast)."""
    qk, v, nope = config.qk_head_dim, config.v_head_dim, config.qk_nope_head_dim
    math = tokens * heads * core * (2 * qk + v) + B * heads * S * S * core + tokens * heads * v * c
    flash = tokens * heads * c * (2 * qk + nope + 2 * v) + 4 * tokens * heads
    return math - flash


@pytest.mark.parametrize("tp,precision,depths", [(1, "fp32", 0), (1, "fp32", 1), (1, "autocast", 0),
                                                 (1, "autocast", 1), (2, "fp32", 0), (2, "fp32", 1)])
def test_planner_activations_match_autograd(tp, precision, depths):
    """One forward's saved tensors equal the planner's bytes, latent attention and the prediction
    modules (their norms, projection, block, head input and logits) included, once the CPU
    attention kernel's own difference is accounted for; ids and masks aside."""
    import torch.distributed as dist

    from plait.plan.degrees import ParallelDegrees
    from plait.plan.memory import chunk_cost, rank_chunks
    from test_plan_memory import _saved_bytes

    config = _tiny(num_hidden_layers=2, num_nextn_predict_layers=depths, hidden_size=64, intermediate_size=128)
    B, S = 2, 32
    if tp > 1:
        dist.init_process_group("fake", rank=tp - 1, world_size=tp)
    try:
        mesh = ParallelMesh(tp, tp - 1, tp=tp, create_groups=tp > 1)
        model = build_model(config, mesh, seed=0)
        ids = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
        got = _saved_bytes(model, ids, precision)
    finally:
        if tp > 1:
            dist.destroy_process_group()
    layout = ParallelDegrees(tp=tp)
    (chunk,) = rank_chunks(config, layout, S, 0)
    cost = chunk_cost(config, layout, precision, chunk, B, S)
    est = cost.activations + cost.weight_copies + cost.logits_saved
    c = 4 if precision == "fp32" else 2
    blocks = config.num_hidden_layers + depths
    est += blocks * _math_path_extra(config, B * S, B, S, config.num_attention_heads // tp, 4, c)
    # left out: int64 token ids, targets and shifted inputs, boolean masks (each depth has its own)
    assert 0 <= got - est <= (16 * B * S + 4096) * (1 + depths), (got, est)


@pytest.mark.slow
def test_the_cluster_recipe_validates_and_its_dry_run_matches_the_planner():
    """recipes/deepseek-v3.yaml on 1024 ranks: it validates with DeepSeek-V3's shape, and its first and
    last ranks (the last with the prediction module and the embedding's copy) build on the fake
    process group with the planner's parameters, experts and ZeRO-2 shards (the search that
    recommends the layout takes minutes; its figures are the recipe's comment)."""
    from plait.config import check_recipe
    from plait.plan.degrees import ParallelDegrees
    from plait.plan.dry_run import dry_run

    (path,) = FAMILIES["deepseek_v3"].recipes
    resolved = check_recipe(str(path), [], 1024, check_paths=False)
    config = resolved.model_config(129280)
    assert isinstance(config, DeepseekV3Config)
    assert round(config.num_parameters() / 1e9, 1) == 682.6 and config.num_nextn_predict_layers == 1
    p = resolved.recipe.parallel
    layout = ParallelDegrees(tp=p.tp, pp=p.pp, dp=resolved.dp, ep=p.ep, zero=p.zero_level(),
                             activation_checkpointing=resolved.recipe.train.activation_checkpointing)
    assert (layout.pp, layout.dp, layout.ep, layout.zero) == (16, 64, 8, 2)
    for rank in (0, 1023):
        report = dry_run(config, layout, 1024, rank, precision="bf16-mixed", seq_len=4096, microbatches=p.microbatches)
        assert report.matches_exactly, report.check_line()


def test_context_parallelism_with_prediction_modules_is_refused_by_name():
    """A prediction module reads tokens up to its depth ahead, across the context-parallel chunks:
    refused before launch; without prediction modules latent attention runs under cp."""
    from plait.config import RecipeError, check_recipe

    small = DEEPSEEK + ["model.hidden_size=64", "model.num_hidden_layers=2", "data.seq_len=32", "parallel.cp=2"]
    with pytest.raises(RecipeError) as info:
        check_recipe(None, small, 2)
    (problem,) = [p for p in info.value.problems if p.field == "model.num_nextn_predict_layers"]
    assert "parallel.cp=2" in str(problem) and "set it to 0" in str(problem)
    check_recipe(None, small + ["model.num_nextn_predict_layers=0"], 2)


@pytest.mark.slow
def test_20_steps_under_cp2_match_one_process(tmp_path_factory):
    """Latent attention under context parallelism (the ring over the two chunks of each rank, value
    heads narrower than the query heads), without prediction modules: 20 steps equal one process's."""
    corpus = corpus_dir(tmp_path_factory)
    train = TRAIN + ["model.num_nextn_predict_layers=0"]
    ref = run_recipe(corpus, tmp_path_factory.mktemp("one"), train, 1, STEPS)[0]
    results = run_recipe(corpus, tmp_path_factory.mktemp("cp2"), train + ["parallel.cp=2"], 2, STEPS)
    worst = max(max_relative(r["losses"], ref["losses"]) for r in results if any(r["losses"]))
    assert worst <= 1e-5, (worst, [r["losses"] for r in results])


def test_lora_targets_are_the_projections_the_model_has():
    """The default targets name q/k/v projections latent attention does not have: refused before launch,
    listing the ones it has (the query projection only without a bottleneck)."""
    from plait.config import RecipeError, check_recipe

    small = DEEPSEEK + ["model.hidden_size=64", "model.num_hidden_layers=2", "data.seq_len=32", "lora.rank=4"]
    with pytest.raises(RecipeError, match=r"no q_proj, k_proj, v_proj projection .* \['o_proj', 'gate_proj', "
                                          r"'up_proj', 'down_proj'\]"):
        check_recipe(None, small, 1)
    check_recipe(None, small + ["model.q_lora_rank=null", "lora.target_modules=[q_proj,o_proj,down_proj]"], 1)


@pytest.mark.slow
def test_lora_under_tp2_with_sequence_parallelism_matches_one_process(tmp_path_factory):
    """Adapters on the direct query projection, the output projection and the dense MLP (DeepSeek-V2-Lite's
    shape): losses under TP=2 with sequence parallelism equal one process's."""
    corpus = corpus_dir(tmp_path_factory)
    train = TRAIN + ["model.q_lora_rank=null", "lora.rank=4", "lora.target_modules=[q_proj,o_proj,gate_proj,down_proj]"]
    ref = run_recipe(corpus, tmp_path_factory.mktemp("one"), train, 1, 6)[0]
    assert ref["losses"][-1] < ref["losses"][0]  # the adapters learn
    results = run_recipe(corpus, tmp_path_factory.mktemp("tp2"),
                         train + ["parallel.tp=2", "parallel.sequence_parallel=true"], 2, 6)
    worst = max(max_relative(r["losses"], ref["losses"]) for r in results if any(r["losses"]))
    assert worst <= 1e-5, (worst, [r["losses"] for r in results])


def test_the_pipeline_split_costs_the_prediction_modules_on_the_last_stage():
    """The head's unit carries each prediction module (a block, a second pass through the head, its
    projection), so a balanced split gives the last stage fewer decoder layers with them than without."""
    from plait.pipeline.partition import unit_costs
    from plait.pipeline.trace import trace_units
    from plait.plan.pipeline_split import plan_partition

    with_mtp, without = _tiny(num_hidden_layers=8, num_nextn_predict_layers=2), _tiny(num_hidden_layers=8,
                                                                                       num_nextn_predict_layers=0)
    costs = {}
    for name, config in (("with", with_mtp), ("without", without)):
        with torch.device("meta"):
            units = trace_units(DeepseekV3ForCausalLM(config))
        costs[name] = dict(zip([u.kind for u in units], unit_costs(config, units, 64, kind="flops"), strict=False))
    block, head = costs["without"]["block"], costs["without"]["head"]
    h = with_mtp.hidden_size
    assert costs["with"]["head"] == head + 2 * (block + head) + 6 * with_mtp.tail_extra_parameters() == \
        head + 2 * (block + head) + 6 * 2 * (3 * h + 2 * h * h)
    last = {name: len(plan_partition(c, 2, 64).stage_layers()[-1]) for name, c in (("with", with_mtp),
                                                                                      ("without", without))}
    assert last["with"] < last["without"], last


def test_the_mtp_loss_weight_is_a_training_knob_over_a_checkpoint(tmp_path):
    """With ``model.hf_path`` the architecture is the checkpoint's, but ``model.mtp_loss_weight`` (not
    in config.json) is the recipe's to set; a model without prediction modules has no such knob."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from plait.config import RecipeError, check_recipe

    save_hf_checkpoint(build_model(_tiny(), single_process_mesh(), seed=7), tmp_path / "ds",
                       single_process_mesh().info("tp"))
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 60)}}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    base = [f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.seq_len=32"]
    resolved = check_recipe(None, base + [f"model.hf_path={tmp_path / 'ds'}", "model.mtp_loss_weight=0.1"], 1)
    assert resolved.model_config().mtp_loss_weight == 0.1
    assert resolved.recipe.model.to_model_config(60).mtp_loss_weight == 0.1  # what training builds
    assert resolved.as_recipe().model.mtp_loss_weight == 0.1
    assert check_recipe(None, base + [f"model.hf_path={tmp_path / 'ds'}"], 1).model_config().mtp_loss_weight == 0.3
    with pytest.raises(RecipeError, match=r"model.hidden_size.*config.json sets it to 32"):
        check_recipe(None, base + [f"model.hf_path={tmp_path / 'ds'}", "model.hidden_size=64"], 1)
    from plait.models.llama import LlamaConfig

    llama = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    save_hf_checkpoint(build_model(llama, single_process_mesh(), seed=7), tmp_path / "llama",
                       single_process_mesh().info("tp"))
    with pytest.raises(RecipeError, match=r"model.mtp_loss_weight.*llama model of model.hf_path has no"):
        check_recipe(None, base + [f"model.hf_path={tmp_path / 'llama'}", "model.mtp_loss_weight=0.1"], 1)
