"""The KV-cache decoding engine against the full-recompute path and against transformers.

Why: a cache that attends to one wrong slot, a padding mask off by one or a sliding window counted
from the wrong end still produces fluent text; only a token-for-token comparison shows it. Each
check decodes a batch of prompts of different lengths (left padding, per-row positions) with the
cache and compares every row with the same prompt decoded alone without a cache, in fp32:

* greedy and seeded sampling, for every family (Llama, Qwen3, Mistral with a window shorter than
  the generation, Mixtral, Qwen3-MoE);
* under TP=2 with sequence parallelism on and KV replication (one K/V head on two ranks), under
  PP=2 (hidden states passed per decode step), and in the slow suite under TP=2 x PP=2 with a
  window and TP=2 on Qwen3-MoE;
* plait's greedy tokens equal transformers' ``generate`` (with its own cache) on random tiny
  models of each family.

Equality is exact on tokens: the cached and uncached logits differ by float rounding (~1e-7), far
below the gaps between the top logits of these models, so a mismatch is a bug, not noise.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from model_weights import randomize
from plait.inference import Sampling, generate_tokens, generate_uncached
from plait.inference.engine import StopRules
from plait.materialize import build_model, build_stages, load_from_hf
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.llama.parallelize import kv_replication_for
from plait.models.registry import FAMILIES
from plait.pipeline.stages_lm import StagesCausalLM

NEW = 14
PROMPTS = [[3, 14, 15, 9, 26, 5, 35], [7, 1], [5, 5, 5, 5, 5, 5, 5, 8, 9, 60], [42]]
SAMPLING = Sampling(temperature=1.3, top_k=30, top_p=0.9)
SEEDS = [11, 12, 13, 14]


DEEPSEEK = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
                first_k_dense_replace=1)


def _config(family: str, **changes):
    kw = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen3":
        kw["head_dim"] = 16
    if family == "mistral":
        kw["sliding_window"] = 6  # shorter than prompt + generation: the window matters
    if family == "mixtral":
        kw.update(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=7)
    if family == "qwen3_moe":
        kw.update(intermediate_size=24, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2, head_dim=8,
                  mlp_only_layers=[0])
    if family == "gpt_neox":  # no grouped-query attention; half of each head rotates
        kw.update(num_key_value_heads=4, partial_rotary_factor=0.5)
    if family == "gemma3":  # sliding, full, sliding layers: each layer's cache keeps its own window
        kw.update(head_dim=16, sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=12)
    if family == "deepseek_v3":  # latent attention (values narrower than keys), a dense then two MoE layers
        del kw["num_key_value_heads"]
        kw.update(DEEPSEEK)
    return FAMILIES[family].config_cls(**{**kw, **changes})


def _reference(model, sampling=None):
    """Each prompt decoded alone without a cache: greedy, then seeded sampling."""
    greedy = [generate_uncached(model, p, NEW) for p in PROMPTS]
    sampled = [generate_uncached(model, p, NEW, sampling=SAMPLING, seed=s) for p, s in zip(PROMPTS, SEEDS, strict=True)]
    return greedy, sampled


def _cached(model):
    greedy = [c.tokens for c in generate_tokens(model, PROMPTS, NEW)]
    sampled = [c.tokens for c in generate_tokens(model, PROMPTS, NEW, sampling=SAMPLING, seeds=SEEDS)]
    return greedy, sampled


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "mixtral", "qwen3_moe", "gpt_neox", "gemma3",
                                    "deepseek_v3"])
def test_cached_equals_uncached_for_every_family(family):
    model = build_model(_config(family), single_process_mesh(), seed=1)
    assert _cached(model) == _reference(model)
    assert model.training  # the mode and every attribute the engine set are restored
    assert all(getattr(m, "kv_cache", None) is None for m in model.modules())


def test_the_window_and_the_padding_matter():
    """Negative controls: the same model with the window widened decodes differently (so the
    window test above can fail), and a row's tokens do not depend on the rows padded beside it."""
    narrow = build_model(_config("mistral"), single_process_mesh(), seed=1)
    wide = build_model(_config("mistral", sliding_window=64), single_process_mesh(), seed=1)
    assert _cached(narrow)[0] != _cached(wide)[0]
    alone = [generate_tokens(narrow, [p], NEW)[0].tokens for p in PROMPTS]
    assert alone == _cached(narrow)[0]


def test_moe_capacity_is_off_while_decoding():
    model = build_model(_config("mixtral"), single_process_mesh(), seed=1)
    layers = [m for m in model.modules() if type(m).__name__ == "MoELayer"]
    for layer in layers:
        layer.capacity_factor = 0.5
    dropless = build_model(_config("mixtral"), single_process_mesh(), seed=1)
    assert _cached(model)[0] == _cached(dropless)[0]
    assert all(layer.capacity_factor == 0.5 for layer in layers)


def test_stop_rules_and_budgets():
    model = build_model(_config("llama"), single_process_mesh(), seed=1)
    free = generate_tokens(model, PROMPTS, NEW)
    eos = free[0].tokens[3]
    stopped = generate_tokens(model, PROMPTS, NEW, stop=StopRules(eos_ids=frozenset({eos})))
    assert stopped[0].tokens == free[0].tokens[:4] and stopped[0].finish_reason == "eos"
    for s, f in zip(stopped[1:], free[1:], strict=True):  # other rows run on until their own eos or budget
        cut = f.tokens.index(eos) + 1 if eos in f.tokens else len(f.tokens)
        assert s.tokens == f.tokens[:cut]
    budgets = generate_tokens(model, PROMPTS, [1, 0, 5, NEW])
    assert [len(c.tokens) for c in budgets] == [1, 0, 5, NEW]
    assert [c.tokens for c in budgets] == [f.tokens[:n] for f, n in zip(free, [1, 0, 5, NEW], strict=True)]
    text = lambda ids: " ".join(map(str, ids))  # noqa: E731 - a toy tokenizer: ids as words
    target = text(free[2].tokens[2:4])
    cut = generate_tokens(model, PROMPTS, NEW, stop=StopRules(stop_strings=(target,), decode=text))
    assert cut[2].finish_reason == "stop_string" and target not in cut[2].text
    assert cut[2].text == text(free[2].tokens)[:text(free[2].tokens).find(target)]
    calls = []
    halted = generate_tokens(model, PROMPTS, NEW, should_stop=lambda: calls.append(1) or True, check_every=4)
    assert [len(c.tokens) for c in halted] == [4] * 4 and {c.finish_reason for c in halted} == {"stopped"}


def test_bad_requests_name_the_problem():
    model = build_model(_config("llama"), single_process_mesh(), seed=1)
    with pytest.raises(ValueError, match=r"prompt 0 is 7 tokens and asks for 60 .*max_position_embeddings=64.*at "
                                         r"most 57"):
        generate_tokens(model, PROMPTS, 60)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_tokens(model, [[1], []], 2)
    with pytest.raises(ValueError, match="token id 61, outside the model's vocabulary"):
        generate_tokens(model, [[61]], 2)
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for 4 prompts"):
        generate_tokens(model, PROMPTS, [1, 2])
    with pytest.raises(ValueError, match="stop_strings need decode"):
        StopRules(stop_strings=("x",))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)


# ------------------------------------------------------------------------------- parallel layouts
def _layout_worker(rank: int, world: int, family: str, tp: int, pp: int, sp: bool, changes: dict):
    config = _config(family, **changes)
    mesh = ParallelMesh(world, rank, tp=tp, pp=pp, kv_replication=kv_replication_for(config, tp))
    layers = [[0, 1], [2]] if pp == 2 else [[0, 1, 2]]
    stages = build_stages(config, mesh, layers, seed=1, sequence_parallel=sp)
    return _cached(StagesCausalLM(stages, mesh))


LAYOUTS = {
    # one K/V head: each TP rank holds a replica of it; sequence parallelism on
    "tp2_sp_kv_replication": ("llama", 2, 1, True, dict(num_key_value_heads=1)),
    "pp2": ("qwen3", 1, 2, False, {}),
    "tp2_pp2_window": ("mistral", 2, 2, True, {}),
    "tp2_moe": ("qwen3_moe", 2, 1, True, {}),
    # the latent cache with each rank's heads of kv_b_proj (sequence parallelism off while decoding)
    "tp2_latent": ("deepseek_v3", 2, 1, True, {}),
}
#: run by the slow suite only (4 ranks, and further TP cases)
SLOW_LAYOUTS = ("tp2_pp2_window", "tp2_moe", "tp2_latent")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n
                                  for n in LAYOUTS])
def test_cached_under_tp_and_pp_equals_one_process(name):
    family, tp, pp, sp, changes = LAYOUTS[name]
    reference = _reference(build_model(_config(family, **changes), single_process_mesh(), seed=1))
    results = run_distributed(_layout_worker, tp * pp, family, tp, pp, sp, changes)
    for result in results:
        assert result == reference


# ------------------------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers")

HF = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=6)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=16, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(intermediate_size=24, moe_intermediate_size=8,
                                                                num_experts=4, num_experts_per_tok=2, head_dim=8)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(num_key_value_heads=4, rotary_pct=0.5)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
                                                            layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(DEEPSEEK, num_key_value_heads=4,
                                                                      n_group=1, rope_interleave=False)),
}


@pytest.mark.parametrize("family", list(HF))
def test_greedy_equals_transformers_generate(family, tmp_path):
    model_cls, config_cls, extra = HF[family]
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config = getattr(transformers, config_cls)(**{**base, **extra})
    hf = getattr(transformers, model_cls)(config)
    randomize(hf, seed=3)
    hf.eval().save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    plait = load_from_hf(tmp_path, single_process_mesh())
    ours = generate_tokens(plait, PROMPTS, NEW)
    for prompt, completion in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                 use_cache=True, pad_token_id=0)
        assert completion.tokens == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_a_forward_of_several_positions_into_a_filled_cache_is_causal(family):
    """The engine feeds one token per step, but the cache serves any chunk: three positions after
    a prefilled prompt see only themselves and earlier slots (the same logits as one at a time),
    for the generic cache and the latent one."""
    from plait.inference.attach import decoding
    from plait.inference.kv_cache import KVCache

    model = build_model(_config(family), single_process_mesh(), seed=1)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35]])
    outs = []
    for chunks in ([4, 3], [4, 1, 1, 1]):
        cache = KVCache(1, 7, torch.zeros(1, dtype=torch.long))
        pieces = []
        with decoding(model, cache), torch.no_grad():
            start = 0
            for n in chunks:
                cache.begin(n)
                pieces.append(model(ids[:, start:start + n], position_ids=cache.positions(n)))
                cache.advance(n)
                start += n
        outs.append(torch.cat(pieces, dim=1))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    model.eval()
    with decoding(model, KVCache(1, 7, torch.zeros(1, dtype=torch.long))):
        pass
    assert not model.training  # a model in eval mode stays in eval mode


def test_latent_attention_caches_the_latent_not_the_heads(monkeypatch):
    """DeepSeek-V3's attention modules get the latent cache and their cores none; what it holds per
    token is ``kv_lora_rank + qk_rope_head_dim`` numbers, and its absorbed attention is what ran."""
    from plait.inference.attach import attention_cores, decoding, latent_attentions
    from plait.inference.kv_cache import KVCache
    from plait.inference.latent_cache import LatentKVCache

    config = _config("deepseek_v3")
    model = build_model(config, single_process_mesh(), seed=1)
    assert len(latent_attentions(model)) == config.num_hidden_layers and attention_cores(model) == []
    calls = []
    original = LatentKVCache.__call__
    monkeypatch.setattr(LatentKVCache, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    cache = KVCache(2, 9, torch.zeros(2, dtype=torch.long))
    with decoding(model, cache) as layers, torch.no_grad():
        assert layers == config.num_hidden_layers
        caches = [m.latent_cache for m in latent_attentions(model)]
        cache.begin(5)
        model(torch.randint(0, config.vocab_size, (2, 5)), position_ids=cache.positions(5))
        cache.advance(5)
    assert len(calls) == config.num_hidden_layers
    for layer in caches:
        assert isinstance(layer, LatentKVCache)
        assert layer.latents.shape == (2, 9, config.kv_lora_rank)
        assert layer.rope_keys.shape == (2, 9, config.qk_rope_head_dim)
    assert all(m.latent_cache is None for m in latent_attentions(model))
