"""Precision presets: each one a documented bundle of dtypes for weights, compute, gradients and state.

The trainer never reads ``precision.preset`` directly; it asks :func:`policy_for` for a
:class:`PrecisionPolicy` and follows its fields, so a ``manual`` recipe that sets the same knobs
as a preset trains exactly like that preset.

=============  ============  =========  ==============  ==============  =====================  ==========
preset         model weights compute    master weights  gradients       optimizer state        rounding
=============  ============  =========  ==============  ==============  =====================  ==========
``fp32``       fp32          fp32       (the weights)   fp32            fp32                   nearest
``autocast``   fp32          bf16 auto  (the weights)   fp32            fp32                   nearest
``bf16-mixed`` bf16          bf16       fp32            fp32 (acc+red)  fp32                   nearest
``bf16-pure``  bf16          bf16       none            bf16            bf16                   stochastic
=============  ============  =========  ==============  ==============  =====================  ==========

The optimizer state always has the dtype of the weights the optimizer updates (the master
weights when there are any, otherwise the model weights).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """What each tensor of training is stored and computed in."""

    param_dtype: torch.dtype
    autocast: bool
    master_weights: bool
    grad_dtype: torch.dtype
    stochastic_rounding: bool

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates (and keeps its state in)."""
        return torch.float32 if self.master_weights else self.param_dtype

    @property
    def separate_master(self) -> bool:
        """True when the optimizer updates a copy of the weights in another dtype."""
        return self.master_dtype != self.param_dtype

    def compute_context(self, device: torch.device):
        """The autocast region of forward (a no-op unless ``autocast``)."""
        if self.autocast:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


PRESETS: dict[str, dict[str, object]] = {
    "fp32": dict(param_dtype="fp32", autocast=False, master_weights=False, grad_dtype="fp32",
                 stochastic_rounding=False),
    "autocast": dict(param_dtype="fp32", autocast=True, master_weights=False, grad_dtype="fp32",
                     stochastic_rounding=False),
    "bf16-mixed": dict(param_dtype="bf16", autocast=False, master_weights=True, grad_dtype="fp32",
                       stochastic_rounding=False),
    "bf16-pure": dict(param_dtype="bf16", autocast=False, master_weights=False, grad_dtype="bf16",
                      stochastic_rounding=True),
}
#: the knobs of the ``manual`` preset (recipe fields ``precision.<knob>``)
KNOBS = tuple(PRESETS["fp32"])


def knob_values(preset: str, overrides: dict[str, object] | None = None) -> dict[str, object]:
    """The knob values of ``preset``; ``manual`` starts from ``fp32`` and applies ``overrides``."""
    base = dict(PRESETS["fp32" if preset == "manual" else preset])
    if preset == "manual":
        base.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return base


def knob_problems(values: dict[str, object]) -> list[tuple[str, str]]:
    """(knob, message) for every combination the optimizer cannot run."""
    problems = []
    master_fp32 = values["master_weights"] or values["param_dtype"] == "fp32"
    if master_fp32 and values["grad_dtype"] != "fp32":
        problems.append(("grad_dtype", "must be 'fp32' when the optimizer updates fp32 weights "
                                       "(param_dtype fp32 or master_weights true)"))
    if values["stochastic_rounding"] and master_fp32:
        problems.append(("stochastic_rounding", "rounds bf16 weight updates; it needs param_dtype 'bf16' "
                                                "and master_weights false"))
    return problems


def _dtype(knob: str, value: object) -> torch.dtype:
    """The torch dtype a knob names; knob values come from a recipe, so a wrong name is a ValueError."""
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"precision.{knob}={value!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[value]


def policy_for(preset: str, overrides: dict[str, object] | None = None) -> PrecisionPolicy:
    """The policy of a preset name (and, for ``manual``, its knob values)."""
    if preset not in PRESETS and preset != "manual":
        raise ValueError(f"precision.preset={preset!r} is not a preset; choose one of "
                         f"{', '.join(list(PRESETS) + ['manual'])}")
    v = knob_values(preset, overrides)
    bad = knob_problems(v)
    if bad:
        raise ValueError("; ".join(f"precision.{k}: {msg}" for k, msg in bad))
    return PrecisionPolicy(param_dtype=_dtype("param_dtype", v["param_dtype"]), autocast=bool(v["autocast"]),
                           master_weights=bool(v["master_weights"]),
                           grad_dtype=_dtype("grad_dtype", v["grad_dtype"]),
                           stochastic_rounding=bool(v["stochastic_rounding"]))
