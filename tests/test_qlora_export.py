"""A QLoRA adapter leaves the run with the record of its quantized base, and plait's readers use it.

The adapter directory is PEFT's (PEFT reads it, ignoring ``base_quantization.json``); plait's
scoring model (``plait eval``, ``plait generate``, lm-eval) quantizes the base again as recorded,
so it computes exactly what the trained model computed. ``plait convert --merge-lora`` refuses
such an adapter, since merged into the unquantized base it is another model, unless
``--dequantize`` asks for the base as trained: then the merged model equals the QLoRA model.
"""

from __future__ import annotations

import pytest
import torch

from plait.cli import main
from plait.heldout import load_scoring_model
from plait.lora import LoraSettings, apply_lora, save_peft_adapter
from plait.lora.apply import adapted
from plait.materialize import build_model, load_from_hf
from plait.mesh import single_process_mesh
from plait.models.hf_io import save_hf_checkpoint
from plait.models.llama.config import LlamaConfig
from plait.quantize import QUANTIZATION_FILE, BaseQuantization, quantize_base_, quantized_weights

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """``(base dir, adapter dir, the trained QLoRA model's logits, the same adapter on the unquantized base)``."""
    root = tmp_path_factory.mktemp("qlora")
    base = build_model(CONFIG, single_process_mesh(), seed=4)
    save_hf_checkpoint(base, root / "base", single_process_mesh().info("tp"))
    model = build_model(CONFIG, single_process_mesh(), seed=4)
    apply_lora([model], SETTINGS, seed=1)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for _, adapter in adapted([model]):
            adapter.A.copy_(0.3 * torch.randn(adapter.A.shape, generator=gen))
            adapter.B.copy_(0.3 * torch.randn(adapter.B.shape, generator=gen))
    unquantized = model(IDS).detach()
    quantize_base_([model], "nf4", block_size=16)
    with torch.no_grad():
        logits = model(IDS)
    record = BaseQuantization("nf4", 16).write(root)
    save_peft_adapter([model], root / "adapter", single_process_mesh().info("tp"), str(root / "base"),
                      extra_files={QUANTIZATION_FILE: record})
    return root / "base", root / "adapter", logits, unquantized


def test_scoring_model_quantizes_the_base_as_recorded(qlora):
    base, adapter, logits, unquantized = qlora
    model, _ = load_scoring_model(adapter)
    with torch.no_grad():
        assert torch.equal(model(IDS), logits)
    assert (logits - unquantized).abs().max() > 1e-3  # the record matters
    hf = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():  # PEFT reads the directory (onto the unquantized base it names)
        theirs = peft.PeftModel.from_pretrained(hf, adapter)(IDS).logits
    assert (theirs - unquantized).abs().max() < 1e-5


def test_merge_is_refused_unless_dequantized_and_then_equals_the_qlora_model(qlora, tmp_path, capsys):
    base, adapter, logits, _ = qlora
    assert main(["convert", str(adapter), str(tmp_path / "merged"), "--merge-lora"]) == 2
    err = capsys.readouterr().err
    assert "nf4-quantized base" in err and "--dequantize" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "merged").exists()
    assert main(["convert", str(adapter), str(tmp_path / "merged"), "--merge-lora", "--dequantize"]) == 0
    capsys.readouterr()
    with torch.no_grad():
        merged = load_from_hf(tmp_path / "merged", single_process_mesh())(IDS)
    assert (merged - logits).abs().max() < 1e-5
    assert main(["convert", str(base), str(tmp_path / "x"), "--dequantize"]) == 2
    assert "with --merge-lora only" in capsys.readouterr().err


def test_dequantize_without_a_quantized_base_is_refused(qlora, tmp_path, capsys):
    _, adapter, _, _ = qlora
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in adapter.iterdir():
        if f.name != QUANTIZATION_FILE:
            (plain / f.name).write_bytes(f.read_bytes())
    assert main(["convert", str(plain), str(tmp_path / "m"), "--merge-lora", "--dequantize"]) == 2
    assert "nothing to dequantize" in capsys.readouterr().err
    (adapter / QUANTIZATION_FILE).rename(tmp_path / "saved.json")
    try:
        (adapter / QUANTIZATION_FILE).write_text('{"method": "fp4", "block_size": 16}')
        with pytest.raises(ValueError, match="fp4"):
            load_scoring_model(adapter)
    finally:
        (tmp_path / "saved.json").replace(adapter / QUANTIZATION_FILE)


def test_a_bf16_run_quantizes_the_bf16_base_it_exports(tmp_path):
    """Under a bf16 preset the run quantizes its base rounded to bf16 (the base it would hold, and
    the one it exports), and records it: the reader rounds the same way, so an fp32 base directory
    and its bf16 export both give the trained codes."""
    model = build_model(CONFIG, single_process_mesh(), seed=4)
    save_hf_checkpoint(model, tmp_path / "fp32", single_process_mesh().info("tp"))
    apply_lora([model], SETTINGS, seed=1)
    quantize_base_([model], "nf4", block_size=16, round_to=torch.bfloat16)
    trained = {n: w.dense() for n, w in quantized_weights([model])}
    record = BaseQuantization("nf4", 16, "bfloat16").write(tmp_path)
    save_peft_adapter([model], tmp_path / "adapter", single_process_mesh().info("tp"), str(tmp_path / "fp32"),
                      extra_files={QUANTIZATION_FILE: record})
    bf16 = build_model(CONFIG, single_process_mesh(), seed=4, dtype=torch.bfloat16)
    save_hf_checkpoint(bf16, tmp_path / "bf16", single_process_mesh().info("tp"))
    for base in ("fp32", "bf16"):
        loaded, _ = load_scoring_model(tmp_path / "adapter", tmp_path / base)
        got = {n: w.dense() for n, w in quantized_weights([loaded])}
        assert all(torch.equal(got[n], trained[n]) for n in trained), base
    plain = build_model(CONFIG, single_process_mesh(), seed=4)
    apply_lora([plain], SETTINGS, seed=1)
    quantize_base_([plain], "nf4", block_size=16)
    assert any(not torch.equal(w.dense(), trained[n]) for n, w in quantized_weights([plain]))  # rounding matters


def test_init_from_a_qlora_adapter_on_another_base_warns(qlora):
    from plait.config import validate_recipe

    _, adapter, _, _ = qlora
    lora = {"rank": 4, "alpha": 8.0, "target_modules": list(SETTINGS.target_modules), "init_from": str(adapter)}
    same = validate_recipe({"lora": {**lora, "quantize_base": "nf4", "quantize_block_size": 16}}, 2)
    assert not any("init_from" in w for w in same.warnings), same.warnings
    other = validate_recipe({"lora": lora}, 2)
    assert any("trained on an nf4 base (blocks of 16)" in w for w in other.warnings), other.warnings


def test_merge_casts_to_dtype(qlora, tmp_path, capsys):
    from safetensors import safe_open

    _, adapter, _, _ = qlora
    assert main(["convert", str(adapter), str(tmp_path / "m"), "--merge-lora", "--dequantize", "--dtype",
                 "bfloat16"]) == 0
    capsys.readouterr()
    with safe_open(str(next((tmp_path / "m").glob("*.safetensors"))), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_lm_eval_model_in_bf16_holds_the_trained_codes(qlora, tmp_path):
    """lm-eval's model in bf16 quantizes the base from its fp32 values as recorded (not from a bf16
    copy), then dequantizes into bf16: the codes are the trained ones."""
    import shutil

    from plait.evaluation.lm_eval_model import load_eval_model

    adapter = tmp_path / "adapter"
    shutil.copytree(qlora[1], adapter)
    (adapter / "tokenizer.json").write_text("{}")  # lm-eval's model wants one; it is not read here
    fp32, _ = load_scoring_model(adapter)
    want = dict(quantized_weights([fp32]))
    bf16, _ = load_eval_model(adapter, dtype=torch.bfloat16)
    got = dict(quantized_weights([bf16]))
    assert want.keys() == got.keys()
    for name, w in got.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w.rows.codes, want[name].rows.codes), name
        assert torch.equal(w.rows.scales, want[name].rows.scales), name
