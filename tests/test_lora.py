"""Tensor-parallel LoRA (plait.lora) against PEFT and against one process.

Why: an adapter is only useful if it computes what PEFT's does on the same base weights, and if
every layout trains the same adapter. The reference is plait's unsharded model (plain
``nn.Linear`` projections) with LoRA on all seven projections, checked first against PEFT's LoRA on
transformers' ``LlamaForCausalLM`` (logits, loss and every adapter gradient). TP=2 with KV
replication (1 KV head), with and without sequence parallelism, and TP=4 with KV replication and
with head padding must give the same logits and, on every rank, each local adapter gradient equal
to its slice of the reference gradient (so replicated K/V rows agree and padding rows stay zero).
The adapter saved from TP=2 must load into PEFT, a PEFT adapter must load into TP=2, and merging
must reproduce the adapted logits.

Tolerance: max |diff| <= 1e-5 in fp32; the weights are identical and only the order of sums differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from lora_models import CONFIGS, SETTINGS, set_adapters
from plait.lora import (
    LoraApplyError,
    LoraSettings,
    LoraSettingsError,
    PeftAdapterError,
    apply_lora,
    load_peft_adapter,
    lora_parameters,
    merge_lora_,
    read_peft_settings,
    save_peft_adapter,
)
from plait.lora.apply import adapted
from plait.materialize import build_model, build_stages
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.models.llama.config import LlamaConfig
from plait.models.llama.model import LlamaForCausalLM
from plait.models.llama.parallelize import kv_replication_for
from plait.parallel_state import shard_specs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-5
BASE_SEED, LORA_SEED = 11, 7


def _ids(config: LlamaConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _random_adapters(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Non-zero full A and B for every adapter of ``model`` (the unsharded one): B = 0 would hide
    every bug in the B path and in the gradients of A."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for proj, adapter in adapted([model]):
        out[f"{proj.name}.lora.A"] = 0.2 * torch.randn(adapter.full_a_shape, generator=gen)
        out[f"{proj.name}.lora.B"] = 0.2 * torch.randn(adapter.full_b_shape, generator=gen)
    return out


def _plain_model(config: LlamaConfig) -> LlamaForCausalLM:
    """The unsharded model (plain nn.Linear projections) with the layout-invariant base weights."""
    model = LlamaForCausalLM(config)
    model.load_state_dict(build_model(config, single_process_mesh(), seed=BASE_SEED).state_dict())
    return model


def _lora_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(ids, ids)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in lora_parameters([model])}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict]:
    """Per config: ids, full adapters, the unsharded model's initial A, logits, loss and adapter grads."""
    out = {}
    for i, (name, config) in enumerate(CONFIGS.items()):
        model = _plain_model(config)
        apply_lora([model], SETTINGS, seed=LORA_SEED)
        init = {n: p.detach().clone() for n, p in lora_parameters([model])}
        adapters = _random_adapters(model, seed=100 + i)
        set_adapters([model], adapters)
        ids = _ids(config)
        with torch.no_grad():
            logits = model(ids)
        loss, grads = _lora_grads(model, ids)
        out[name] = dict(config=config, ids=ids, adapters=adapters, init=init, logits=logits, loss=loss, grads=grads)
    hf_dir = tmp_path_factory.mktemp("lora") / "base"
    save_hf_checkpoint(build_model(CONFIGS["mqa"], single_process_mesh(), seed=BASE_SEED), hf_dir,
                       single_process_mesh().info("tp"))
    out["mqa"]["hf_dir"] = hf_dir
    return out


def _hf_base(path: Path) -> torch.nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _peft_model(ref: dict) -> torch.nn.Module:
    config = peft.LoraConfig(r=SETTINGS.rank, lora_alpha=SETTINGS.alpha, lora_dropout=0.0,
                             target_modules=list(SETTINGS.target_modules), use_rslora=SETTINGS.rslora)
    model = peft.get_peft_model(_hf_base(ref["hf_dir"]), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(ref["adapters"][_plait_name(name)])
    return model


def _plait_name(peft_name: str) -> str:
    """base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> ...q_proj.lora.A"""
    module, rest = peft_name.removeprefix("base_model.model.").split(".lora_")
    return f"{module}.lora.{rest[0]}"


# ------------------------------------------------------------------------------ one process
def test_tp1_matches_peft_on_transformers(reference):
    ref = reference["mqa"]
    model = _peft_model(ref)
    ids = ref["ids"]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert _max_diff(out.logits.detach(), ref["logits"]) <= TOL
    assert abs(out.loss.item() - ref["loss"].item()) <= TOL
    grads = {_plait_name(n): p.grad for n, p in model.named_parameters() if ".lora_" in n}
    assert set(grads) == set(ref["grads"]) and len(grads) == 2 * 7 * 2
    for name, g in grads.items():
        assert _max_diff(g, ref["grads"][name]) <= TOL, name
    # negative control: the adapters change the logits, so the parity above is not the base model's
    with torch.no_grad():
        assert _max_diff(_hf_base(ref["hf_dir"])(ids).logits, ref["logits"]) > 1e-3


def test_tp1_parallel_layers_match_the_plain_model(reference):
    """The TP=1 model (parallel layers on a 1-rank group, fused projections) equals plain nn.Linear."""
    ref = reference["mqa"]
    model = build_model(ref["config"], single_process_mesh(), seed=BASE_SEED)
    assert apply_lora([model], SETTINGS, seed=LORA_SEED) == 14
    for name, p in lora_parameters([model]):
        assert torch.equal(p, ref["init"][name]), name
    set_adapters([model], ref["adapters"])
    loss, grads = _lora_grads(model, ref["ids"])
    assert abs(loss.item() - ref["loss"].item()) <= TOL
    for name, g in grads.items():
        assert _max_diff(g, ref["grads"][name]) <= TOL, name


def test_only_adapters_train_and_init_starts_at_the_base_model(reference):
    config = CONFIGS["mqa"]
    model = _plain_model(config)
    ids = _ids(config)
    with torch.no_grad():
        base = model(ids)
    assert apply_lora([model], LoraSettings(rank=2, target_modules=("q_proj", "down_proj")), seed=1) == 4
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters([model])}
    assert trainable == {f"model.layers.{i}.{m}.lora.{ab}" for i in range(2)
                         for m in ("self_attn.q_proj", "mlp.down_proj") for ab in "AB"}
    with torch.no_grad():
        assert torch.equal(model(ids), base)  # B starts at zero
    for name, p in lora_parameters([model]):
        assert bool((p != 0).any()) if name.endswith(".A") else bool((p == 0).all()), name  # A drawn, B zero
    with pytest.raises(LoraApplyError, match="already has a LoRA adapter"):
        apply_lora([model], SETTINGS, seed=1)


def test_pipeline_stages_get_the_full_models_adapters(reference):
    """Two pipeline ranks' stages (built in one process) hold exactly the unsharded model's initial A."""
    config = CONFIGS["mqa"]
    merged = {}
    for rank in range(2):
        mesh = ParallelMesh(2, rank, pp=2, create_groups=False)
        stages = build_stages(config, mesh, [[0], [1]], seed=BASE_SEED)
        assert apply_lora(stages, SETTINGS, seed=LORA_SEED) == 7
        merged.update({n: p.detach() for n, p in lora_parameters(stages)})
    assert merged.keys() == reference["mqa"]["init"].keys()
    for name, p in merged.items():
        assert torch.equal(p, reference["mqa"]["init"][name]), name


def test_merge_equals_the_adapted_model(reference):
    ref = reference["mqa"]
    model = _plain_model(ref["config"])
    apply_lora([model], SETTINGS, seed=LORA_SEED)
    set_adapters([model], ref["adapters"])
    assert merge_lora_([model]) == 14
    assert not lora_parameters([model]) and all("lora" not in n for n, _ in model.named_parameters())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert _max_diff(model(ref["ids"]), ref["logits"]) <= TOL


def test_bf16_base_with_fp32_adapters_and_dropout_streams():
    config = CONFIGS["mqa"]
    model = _plain_model(config).to(torch.bfloat16)
    apply_lora([model], LoraSettings(rank=2, dropout=0.5), seed=1)
    adapter = model.model.layers[0].self_attn.q_proj.lora
    assert adapter.A.dtype == torch.float32 and model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    set_adapters([model], _random_adapters(model, seed=3))
    ids = _ids(config)
    assert model(ids).dtype == torch.bfloat16
    # dropout: off in eval mode, from the global generator in training mode (reproducible by seed)
    with torch.no_grad():
        eval_out = model.eval()(ids)
        model.train()
        torch.manual_seed(0)
        a = model(ids)
        torch.manual_seed(0)
        b = model(ids)
    assert torch.equal(a, b) and not torch.equal(a, eval_out)


def test_bad_settings_name_the_field_and_value():
    cases = [(dict(rank=0), "lora.rank=0"), (dict(alpha=-1.0), "lora.alpha=-1.0"),
             (dict(dropout=1.0), "lora.dropout=1.0"), (dict(target_modules=()), "lora.target_modules=\\[\\]"),
             (dict(target_modules=("q_proj", "qkv")), "'qkv'"), (dict(target_modules=("q_proj", "q_proj")), "once"),
             (dict(rank=True), "lora.rank=True")]
    for kwargs, pattern in cases:
        with pytest.raises(LoraSettingsError, match=pattern):
            LoraSettings(**kwargs)
    with pytest.raises(LoraSettingsError) as info:  # every problem at once
        LoraSettings(rank=-2, dropout=2.0)
    assert "lora.rank=-2" in str(info.value) and "lora.dropout=2.0" in str(info.value)
    assert LoraSettings(rank=16, alpha=8.0, rslora=True).scale == 2.0


def test_peft_adapter_round_trip_and_refusals(reference, tmp_path):
    ref = reference["mqa"]
    model = _plain_model(ref["config"])
    apply_lora([model], SETTINGS, seed=LORA_SEED)
    set_adapters([model], ref["adapters"])
    save_peft_adapter([model], tmp_path / "a", single_process_mesh().info("tp"), "tiny-base")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-base"
    assert read_peft_settings(tmp_path / "a") == SETTINGS
    other = _plain_model(ref["config"])
    apply_lora([other], LoraSettings(rank=2, alpha=8.0), seed=1)
    with pytest.raises(PeftAdapterError, match="r=4"):
        load_peft_adapter([other], tmp_path / "a")
    config["use_dora"] = True
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(PeftAdapterError, match="use_dora=True"):
        read_peft_settings(tmp_path / "a")


# ------------------------------------------------------------------------------ several ranks
def _build(config: LlamaConfig, world: int, rank: int, sp: bool) -> tuple[torch.nn.Module, ParallelMesh]:
    mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
    return build_model(config, mesh, seed=BASE_SEED, sequence_parallel=sp), mesh


def _worker(rank: int, world: int, jobs: list[tuple]) -> dict:
    out: dict = {}
    for key, task, config, sp, adapters, path in jobs:
        model, mesh = _build(config, world, rank, sp)
        if task == "load":  # a PEFT directory into the sharded adapters
            apply_lora([model], read_peft_settings(path), seed=123)
            load_peft_adapter([model], path)
            with torch.no_grad():
                out[key] = model(_ids(config))
            continue
        apply_lora([model], SETTINGS, seed=LORA_SEED)
        init = {n: (p.detach().clone(), shard_specs(model).get(n)) for n, p in lora_parameters([model])}
        set_adapters([model], adapters)
        if task == "save":
            save_peft_adapter([model], path, mesh.info("tp"), "tiny-base")
            out[key] = True
        elif task == "merge":
            merge_lora_([model])
            with torch.no_grad():
                out[key] = model(_ids(config))
        else:  # grads: logits, then each rank's local adapter gradients with their specs
            ids = _ids(config)
            with torch.no_grad():
                logits = model(ids)
            model(ids, ids).backward()
            specs = shard_specs(model)
            frozen_with_grad = [n for n, p in model.named_parameters() if "lora" not in n and p.grad is not None]
            grads = {n: (p.grad.detach().clone(), specs.get(n)) for n, p in lora_parameters([model])}
            out[key] = dict(logits=logits, grads=grads, init=init, frozen_with_grad=frozen_with_grad)
    dist.barrier()
    return out


def _check_grads(results: list[dict], reference: dict, keys: dict[str, str]) -> None:
    for key, name in keys.items():
        ref = reference[name]
        for rank, res in enumerate(results):
            got = res[key]
            assert _max_diff(got["logits"], ref["logits"]) <= TOL, f"{key} rank {rank} logits"
            assert not got["frozen_with_grad"], got["frozen_with_grad"]
            assert got["grads"].keys() == ref["grads"].keys()
            for param, (g, spec) in got["grads"].items():
                want = spec.shard(ref["grads"][param]) if spec is not None else ref["grads"][param]
                assert _max_diff(g, want) <= TOL, f"{key} rank {rank} {param}"
                start, start_spec = got["init"][param]
                init = ref["init"][param]
                assert torch.equal(start, start_spec.shard(init) if start_spec is not None else init), param


def test_tp2_kv_replication_sp_peft_export_import_and_merge(reference, tmp_path):
    ref = reference["mqa"]
    config, adapters = ref["config"], ref["adapters"]
    peft_dir = tmp_path / "from_peft"
    _peft_model(ref).save_pretrained(peft_dir)
    jobs = [("g", "grads", config, False, adapters, None), ("g_sp", "grads", config, True, adapters, None),
            ("save", "save", config, False, adapters, str(tmp_path / "from_tp2")),
            ("load", "load", config, True, None, str(peft_dir)),
            ("merge", "merge", config, True, adapters, None)]
    results = run_distributed(_worker, 2, jobs)
    _check_grads(results, reference, {"g": "mqa", "g_sp": "mqa"})
    # 1 KV head at TP=2: both ranks hold K/V head 0, and the specs say so (the norm counts it once)
    k_spec = results[0]["g"]["grads"]["model.layers.0.self_attn.k_proj.lora.B"][1]
    assert k_spec.replicas == 2
    for rank, res in enumerate(results):
        assert _max_diff(res["load"], ref["logits"]) <= TOL, f"rank {rank}: PEFT adapter read at TP=2"
        assert _max_diff(res["merge"], ref["logits"]) <= TOL, f"rank {rank}: merged at TP=2"
    exported = peft.PeftModel.from_pretrained(_hf_base(ref["hf_dir"]), tmp_path / "from_tp2")
    with torch.no_grad():
        assert _max_diff(exported(ref["ids"]).logits, ref["logits"]) <= TOL


def test_tp4_kv_replication_and_head_padding(reference):
    jobs = [("gqa", "grads", CONFIGS["gqa"], True, reference["gqa"]["adapters"], None),
            ("heads6", "grads", CONFIGS["heads6"], False, reference["heads6"]["adapters"], None)]
    assert kv_replication_for(CONFIGS["gqa"], 4) == 2
    results = run_distributed(_worker, 4, jobs)
    _check_grads(results, reference, {"gqa": "gqa", "heads6": "heads6"})
    q_b = "model.layers.0.self_attn.q_proj.lora.B"
    padded = [spec for res in results if (spec := res["heads6"]["grads"][q_b][1]) is not None and -1 in spec.index]
    assert padded, "the heads6 layout at TP=4 should pad query heads"
