"""ZeRO levels (:mod:`plait.config.rules.zero`) and precision: the preset's fixed knobs, and the
knobs of ``preset: manual`` together."""

from __future__ import annotations

from plait.config.problems import format_value
from plait.config.rules.checker import Checker
from plait.config.rules.zero import check_zero
from plait.precision import KNOBS, knob_problems, knob_values


def check_zero_and_precision(c: Checker) -> None:
    check_zero(c)
    r = c.r
    if not c.ok("precision"):
        return
    pr = r.precision
    knobs = pr.knobs()
    if pr.preset != "manual":
        fixed = knob_values(pr.preset)
        for name in KNOBS:
            if knobs[name] is not None:
                c.add(f"precision.{name}", knobs[name],
                      f"is a knob of precision.preset 'manual'; the {pr.preset!r} preset fixes it to "
                      f"{format_value(fixed[name])} (remove it, or use preset: manual)")
        return
    for name, message in knob_problems(knob_values("manual", knobs)):
        c.add(f"precision.{name}", knobs[name], message)
