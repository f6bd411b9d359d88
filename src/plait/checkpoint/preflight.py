"""The output checks of ``plait train``, run before any process or process group starts.

:func:`check_outputs` only reads the file system (so ``plait config validate`` can run it);
:func:`claim_outputs` then proves the directories can be created and written, and takes the
one-run-per-directory locks. Together they turn the failures that used to surface at the end of
a run (an unwritable save directory, a final model directory full of the user's files, a second
run on the same directory) into one line before launch.

They live above :mod:`plait.outputs` (the file-safety pieces they compose, which know no
checkpoint) because a save directory's earlier checkpoints are found by their manifests
(:mod:`plait.checkpoint.store`).
"""

from __future__ import annotations

from pathlib import Path

from plait.checkpoint.store import complete_checkpoints
from plait.outputs.lock import DirectoryLock, acquire_all
from plait.outputs.ownership import (
    OutputDirError,
    is_within,
    probe_writable,
    require_apart,
    require_not_containing,
    require_target,
    write_marker,
)


def _input_paths(resolved) -> list[tuple[str, Path]]:
    """The inputs a run reads that exist on this machine, as ``(setting, path)``."""
    r = resolved.recipe
    found = []
    for what, value in (("data.source", r.data.source), ("data.tokenizer", r.data.tokenizer),
                        ("model.hf_path", r.model.hf_path), ("data.cache_dir", r.data.cache_dir),
                        ("lora.init_from", r.lora.init_from), ("checkpoint.resume", r.checkpoint.resume)):
        if value and Path(value).expanduser().exists():
            found.append((what, Path(value).expanduser()))
    return found


def check_outputs(resolved) -> None:
    """Refuse output settings that would replace what plait did not create (reads only).

    * ``run.output_dir`` is absent, empty or a plait run directory (a re-run continues in it);
    * ``checkpoint.save_dir`` is absent, empty or a plait checkpoint directory, and not the output
      directory itself; a fresh run (``checkpoint.resume: none``) does not train over an earlier
      run's checkpoints there (retention would delete them) unless ``checkpoint.overwrite``;
    * ``checkpoint.dir`` (with ``save_final``) is absent, empty, or a model directory plait wrote:
      replaced when it is this run's own (inside the run directory) or ``checkpoint.overwrite``
      is true; it never contains the run directory, the save directory or an input.
    """
    r = resolved.recipe
    out, save, final = Path(resolved.output_dir), Path(resolved.save_dir), Path(resolved.checkpoint_dir)
    inputs = _input_paths(resolved)
    read_only = [(what, path) for what, path in inputs if what != "checkpoint.resume"]  # resumed: plait's own
    require_apart(out, read_only, what="run.output_dir")
    run_state = require_target(out, "run", what="run.output_dir")
    if is_within(out, save):
        raise OutputDirError(f"checkpoint.save_dir={save} contains run.output_dir={out}; checkpoints need a "
                             f"directory of their own, e.g. {{output_dir}}/checkpoints")
    require_target(save, "checkpoints", what="checkpoint.save_dir")
    earlier = complete_checkpoints(save)
    if earlier and r.checkpoint.resume == "none" and not r.checkpoint.overwrite:
        raise OutputDirError(f"checkpoint.save_dir={save} holds the checkpoints of an earlier run (newest: step "
                             f"{earlier[-1][0]}); continue it with checkpoint.resume=auto, start anew over them with "
                             f"checkpoint.overwrite=true, or choose another run.output_dir")
    require_apart(save, read_only, what="checkpoint.save_dir")  # retention deletes old checkpoints there
    if not r.checkpoint.save_final:
        return
    require_apart(final, inputs, what="checkpoint.dir")
    require_not_containing(final, [("run.output_dir", out), ("checkpoint.save_dir", save)], what="checkpoint.dir")
    own = is_within(final, out) and run_state in ("ours", "absent", "empty")
    require_target(final, "hf-model", what="checkpoint.dir", replace=own or r.checkpoint.overwrite,
                   replace_hint="set checkpoint.overwrite=true")


def claim_outputs(resolved, *, lock: bool = True) -> list[DirectoryLock]:
    """Check, create and probe the run's directories, then lock them; returns the held locks.

    Every rank of a multi-host job should call it with ``lock`` only on global rank 0: each host
    proves it can write (all ranks write checkpoint shards), one process holds the locks.
    """
    check_outputs(resolved)
    out, save = Path(resolved.output_dir), Path(resolved.save_dir)
    probe_writable(out, what="run.output_dir")
    probe_writable(save, what="checkpoint.save_dir")
    if resolved.recipe.checkpoint.save_final:
        # the model is written next to its final place, then renamed into it
        final = Path(resolved.checkpoint_dir)
        probe_writable(final.parent, what="checkpoint.dir", target=final)
    if not lock:
        return []
    locks = acquire_all([("run.output_dir", out), ("checkpoint.save_dir", save)])
    write_marker(out, "run")
    write_marker(save, "checkpoints")
    return locks
