"""Model families (Qwen3, Mistral) against transformers, through Hugging Face directories.

Why: a family is only useful if plait computes what the reference implementation computes on the
same checkpoint, in every layout. transformers builds and saves a random tiny model; plait loads
the directory at TP=1/2/4 (KV replication at TP=2 and 4) and must give the same logits; at TP=2
the input gradient of the decoder stack and every weight gradient (Qwen3's replicated q/k norms
included) must equal one process's; plait's save must round-trip bitwise.

Tolerance: max |diff| <= 1e-5 in fp32 (logits and gradients). The weights are bitwise identical;
only the order of floating-point sums differs (SDPA kernels vs transformers' attention, GQA
expansion, TP partial sums), which perturbs these O(1) logits by ~1e-7..1e-6.

The one-stage identity (a stage holding every layer computes exactly what the full model does)
and the stage-wise Hugging Face read under PP are checked bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from model_weights import randomize
from plait.materialize import build_model, build_stages, load_from_hf
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.hf_io import load_hf_config, save_hf_checkpoint
from plait.models.llama.parallelize import kv_replication_for
from plait.models.mistral import MistralConfig
from plait.models.qwen3 import Qwen3Config
from plait.models.registry import FAMILIES, family_for_model_type
from tp_gather import full_grads as _full_grads

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SEQ = 12
BASE = dict(num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=128)
CONFIGS: dict[str, tuple[str, dict]] = {
    # 1 KV head: KV replication 2 at TP=2 and 4 at TP=4; explicit head_dim != hidden / heads; odd vocab
    "qwen3_tied": ("qwen3", dict(vocab_size=101, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
    "qwen3_untied_bias": ("qwen3", dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, attention_bias=True,
                                        tie_word_embeddings=False)),
    # a window shorter than the sequence: the window changes every position past the 5th
    "mistral_window": ("mistral", dict(vocab_size=99, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, sliding_window=5, tie_word_embeddings=False)),
    # a window longer than the sequence: full attention
    "mistral_wide": ("mistral", dict(vocab_size=99, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, sliding_window=64, tie_word_embeddings=True)),
}


def _hf_model(kind: str, cfg: dict) -> torch.nn.Module:
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, **cfg))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**BASE, **cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """``{name: (hf dir, input ids, transformers logits)}`` for every config."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, (kind, cfg)) in enumerate(CONFIGS.items()):
        model = _hf_model(kind, cfg)
        randomize(model, seed=i)
        model.eval().save_pretrained(root / name)
        ids = torch.randint(0, cfg["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(100 + i))
        with torch.no_grad():
            out[name] = (root / name, ids, model(ids).logits)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------ one process
def test_registry_picks_the_family_from_model_type(checkpoints):
    assert set(FAMILIES) == {"llama", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt_neox", "gemma3",
                             "deepseek_v3"}
    assert family_for_model_type("qwen2").name == "llama"
    assert isinstance(load_hf_config(checkpoints["qwen3_tied"][0]), Qwen3Config)
    config = load_hf_config(checkpoints["mistral_window"][0])
    assert isinstance(config, MistralConfig) and config.sliding_window == 5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp1_matches_transformers(checkpoints, name):
    path, ids, ref = checkpoints[name]
    with torch.no_grad():
        logits = load_from_hf(path, single_process_mesh())(ids)
    assert _max_diff(logits, ref) <= TOL


def test_the_window_matters_and_a_wide_window_is_full_attention(checkpoints):
    """Negative control for the windowed parity: without its window the model gives other logits
    (so the parity above could not pass by ignoring it), and a window wider than the sequence
    takes exactly the full-attention path."""
    path, ids, ref = checkpoints["mistral_window"]
    config = load_hf_config(path)
    config.sliding_window = None
    with torch.no_grad():
        full = build_model(config, single_process_mesh(), hf_path=path)(ids)
    assert _max_diff(full, ref) > 1e-3
    assert _max_diff(full[:, :5], ref[:, :5]) <= TOL  # positions inside the window: the same
    path, ids, _ = checkpoints["mistral_wide"]
    wide = load_hf_config(path)
    none = load_hf_config(path)
    none.sliding_window = None
    with torch.no_grad():
        assert torch.equal(build_model(wide, single_process_mesh(), hf_path=path)(ids),
                           build_model(none, single_process_mesh(), hf_path=path)(ids))


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_untied_bias", "mistral_window"])
def test_hf_round_trip_is_bitwise(checkpoints, tmp_path, name):
    path, ids, ref = checkpoints[name]
    model = load_from_hf(path, single_process_mesh())
    out = tmp_path / "saved"
    save_hf_checkpoint(model, out, single_process_mesh().info("tp"))
    before, after = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(after) == sorted(before)  # tied: no lm_head.weight, as transformers writes
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == CONFIGS[name][0]
    hf_cls = transformers.Qwen3ForCausalLM if saved["model_type"] == "qwen3" else transformers.MistralForCausalLM
    with torch.no_grad():
        assert _max_diff(hf_cls.from_pretrained(out, dtype=torch.float32).eval()(ids).logits, ref) <= TOL
        assert torch.equal(load_from_hf(out, single_process_mesh())(ids), model(ids))


def _tiny(family: str, **changes):
    cls = FAMILIES[family].config_cls
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen3":
        kw["head_dim"] = 16
    if family == "mistral":
        kw["sliding_window"] = 5
    return cls(**{**kw, **changes})


def _assert_one_stage_is_the_full_model(config, mesh, sequence_parallel: bool = False) -> None:
    full = build_model(config, mesh, seed=3, sequence_parallel=sequence_parallel)
    (stage,) = build_stages(config, mesh, [list(range(config.num_hidden_layers))], seed=3,
                            sequence_parallel=sequence_parallel)
    assert stage.first and stage.last
    full_params, stage_params = dict(full.named_parameters()), dict(stage.named_parameters())
    assert list(stage_params) == list(full_params)
    for name, p in full_params.items():
        assert torch.equal(stage_params[name], p), name
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(stage(ids, 8, ids), full(ids, ids))
        assert torch.equal(stage(ids, 8), full(ids))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_stage_is_the_full_model(family, tied):
    _assert_one_stage_is_the_full_model(_tiny(family, tie_word_embeddings=tied), single_process_mesh())


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_path_under_pp_reads_each_stage_its_own_tensors(checkpoints, tmp_path, family, tied):
    """build_stages(hf_path=...) at PP=2 (both pipeline ranks built in one process) gives exactly
    the full model's parameters; no stage reports the other stage's tensors as unexpected."""
    config = _tiny(family, tie_word_embeddings=tied)
    source = build_model(config, single_process_mesh(), seed=9)
    save_hf_checkpoint(source, tmp_path / "hf", single_process_mesh().info("tp"))
    full = dict(build_model(config, single_process_mesh(), hf_path=tmp_path / "hf").named_parameters())
    layers = [[0], [1, 2]]
    merged: dict[str, torch.Tensor] = {}
    for rank in range(2):
        mesh = ParallelMesh(2, rank, pp=2, create_groups=False)
        (stage,) = build_stages(config, mesh, layers, hf_path=tmp_path / "hf", seed=1)
        for name, p in stage.named_parameters():
            assert name not in merged or torch.equal(merged[name], p), name  # tied embedding on both ends
            merged[name] = p.detach()
    assert set(merged) == set(full)
    for name, p in full.items():
        assert torch.equal(merged[name], p), name
        assert torch.equal(p, dict(source.named_parameters())[name]), name


# ------------------------------------------------------------------------------ several ranks
def _grads(model: torch.nn.Module, ids: torch.Tensor, tp=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(weight gradients, gradient of the embedding output) of the next-token loss on ``ids``."""
    kept: list[torch.Tensor] = []

    def keep(module, args, out) -> None:
        out.retain_grad()
        kept.append(out)

    hook = model.model.embed_tokens.register_forward_hook(keep)
    model(ids, ids).backward()
    hook.remove()
    grads = _full_grads(model, tp) if tp is not None else {n: p.grad for n, p in model.named_parameters()}
    return grads, kept[0].grad


def _tp_worker(rank: int, world: int, jobs: list[tuple]) -> dict:
    out = {}
    for key, path, ids, task, sp in jobs:
        config = load_hf_config(path)
        mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
        if task == "one_stage":
            _assert_one_stage_is_the_full_model(config, mesh, sequence_parallel=sp)
            out[key] = True
            continue
        model = load_from_hf(path, mesh, sequence_parallel=sp)
        if task == "logits":
            with torch.no_grad():
                out[key] = model(ids)
        elif task == "grads":
            out[key] = _grads(model, ids, mesh.info("tp"))
        else:  # save
            save_hf_checkpoint(model, task, mesh.info("tp"), max_shard_bytes=30_000)
            out[key] = True
    return out


def _check_logits(results: list[dict], checkpoints: dict, keys: dict[str, str]) -> None:
    for key, name in keys.items():
        for rank, res in enumerate(results):
            diff = _max_diff(res[key], checkpoints[name][2])
            assert diff <= TOL, f"{key} rank {rank}: max diff {diff}"


def test_tp2_logits_gradients_round_trip_and_one_stage(checkpoints, tmp_path):
    jobs = [(n, checkpoints[n][0], checkpoints[n][1], "logits", False) for n in CONFIGS]
    jobs += [("qwen3_tied_sp", checkpoints["qwen3_tied"][0], checkpoints["qwen3_tied"][1], "logits", True)]
    grad_keys = {"g_qwen3_tied": ("qwen3_tied", False), "g_qwen3_tied_sp": ("qwen3_tied", True),
                 "g_qwen3_untied_bias": ("qwen3_untied_bias", False), "g_mistral_window": ("mistral_window", False)}
    jobs += [(k, checkpoints[n][0], checkpoints[n][1], "grads", sp) for k, (n, sp) in grad_keys.items()]
    saves = {n: tmp_path / n for n in ("qwen3_tied", "mistral_window")}
    jobs += [(f"s_{n}", checkpoints[n][0], None, str(d), False) for n, d in saves.items()]
    jobs += [(f"o_{n}", checkpoints[n][0], None, "one_stage", True) for n in ("qwen3_tied", "mistral_window")]
    results = run_distributed(_tp_worker, 2, jobs)

    _check_logits(results, checkpoints, {**{n: n for n in CONFIGS}, "qwen3_tied_sp": "qwen3_tied"})
    for key, (name, sp) in grad_keys.items():
        path, ids, _ = checkpoints[name]
        ref_grads, ref_input = _grads(load_from_hf(path, single_process_mesh()), ids)
        for rank, res in enumerate(results):
            grads, input_grad = res[key]
            assert set(grads) == set(ref_grads)
            for param, g in grads.items():
                assert _max_diff(g, ref_grads[param]) <= TOL, f"{key} rank {rank} {param}"
            if not sp:  # under SP the embedding output is this rank's sequence shard
                assert _max_diff(input_grad, ref_input) <= TOL, f"{key} rank {rank} input gradient"
    for name, saved in saves.items():
        path, ids, ref = checkpoints[name]
        before = load_file(path / "model.safetensors")
        after = {}
        for file in saved.glob("*.safetensors"):
            after.update(load_file(file))
        assert sorted(after) == sorted(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(res[f"o_{n}"] for res in results for n in ("qwen3_tied", "mistral_window"))


def test_tp4_kv_replication_matches_transformers(checkpoints):
    names = ["qwen3_tied", "mistral_window"]  # KV replication 4 and 2
    assert [kv_replication_for(load_hf_config(checkpoints[n][0]), 4) for n in names] == [4, 2]
    jobs = [(n, checkpoints[n][0], checkpoints[n][1], "logits", False) for n in names]
    _check_logits(run_distributed(_tp_worker, 4, jobs), checkpoints, {n: n for n in names})


# ------------------------------------------------------------------------------ recipes
def _recipe_problems(overrides: list[str]):
    from plait.config import RecipeError, check_recipe

    with pytest.raises(RecipeError) as info:
        check_recipe(None, overrides, 1)
    return {p.field: str(p) for p in info.value.problems}


def test_recipe_family_builds_that_familys_config():
    from plait.config import check_recipe

    resolved = check_recipe(None, ["model.family=qwen3", "model.head_dim=48"], 1)
    config = resolved.model_config(300)
    assert isinstance(config, Qwen3Config) and config.head_dim == 48 and resolved.family == "qwen3"
    assert config.num_parameters() == resolved.num_parameters(300)
    resolved = check_recipe(None, ["model.family=mistral", "model.sliding_window=32"], 1)
    config = resolved.model_config(300)
    assert isinstance(config, MistralConfig) and config.sliding_window == 32
    assert config.attention_span(resolved.recipe.data.seq_len) == 32


def test_recipe_family_rules_name_the_field():
    found = _recipe_problems(["model.sliding_window=16"])  # llama has no window
    assert "model.sliding_window" in found and "'llama'" in found["model.sliding_window"]
    found = _recipe_problems(["model.family=mistral", "model.attention_bias=true"])
    assert "model.attention_bias" in found and "no biases" in found["model.attention_bias"]
    found = _recipe_problems(["model.family=gpt2"])
    assert "model.family" in found and "'qwen3'" in found["model.family"]


def test_hf_path_gives_the_family_and_a_conflicting_family_is_refused(checkpoints, tmp_path):
    from plait.config import check_recipe

    path = checkpoints["qwen3_tied"][0]
    tokenizer = tmp_path / "tokenizer.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 50)}}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tokenizer))
    resolved = check_recipe(None, [f"model.hf_path={path}", f"data.tokenizer={tokenizer}"], 1)
    assert resolved.family == "qwen3" and isinstance(resolved.model_config(), Qwen3Config)
    assert resolved.as_recipe().model.family == "qwen3"
    found = _recipe_problems([f"model.hf_path={path}", f"data.tokenizer={tokenizer}", "model.family=mistral"])
    assert "model.family" in found and "'qwen3'" in found["model.family"]


def test_plait_convert_keeps_the_family(checkpoints, tmp_path):
    """HF -> plait checkpoint -> HF: the manifest records the family, so a Qwen3 model comes back as
    Qwen3 (its config fields alone are Llama's), bitwise."""
    from plait.checkpoint.convert import hf_to_plait, plait_to_hf

    path = checkpoints["qwen3_tied"][0]
    ckpt = hf_to_plait(path, tmp_path / "ckpt", progress=False)
    out = plait_to_hf(ckpt, tmp_path / "hf", progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    before = load_file(path / "model.safetensors")
    after = {}
    for file in out.glob("*.safetensors"):
        after.update(load_file(file))
    assert sorted(after) == sorted(before) and all(torch.equal(after[k], v) for k, v in before.items())
