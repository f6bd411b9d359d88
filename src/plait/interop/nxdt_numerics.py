"""The numeric sections of an NxDT config: ``optim`` (with ``sched``) and ``precision``.

NxDT keeps ``optim`` under ``model`` in its examples; a top-level ``optim`` is read the same way.
``precision.type`` maps to a plait preset (docs/nxdt.md has the table); with ``type: manual``
the NxDT knobs map to plait's manual knobs, and plait's validation decides whether the
combination can run.
"""

from __future__ import annotations

from plait.interop.nxdt_collect import Collector
from plait.interop.nxdt_sections import PRECISION_TYPES, SCHEDULES, flag, is_int, one_of

_ADAMW = {"adamw", "adamw_fp32OptState", "AdamW", "adam_w"}


def import_optim(c: Collector) -> None:
    o = "model.optim." if c.section("model.optim") else "optim."
    name = c.get(o + "name")
    if c.has(o + "name"):
        if one_of(name, _ADAMW):
            c.map(o + "name", {"optimizer.name": "adamw"},
                  "the optimizer state is kept in the master dtype (fp32 with bf16-mixed)"
                  if name == "adamw_fp32OptState" else "")
        else:
            c.unmap(o + "name", "plait's optimizer is AdamW")
    for key, field in (("lr", "optimizer.lr"), ("weight_decay", "optimizer.weight_decay"), ("eps", "optimizer.eps")):
        if c.has(o + key):
            c.map(o + key, {field: c.get(o + key)})
    betas = c.get(o + "betas")
    if c.has(o + "betas"):
        if isinstance(betas, list) and len(betas) == 2:
            c.map(o + "betas", {"optimizer.beta1": betas[0], "optimizer.beta2": betas[1]})
        else:
            c.unmap(o + "betas", "must be a list of two numbers")
    if c.has(o + "capturable"):
        c.ignore(o + "capturable", "a CUDA-graph option of torch's AdamW; plait's AdamW is its own")
    _schedule(c, o + "sched.")


def _schedule(c: Collector, s: str) -> None:
    name = c.get(s + "name")
    plait_name = SCHEDULES.get(name) if isinstance(name, str) else None
    if c.has(s + "name"):
        if plait_name is None:
            c.unmap(s + "name", f"plait's schedules: warm-up then {', '.join(sorted(set(SCHEDULES.values())))} "
                                f"(known NxDT names: {', '.join(SCHEDULES)})")
        else:
            c.map(s + "name", {"scheduler.name": plait_name})
    if c.has(s + "warmup_steps"):
        c.map(s + "warmup_steps", {"scheduler.warmup_steps": c.get(s + "warmup_steps")})
    elif c.has(s + "warmup_ratio") and is_int(c.value("train.steps")):
        ratio, steps = c.get(s + "warmup_ratio"), c.value("train.steps")
        if isinstance(ratio, (int, float)):
            c.map(s + "warmup_ratio", {"scheduler.warmup_steps": round(ratio * steps)}, f"{ratio} * {steps} steps")
    lr = c.value("optimizer.lr")
    if c.has(s + "min_lr"):
        min_lr = c.get(s + "min_lr")
        if isinstance(min_lr, (int, float)) and isinstance(lr, (int, float)) and lr > 0:
            c.map(s + "min_lr", {"scheduler.min_lr_ratio": min_lr / lr}, f"min_lr / lr = {min_lr} / {lr}")
        else:
            c.unmap(s + "min_lr", "plait sets the final rate as a fraction of optimizer.lr (scheduler.min_lr_ratio)")
    elif plait_name in ("cosine", "linear"):
        c.map("(optim.sched.min_lr absent)", {"scheduler.min_lr_ratio": 0.0}, "NxDT's schedules decay to 0 by "
                                                                            "default", value=None)
    constant = c.get(s + "constant_steps")
    if c.has(s + "constant_steps"):
        if constant in (0, None):
            c.ignore(s + "constant_steps", "no constant phase")
        else:
            c.unmap(s + "constant_steps", "plait has no constant phase between warm-up and decay")
    if c.has(s + "max_steps"):
        if c.get(s + "max_steps") == c.value("train.steps"):
            c.ignore(s + "max_steps", "plait decays over train.steps")
        else:
            c.unmap(s + "max_steps", f"plait decays over train.steps ({c.value('train.steps')}), not a separate "
                                     "length")


# ---------------------------------------------------------------------- precision
#: NxDT's manual precision knobs -> (plait knob, plait value for NxDT's on, for off)
_MANUAL_KNOBS = {"master_weights": ("precision.master_weights", True, False),
                 "fp32_grad_acc": ("precision.grad_dtype", "fp32", "bf16"),
                 "xla_use_bf16": ("precision.param_dtype", "bf16", "fp32"),
                 "neuron_rt_stochastic_rounding_en": ("precision.stochastic_rounding", True, False)}


def import_precision(c: Collector) -> None:
    p = "precision."
    kind = c.get(p + "type")
    if not c.has(p + "type"):
        if c.section("precision"):
            c.unmap("precision", "no precision.type; plait's default preset fp32 stays")
        return
    preset = PRECISION_TYPES.get(kind) if isinstance(kind, str) else None
    if preset is None:
        c.unmap(p + "type", f"known NxDT types: {', '.join(PRECISION_TYPES)}")
        return
    note = ("stochastic rounding is not needed with fp32 master weights" if kind == "mixed_precisionSR" else "")
    c.map(p + "type", {"precision.preset": preset}, note)
    for key in c.section("precision"):
        if key == "type":
            continue
        if preset != "manual":
            c.ignore(p + key, f"fixed by precision.type {kind}")
        elif key in _MANUAL_KNOBS:
            field, on, off = _MANUAL_KNOBS[key]
            value = flag(c.get(p + key))
            if value is None:
                c.unmap(p + key, "not an on/off value")
            else:
                c.map(p + key, {field: on if value else off})
        elif key == "xla_downcast_bf16":
            c.ignore(p + key, "an XLA runtime flag; plait's bf16 comes from precision.param_dtype")
        elif key == "parallel_layers_reduce_dtype":
            c.ignore(p + key, "plait reduces gradients in precision.grad_dtype")
