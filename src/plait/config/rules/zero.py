"""The ZeRO level: its two spellings, what has no effect, what level 3 does not compose with yet, and
what optimizer offload needs."""

from __future__ import annotations

from plait.config.rules.checker import Checker

#: schedules that defer weight gradients to a later W task: a ZeRO-3 block would be freed when its
#: last gradient of one micro-batch lands while another micro-batch's W task still needs it
_SPLIT_BACKWARD = ("zb-h1", "interleaved-zb")


def check_zero(c: Checker) -> None:
    r, dp = c.r, c.dp
    p = r.parallel
    if c.ok("parallel.zero", "parallel.zero1") and p.zero1 and p.zero is not None and p.zero != 1:
        c.add("parallel.zero1", True, f"contradicts parallel.zero: {p.zero} (zero1: true is the older spelling of "
                                      f"zero: 1); remove zero1")
    # ZeRO shards over the dp x cp ranks that average gradients
    unsharded = dp == 1 and (p.cp == 1 or not c.ok("parallel.cp"))
    if c.ok("parallel.zero", "parallel.zero1") and p.zero_level() and unsharded:
        spelling = f"parallel.zero: {p.zero}" if p.zero is not None else "parallel.zero1: true"
        c.warnings.append(f"{spelling} — has no effect with dp=1 (nothing to shard over); training unsharded")
    if c.ok("parallel.offload_optimizer", "precision") and p.offload_optimizer and r.precision.preset == "bf16-pure":
        c.add("parallel.offload_optimizer", True, "keeps an fp32 master copy in host memory, and precision.preset "
                                                  "bf16-pure has none; use bf16-mixed (or fp32)")
    if c.ok("parallel.shard_over", "parallel.ep") and p.shard_over == "host" and p.ep > 1:
        c.add("parallel.shard_over", "host", f"does not work with parallel.ep={p.ep} yet (expert parameters are "
                                             f"sharded over their expert-data-parallel group); use shard_over: dp")
    if not c.ok("parallel.zero", "parallel.zero1") or p.zero_level() != 3:
        return
    if c.ok("parallel.schedule", "parallel.pp") and p.pp > 1 and p.schedule in _SPLIT_BACKWARD:
        c.add("parallel.schedule", p.schedule, "does not work with parallel.zero: 3 yet (its deferred weight "
                                               "gradients outlive the gathered weights); use 1f1b or "
                                               "interleaved-1f1b, or zero: 2")
    if c.ok("train.objective") and r.train.objective == "grpo":
        c.add("parallel.zero", 3, "does not work with train.objective grpo yet: each data-parallel rank decodes its "
                                  "own prompts for a different number of steps, and every decoding step gathers "
                                  "the weights over all of them; use zero: 2 (or 1)")
