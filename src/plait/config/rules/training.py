"""The training loop's fields: the learning-rate warm-up against the run's length, activation
checkpointing (selective: submodules a decoder block has), and the run's directories."""

from __future__ import annotations

from pathlib import Path

from plait.activation_checkpointing import checkpointable_names
from plait.config.problems import suggest
from plait.config.rules.checker import Checker


def check_schedule(c: Checker) -> None:
    r = c.r
    if c.ok("scheduler.warmup_steps", "train.steps") and r.scheduler.warmup_steps > r.train.steps:
        short = r.train.steps // 10
        c.add("scheduler.warmup_steps", r.scheduler.warmup_steps, f"must be <= train.steps={r.train.steps}; for a "
                                                                  f"short run set scheduler.warmup_steps={short}"
                                                                  + (" (or 0)" if short else ""))


def check_activation_checkpointing(c: Checker) -> None:
    t, arch = c.r.train, c.arch
    if not c.ok("train.activation_checkpointing", "train.checkpoint_modules"):
        return
    if t.activation_checkpointing != "selective":
        if t.checkpoint_modules:
            c.add("train.checkpoint_modules", t.checkpoint_modules,
                  f"is used only with train.activation_checkpointing 'selective' (it is "
                  f"{t.activation_checkpointing!r}); remove it or set selective")
        return
    if not t.checkpoint_modules:
        c.add("train.checkpoint_modules", [], "selective checkpointing needs at least one block submodule name, "
                                              "e.g. ['self_attn'] or ['mlp']")
        return
    if arch is None:
        return
    valid = checkpointable_names(arch)
    for name in t.checkpoint_modules:
        if name not in valid:
            hint = suggest(name, valid)
            c.add("train.checkpoint_modules", name, f"is not a submodule of a decoder block"
                                                    f"{f' (did you mean {hint!r}?)' if hint else ''}; valid: "
                                                    f"{', '.join(valid)}")


def check_paths(c: Checker) -> None:
    r = c.r
    if c.ok("run.output_dir", "run.name"):
        try:
            out = r.run.output_dir.format(name=r.run.name)
        except (KeyError, IndexError, ValueError, AttributeError):
            c.add("run.output_dir", r.run.output_dir, "only {name} may be substituted; write {{ }} for braces")
            out = None
        for key in ("dir", "save_dir"):
            value = getattr(r.checkpoint, key)
            if c.ok(f"checkpoint.{key}") and out is not None:
                try:
                    value.format(output_dir=out, name=r.run.name)
                except (KeyError, IndexError, ValueError, AttributeError):
                    c.add(f"checkpoint.{key}", value,
                          "only {output_dir} and {name} may be substituted; write {{ }} for braces")
    resume = r.checkpoint.resume
    if c.ok("checkpoint.resume") and resume not in ("none", "auto") and not Path(resume).is_dir():
        c.add("checkpoint.resume", resume, "'none', 'auto', or an existing checkpoint directory (step-N)")
