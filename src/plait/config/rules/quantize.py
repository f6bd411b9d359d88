"""QLoRA: a quantized base needs blocks that divide the hidden size, a family whose decoder blocks
hold only projections plait can quantize, and the features it composes with (not compiled
blocks; under ZeRO-3 the quantized base is not sharded, which a warning says)."""

from __future__ import annotations

from plait.activation_checkpointing import decoder_blocks
from plait.config.rules.checker import Checker
from plait.lora.apply import projections
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.decoder.config import DecoderConfig
from plait.quantize.apply import suggested_block_size


def check_quantize_base(c: Checker) -> None:
    """``lora.quantize_base`` and ``lora.quantize_block_size`` against the model and the layout
    (LoRA itself being on is the applicability rule's: without it the field is refused there)."""
    lo, arch = c.r.lora, c.arch
    if lo.rank is None or not c.ok("lora.quantize_base", "lora.quantize_block_size", "lora.rank"):
        return
    if lo.quantize_base == "none":
        return
    block = lo.quantize_block_size
    if arch is not None and c.ok("model") and (block % 2 or arch.hidden_size % block):
        c.add("lora.quantize_block_size", block, f"must be an even divisor of model.hidden_size={arch.hidden_size} "
                                                 f"(blocks run along the hidden size); use "
                                                 f"{suggested_block_size(arch.hidden_size)}")
    if arch is not None and c.ok("model"):
        unsupported = _unquantizable_layers(arch)
        if unsupported:
            shown = ", ".join(unsupported[:3]) + (", ..." if len(unsupported) > 3 else "")
            c.add("lora.quantize_base", lo.quantize_base,
                  f"the {type(arch).family} model's decoder blocks hold weights that are not the dense "
                  f"projections plait quantizes ({shown}); quantization supports llama, qwen3, mistral, "
                  f"gemma3 and gpt_neox; use lora.quantize_base: none")
    if c.ok("train.compile") and c.r.train.compile:
        c.add("train.compile", True, f"does not compile a quantized base (lora.quantize_base={lo.quantize_base}); "
                                     f"set train.compile: false or lora.quantize_base: none")
    if c.ok("parallel.zero") and c.r.parallel.zero_level() == 3 and (c.dp or 1) > 1:
        c.warnings.append(f"parallel.zero: 3 — with lora.quantize_base={lo.quantize_base} the quantized base "
                          f"projections stay whole on every data-parallel rank (ZeRO-3 shards the embeddings, "
                          f"norms, head and adapters, not the quantized weights)")


def _unquantizable_layers(arch: DecoderConfig) -> list[str]:
    """Names of the matrices in the decoder blocks that are not block projections (router gates,
    grouped experts, latent-attention compressions), read off the model built on the meta device."""
    model = build_model(arch, single_process_mesh(), device="meta", init=False)
    known = {id(p.module.weight) for p in projections([model])}
    out: list[str] = []
    for block_name, block in decoder_blocks(model):
        for name, param in block.named_parameters():
            if param.dim() >= 2 and id(param) not in known:
                out.append(f"{block_name}.{name}")
    return out
