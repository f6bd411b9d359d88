"""The ``preference`` section: its knobs for the chosen preference objective, and the reference model."""

from __future__ import annotations

from plait.config.rules.checker import Checker
from plait.config.schema import PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES
from plait.post_training.objectives import PreferenceSettings, PreferenceSettingsError


def check_preference(c: Checker) -> None:
    """The ``preference`` section: set only for preference objectives, each knob meaningful for
    the chosen one, and a reference model only where the objective has one (and can build it)."""
    pr, objective = c.r.preference, c.r.train.objective
    if not c.ok("preference", "train.objective"):
        return
    if objective not in PREFERENCE_OBJECTIVES:
        defaults = type(pr)()  # a written recipe holds every field: only a changed value is a mistake
        for name in sorted(n for n in pr.model_fields_set if getattr(pr, n) != getattr(defaults, n)):
            c.add(f"preference.{name}", getattr(pr, name), f"applies to the preference objectives "
                                                           f"({', '.join(PREFERENCE_OBJECTIVES)}) only; remove it "
                                                           f"(train.objective is {objective!r})")
        return
    settings = PreferenceSettings(beta=pr.beta, label_smoothing=pr.label_smoothing, sft_weight=pr.sft_weight,
                                  gamma=pr.gamma)
    try:
        settings.check_for(objective)
    except PreferenceSettingsError as e:
        for line in str(e).splitlines()[1:]:
            name, _, rest = line.strip().partition("=")
            c.add(f"preference.{name}", getattr(pr, name), rest.split(" ", 1)[1])
    if objective not in REFERENCE_OBJECTIVES:
        if pr.reference is not None:
            c.add("preference.reference", pr.reference, f"objective {objective!r} uses no reference model; remove "
                                                        f"preference.reference (or use dpo/ipo)")
        return
    if pr.reference == "adapters_off" and c.ok("lora.rank") and c.r.lora.rank is None:
        c.add("preference.reference", pr.reference, "the policy without its adapters is the reference only with "
                                                    "LoRA; set lora.rank, or use reference frozen")
