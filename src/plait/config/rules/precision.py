"""ZeRO levels and precision: the preset's fixed knobs, and the knobs of ``preset: manual`` together."""

from __future__ import annotations

from plait.config.problems import format_value
from plait.config.rules.checker import Checker
from plait.precision import KNOBS, knob_problems, knob_values


def check_zero_and_precision(c: Checker) -> None:
    r, dp = c.r, c.dp
    p = r.parallel
    if c.ok("parallel.zero", "parallel.zero1") and p.zero1 and p.zero is not None and p.zero != 1:
        c.add("parallel.zero1", True, f"contradicts parallel.zero: {p.zero} (zero1: true is the older spelling of "
                                      f"zero: 1); remove zero1")
    # ZeRO shards over the dp x cp ranks that average gradients
    if c.ok("parallel.zero", "parallel.zero1") and p.zero_level() and dp == 1 and (p.cp == 1 or not c.ok("parallel.cp")):
        spelling = f"parallel.zero: {p.zero}" if p.zero is not None else "parallel.zero1: true"
        c.warnings.append(f"{spelling} — has no effect with dp=1 (nothing to shard over); training unsharded")
    if c.ok("parallel.reshard_after_forward", "parallel.zero", "parallel.zero1") and not p.reshard_after_forward \
            and p.zero_level() != 3:
        c.add("parallel.reshard_after_forward", False, f"applies to parallel.zero: 3 only (the weights are whole on "
                                                       f"every rank at level {p.zero_level()}); remove it")
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
