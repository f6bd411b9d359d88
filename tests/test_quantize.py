"""QLoRA's quantized base (plait.quantize): the values, the tensor every layer reads, every TP layout.

* Each row plait quantizes equals torchao's ``to_nf4`` of that row, bitwise (the reference NF4
  quantizer: same code book, rounding and double-quantized scales).
* Any set of rows quantizes exactly as those rows of the full weight, which is what makes a TP
  rank's slice hold the values one process holds; at TP=2 (KV replication, sequence parallelism)
  and TP=4 (head padding) every rank's dequantized projection is bitwise the slice of the plain
  model's, and logits and adapter gradients equal the plain quantized model's.
* The :class:`QuantizedWeight` is the dense weight to every operator, and autograd keeps the
  quantized form (not a dense copy) for the input gradient.
* Bad inputs are refused before launch, naming the field.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from lora_models import CONFIGS, SETTINGS, set_adapters
from plait.config import RecipeError, validate_recipe
from plait.lora import LoraSettings, apply_lora, lora_parameters, merge_lora_
from plait.lora.apply import LoraApplyError, adapted
from plait.materialize import build_model
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.llama.config import LlamaConfig
from plait.models.llama.parallelize import kv_replication_for
from plait.quantize import (
    QuantizedWeight,
    QuantizeError,
    dequantize_base_,
    quantize_base_,
    quantize_rows,
    quantized_weights,
)

torchao_quantization = pytest.importorskip("torchao.quantization")

TOL = 1e-5
BLOCK = 16


# ------------------------------------------------------------------------------ the values
@pytest.mark.parametrize("length,block", [(576, 64), (1536, 64), (64, 16), (128, 32), (48, 48)])
def test_each_row_equals_torchaos_nf4_of_that_row_bitwise(length, block):
    weight = 0.02 * torch.randn(23, length, generator=torch.Generator().manual_seed(length + block))
    mine = quantize_rows(weight, "nf4", block).dequantize()
    for i in range(weight.shape[0]):
        reference = torchao_quantization.to_nf4(weight[i].clone(), block, length // block).get_original_weight()
        assert torch.equal(mine[i], reference), f"row {i}"
    assert 0 < (mine - weight).abs().max() < 0.25 * weight.abs().max()  # quantized, not copied


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_any_rows_quantize_as_in_the_full_weight_and_zero_rows_stay_zero(method):
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    weight[7] = 0  # a padding row
    full = quantize_rows(weight, method, 32).dequantize()
    assert torch.equal(full[7], torch.zeros(96))
    for rows in ([0, 1, 2], list(range(20, 40)), [39, 3, 7, 3]):  # slices, a replicated row
        assert torch.equal(quantize_rows(weight[rows], method, 32).dequantize(), full[rows]), rows
    error = (full - weight).abs().max() / weight.abs().max()
    assert error < (0.2 if method == "nf4" else 0.01), error


def test_storage_is_a_quarter_of_bf16_at_smollm2s_widths():
    for length in (576, 1536):
        rows = quantize_rows(torch.randn(8, length), "nf4", 64)
        assert rows.nbytes() / (8 * length * 2) < 0.27
    assert quantize_rows(torch.randn(8, 576), "int8", 64).nbytes() / (8 * 576 * 2) < 0.54


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not split into blocks of 64"):
        quantize_rows(torch.randn(4, 96), "nf4", 64)
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_rows(torch.randn(4, 64), "fp4", 64)


# ------------------------------------------------------------------------------ the tensor
def test_quantized_weight_is_the_dense_weight_and_autograd_keeps_it_quantized():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    for transposed in (False, True):
        rows = quantize_rows(weight.t() if transposed else weight, "nf4", 16)
        q = QuantizedWeight(rows, transposed, torch.float32)
        dense = q.dense()
        assert q.shape == dense.shape == weight.shape
        x = torch.randn(3, 5, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            y = F.linear(x, q)
        y_ref = F.linear(x_ref, dense)
        assert torch.equal(y, y_ref)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)
        assert any(isinstance(t, QuantizedWeight) for t in saved)
        assert not any(type(t) is torch.Tensor and t.numel() == weight.numel() for t in saved), "a dense copy"
        half = q.to(torch.bfloat16)
        assert isinstance(half, QuantizedWeight) and half.dtype == torch.bfloat16
        assert torch.equal(half.dense(), dense.to(torch.bfloat16))
        assert isinstance(q.t(), QuantizedWeight) and torch.equal(q.t().dense(), dense.t())
        assert isinstance(q.detach(), QuantizedWeight)


def test_quantized_weight_moves_copies_and_refuses_writes():
    """Moving it (``.to(device)``, ``module.to``), cloning and deep-copying keep it quantized; an
    integer dtype gets the dense values; an in-place write (which would land in a dense temporary
    and be lost) is refused."""
    import copy

    from plait.quantize.tensor import QuantizedWeightWriteError

    q = QuantizedWeight(quantize_rows(torch.randn(8, 64), "nf4", 16), False, torch.float32)
    for moved in (q.to("meta"), q.to("cpu", copy=True), q.clone(), copy.deepcopy(q)):
        assert isinstance(moved, QuantizedWeight), type(moved)
    assert torch.equal(copy.deepcopy(q).dense(), q.dense())
    assert type(q.to(torch.int8)) is torch.Tensor
    module = torch.nn.Linear(64, 8)
    del module._parameters["weight"]
    module.register_buffer("weight", q, persistent=False)
    assert isinstance(module.to("meta").weight, QuantizedWeight)
    dense = q.dense()
    for write in (lambda: q.add_(1.0), lambda: q.copy_(torch.zeros(8, 64)), lambda: torch.nn.init.normal_(q),
                  lambda: q.zero_()):
        with pytest.raises(QuantizedWeightWriteError, match="dequantize the base first"):
            write()
    assert torch.equal(q.dense(), dense)
    target = torch.zeros(8, 64)
    target.copy_(q)  # reading it into another tensor is fine
    assert torch.equal(target, dense)


def _plain_lora_model(config: LlamaConfig, seed: int = 11) -> torch.nn.Module:
    model = build_model(config, single_process_mesh(), seed=seed)
    apply_lora([model], SETTINGS, seed=7)
    set_adapters([model], _adapters(model))
    return model


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"{proj.name}.lora.{k}": 0.2 * torch.randn(shape, generator=gen) for proj, adapter in adapted([model])
            for k, shape in (("A", adapter.full_a_shape), ("B", adapter.full_b_shape))}


def _ids(config: LlamaConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))


def test_quantized_model_equals_its_dequantized_twin_and_refuses_misuse():
    config = CONFIGS["mqa"]
    quantized, twin = _plain_lora_model(config), _plain_lora_model(config)
    summary = quantize_base_([quantized], "nf4", block_size=BLOCK)
    assert summary.projections == 14 and summary.of_bf16() < 0.45  # blocks of 16 in 32-wide rows
    quantize_base_([twin], "nf4", block_size=BLOCK)
    assert dequantize_base_([twin]) == 14
    ids = _ids(config)
    loss_q, loss_t = quantized(ids, ids), twin(ids, ids)
    loss_q.backward()
    loss_t.backward()
    assert torch.equal(loss_q, loss_t)
    grads_t = dict(lora_parameters([twin]))
    for name, p in lora_parameters([quantized]):
        assert torch.equal(p.grad, grads_t[name].grad), name
    assert not any(p.requires_grad for n, p in quantized.named_parameters() if ".lora." not in n)
    assert "model.layers.0.self_attn.q_proj.weight" not in quantized.state_dict()  # re-read on resume
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_base_([quantized], "nf4", block_size=BLOCK)
    with pytest.raises(LoraApplyError, match="stored quantized"):
        merge_lora_([quantized])
    with pytest.raises(QuantizeError, match="requires_grad"):
        quantize_base_([build_model(config, single_process_mesh(), seed=1)], "nf4", block_size=BLOCK)
    with pytest.raises(QuantizeError, match="blocks of 64"):
        quantize_base_([_plain_lora_model(config)], "nf4", block_size=64)


# ------------------------------------------------------------------------------ tensor parallelism
def _tp_worker(rank: int, world: int, jobs: list[tuple]) -> dict:
    out: dict = {}
    for key, config, sp, adapters in jobs:
        mesh = ParallelMesh(world, rank, tp=world, kv_replication=kv_replication_for(config, world))
        model = build_model(config, mesh, seed=11, sequence_parallel=sp)
        apply_lora([model], SETTINGS, seed=7)
        set_adapters([model], adapters)
        quantize_base_([model], "nf4", block_size=BLOCK)
        ids = _ids(config)
        with torch.no_grad():
            logits = model(ids)
        model(ids, ids).backward()
        specs = {proj.name: proj.module.weight_spec for proj, _ in adapted([model])}
        out[key] = dict(logits=logits, weights={n: (w.dense(), specs[n]) for n, w in quantized_weights([model])},
                        grads={n: p.grad.clone() for n, p in lora_parameters([model])},
                        grad_specs={n: s for n, s in _adapter_specs(model).items()})
    dist.barrier()
    return out


def _adapter_specs(model: torch.nn.Module) -> dict:
    out = {}
    for proj, adapter in adapted([model]):
        out[f"{proj.name}.lora.A"], out[f"{proj.name}.lora.B"] = adapter.a_spec, adapter.b_spec
    return out


@pytest.mark.parametrize("world,name,sp", [(2, "mqa", True), (4, "heads6", False)], ids=["tp2-kv-sp", "tp4-padding"])
def test_every_tp_rank_holds_the_slice_of_the_full_quantized_weight(world, name, sp):
    config = CONFIGS[name]
    reference = _plain_lora_model(config)
    adapters = _adapters(reference)
    quantize_base_([reference], "nf4", block_size=BLOCK)
    full = {n: w.dense() for n, w in quantized_weights([reference])}
    ids = _ids(config)
    with torch.no_grad():
        logits = reference(ids)
    reference(ids, ids).backward()
    grads = {n: p.grad for n, p in lora_parameters([reference])}
    results = run_distributed(_tp_worker, world, [(name, config, sp, adapters)])
    padded = 0
    for rank, res in enumerate(results):
        got = res[name]
        assert (got["logits"] - logits).abs().max() <= TOL, f"rank {rank} logits"
        assert got["weights"].keys() == full.keys()
        for proj, (local, spec) in got["weights"].items():
            assert torch.equal(local, spec.shard(full[proj])), f"rank {rank} {proj}: not the full weight's values"
            padded += -1 in spec.index
        for param, g in got["grads"].items():
            spec = got["grad_specs"][param]
            want = spec.shard(grads[param]) if spec is not None else grads[param]
            assert (g - want).abs().max() <= TOL, f"rank {rank} {param}"
    assert padded or world == 2, "the heads6 layout at TP=4 should pad query heads"


# ------------------------------------------------------------------------------ bad input
def _problems(items: dict, world: int = 1) -> str:
    with pytest.raises(RecipeError) as e:
        validate_recipe(items, world)
    return str(e.value)


def test_bad_recipes_are_refused_naming_the_field():
    assert "lora.quantize_base" in _problems({"lora": {"quantize_base": "nf4"}})  # no LoRA
    text = _problems({"lora": {"rank": 4, "quantize_block_size": 32}})  # not quantized: the size does nothing
    assert "lora.quantize_block_size" in text and "lora.quantize_base is 'none'" in text, text
    assert "lora.quantize_base" in _problems({"lora": {"rank": 4, "quantize_base": "fp4"}})
    text = _problems({"lora": {"rank": 4, "quantize_base": "nf4", "quantize_block_size": 48},
                      "model": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}})
    assert "lora.quantize_block_size" in text and "hidden_size=64" in text
    text = _problems({"lora": {"rank": 4, "quantize_base": "nf4", "target_modules": ["q_proj"]},
                      "model": {"family": "mixtral"}})
    assert "lora.quantize_base" in text and "mixtral" in text and "experts" in text, text
    assert "train.compile" in _problems({"lora": {"rank": 4, "quantize_base": "nf4"}, "train": {"compile": True}})
    resolved = validate_recipe({"lora": {"rank": 4, "quantize_base": "int8"}, "parallel": {"zero": 3, "dp": 2,
                                                                                          "tp": 1}}, 2)
    assert any("stay whole on every data-parallel rank" in w for w in resolved.warnings), resolved.warnings
    validate_recipe({"lora": {"rank": 4, "quantize_base": "nf4"}}, 2)  # the default model quantizes


def _family_configs() -> dict:
    from plait.models.gemma3 import Gemma3Config
    from plait.models.gpt_neox import GPTNeoXConfig
    return {
        "gpt_neox": GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                  tie_word_embeddings=False),
        "gemma3": Gemma3Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                               sliding_window=4, sliding_window_pattern=2, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("family", ["gpt_neox", "gemma3"])
def test_other_dense_families_quantize_every_block_matrix(family):
    """GPT-NeoX (fused query_key_value, plain MLP, biases) and Gemma 3: nothing in a block is left
    unquantized, and the quantized model computes what its dequantized twin does."""
    from plait.config.rules.quantize import _unquantizable_layers

    config = _family_configs()[family]
    assert _unquantizable_layers(config) == []
    targets = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h") if family == "gpt_neox" else \
        SETTINGS.target_modules
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=targets)
    models = []
    for _ in range(2):
        model = build_model(config, single_process_mesh(), seed=3)
        apply_lora([model], settings, seed=7)
        set_adapters([model], _adapters(model))
        quantize_base_([model], "nf4", block_size=BLOCK)
        models.append(model)
    dequantize_base_([models[1]])
    ids = _ids(config)
    with torch.no_grad():
        assert torch.equal(models[0](ids), models[1](ids))


# ------------------------------------------------------------------------------ the streamed build
@pytest.mark.parametrize("source", ["init", "hf"])
def test_the_streamed_build_quantizes_the_values_of_the_whole_build(source, tmp_path):
    """A QLoRA run builds its stages with placeholders and reads each projection only when it is
    quantized (plait.deferred): the quantized values and every other weight equal those of the
    whole build, from the seeded initialisation and from a Hugging Face directory, at PP=2's stages."""
    from plait.materialize import build_stages, build_stages_deferred
    from plait.models.hf_io import save_hf_checkpoint

    config = CONFIGS["heads6"]
    hf = None
    if source == "hf":
        hf = tmp_path / "hf"
        save_hf_checkpoint(build_model(config, single_process_mesh(), seed=21), hf, single_process_mesh().info("tp"))
    layers = [[0], [1]]
    whole = build_stages(config, single_process_mesh(), layers, seed=11, hf_path=hf)
    streamed, values = build_stages_deferred(config, single_process_mesh(), layers, seed=11, hf_path=hf)
    for stages, vals in ((whole, None), (streamed, values)):
        apply_lora(stages, SETTINGS, seed=7)
        quantize_base_(stages, "nf4", block_size=BLOCK, values=vals)
    assert not values.left_in(streamed)
    want = {n: w.dense() for n, w in quantized_weights(whole)}
    got = {n: w.dense() for n, w in quantized_weights(streamed)}
    assert want.keys() == got.keys() and all(torch.equal(got[n], want[n]) for n in want)
    for a, b in zip(whole, streamed, strict=True):
        other = dict(b.named_parameters())
        for name, p in a.named_parameters():
            assert torch.equal(p, other[name]), name
