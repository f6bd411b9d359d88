"""LoRA: an adapter to start from made with the section's settings, and target projections the
model has."""

from __future__ import annotations

from pathlib import Path

from plait.config.rules.checker import Checker
from plait.lora import PeftAdapterError, read_peft_settings
from plait.lora.apply import projections
from plait.lora.settings import TARGETS
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.quantize import QuantizationRecordError, read_base_quantization


def check_lora(c: Checker) -> None:
    """``lora.init_from`` names a PEFT adapter made with this section's settings."""
    lo = c.r.lora
    if lo.init_from is None or not c.ok("lora"):
        return
    if lo.rank is None:
        c.add("lora.init_from", lo.init_from, "starts LoRA adapters, but lora.rank is null (LoRA off); set lora.rank "
                                              "to the adapter's rank")
        return
    if not c.check_paths:
        return
    try:
        found = read_peft_settings(Path(lo.init_from).expanduser())
    except (PeftAdapterError, OSError) as e:
        c.add("lora.init_from", lo.init_from, f"is not a readable PEFT adapter directory ({e})")
        return
    _warn_other_base(c, Path(lo.init_from).expanduser())
    mine = (lo.rank, float(lo.alpha), lo.rslora, sorted(lo.target_modules))
    theirs = (found.rank, float(found.alpha), found.rslora, sorted(found.target_modules))
    if mine != theirs:
        c.add("lora.init_from", lo.init_from, f"was trained with rank {found.rank}, alpha {found.alpha:g}, rslora "
                                              f"{str(found.rslora).lower()}, targets {list(found.target_modules)}; "
                                              f"set the lora section to the same")


def check_lora_targets(c: Checker) -> None:
    """Every ``lora.target_modules`` entry is a projection the model has in at least one decoder
    block (an MoE family's experts have none of the dense MLP's): read off the model built on the
    meta device, so what the rule accepts is what ``apply_lora`` adapts."""
    lo, arch = c.r.lora, c.arch
    if lo.rank is None or arch is None or not c.ok("lora.target_modules", "lora.rank"):
        return
    model = build_model(arch, single_process_mesh(), device="meta", init=False)
    present = sorted({p.target for p in projections([model])}, key=TARGETS.index)
    absent = [t for t in lo.target_modules if t not in present]
    if absent:
        c.add("lora.target_modules", list(lo.target_modules),
              f"the {type(arch).family} model has no {', '.join(absent)} projection in any decoder block, so "
              f"{'it' if len(absent) == 1 else 'they'} would adapt nothing; its projections: {present}")


def _warn_other_base(c: Checker, adapter: Path) -> None:
    """A warning when ``lora.init_from`` was trained on a base stored otherwise than this run stores it
    (quantized or not, another method or block size): the adapter then continues on another base."""
    lo = c.r.lora
    try:
        record = read_base_quantization(adapter)
    except QuantizationRecordError as e:
        c.add("lora.init_from", lo.init_from, str(e))
        return
    theirs = "the base as read" if record is None else f"an {record.method} base (blocks of {record.block_size})"
    mine = "the base as read" if lo.quantize_base == "none" else \
        f"an {lo.quantize_base} base (blocks of {lo.quantize_block_size})"
    if theirs != mine:
        c.warnings.append(f"lora.init_from: {lo.init_from} — was trained on {theirs}, and this run trains on "
                          f"{mine} (lora.quantize_base): the adapter starts on another base than it learned on")
