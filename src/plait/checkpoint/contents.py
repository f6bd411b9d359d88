"""What a training checkpoint holds, recorded in its manifest and checked against the recipe that
resumes it.

A checkpoint holds the parameters the optimizer trains and their state. A full fine-tune or a
pre-training run trains every weight, so its checkpoint is the whole model (``"model": "full"``);
a LoRA run trains only its adapters, so its checkpoint holds the adapters (``"adapters"``) and
the frozen base weights come back from where the run first read them: ``model.hf_path``, or the
layout-invariant initialisation of ``run.seed`` when there is none. A preference objective's
reference (a frozen copy of the initial model, the policy with its adapters off, or a table the
initial model scored) is rebuilt from that same base, never saved.

So a resume is exact only when the recipe trains the same kind of thing (full model or adapters
with the same rank, scale and targets) from the same base; :func:`resume_problems` lists every
difference in one message, and runs both before launch (``plait train``, from the manifest
alone) and inside :func:`plait.train.checkpointing.restore`. Checkpoints written before the
manifest recorded this are read by their tensor names (``.lora.`` in a name: adapters), with
the base and the adapter settings then unknown and unchecked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from plait.checkpoint.format import CheckpointError, read_manifest
from plait.checkpoint.store import latest_checkpoint
from plait.config.schema import ARCH_FIELDS, Recipe
from plait.models.errors import ModelConfigError

#: the ``contents`` entry of a manifest: which parameters it holds and what the rest comes from
CONTENTS_KEY = "contents"


def model_config_dict(config: Any) -> dict[str, Any]:
    """The constructor arguments of a model family's config dataclass (JSON-safe): the manifest's
    ``model_config``."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "extra"}


def base_of(recipe: Recipe) -> dict[str, Any]:
    """Where a run's initial weights come from: ``model.hf_path``, or the seeded initialisation."""
    hf_path = recipe.model.hf_path
    return {"hf_path": hf_path} if hf_path is not None else {"hf_path": None, "seed": recipe.run.seed}


def contents_of(recipe: Recipe) -> dict[str, Any]:
    """The ``contents`` a checkpoint of ``recipe`` holds (written into every manifest)."""
    lo = recipe.lora
    lora = None if lo.rank is None else {"rank": lo.rank, "alpha": lo.alpha, "rslora": lo.rslora,
                                         "target_modules": sorted(lo.target_modules),
                                         "quantize_base": lo.quantize_base,
                                         "quantize_block_size": lo.quantize_block_size}
    return {"model": "full" if lora is None else "adapters", "lora": lora, "base": base_of(recipe),
            "reference": recipe.preference.reference_mode(recipe.train.objective, lo.rank)}


def saved_contents(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's ``contents``, or (older checkpoints) what its tensor names show."""
    found = manifest.get(CONTENTS_KEY)
    if isinstance(found, dict) and found.get("model") in ("full", "adapters"):
        return found
    adapters = any(".lora." in key for key in manifest.get("tensors", {}) if key.startswith("model/"))
    return {"model": "adapters" if adapters else "full", "lora": None, "base": None, "reference": None}


def _base_text(base: dict[str, Any]) -> str:
    if base.get("hf_path") is not None:
        return f"model.hf_path={base['hf_path']}"
    return f"the random initialisation of run.seed={base.get('seed')} (no model.hf_path)"


def _base_setting(base: dict[str, Any]) -> str:
    if base.get("hf_path") is not None:
        return f"model.hf_path={base['hf_path']}"
    return f"run.seed={base.get('seed')} and model.hf_path=null"


#: what a manifest written before ``lora.quantize_base`` existed trained on
_BEFORE_QUANTIZATION: dict[str, Any] = {"quantize_base": "none", "quantize_block_size": 64}


def resume_problems(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """Why a checkpoint holding ``saved`` cannot continue under ``recipe`` (empty: it can)."""
    want = contents_of(recipe)
    if saved["model"] == "adapters" and want["model"] == "full":
        settings = saved.get("lora") or {}
        rank = f"lora.rank={settings['rank']}" if "rank" in settings else "lora.rank"
        return [f"it holds LoRA adapters only, and the recipe trains the whole model (lora.rank is null); set {rank} "
                f"(and the run's other lora settings) to continue it, or merge its adapter with plait convert "
                f"ADAPTER BASE --merge-lora and fine-tune the merged model"]
    if saved["model"] == "full" and want["model"] == "adapters":
        return [f"it holds a whole model trained without LoRA, and the recipe trains LoRA adapters "
                f"(lora.rank={recipe.lora.rank}); set lora.rank=null to continue it, or convert it with "
                f"plait convert CHECKPOINT DEST and start a LoRA run from model.hf_path=DEST"]
    problems = []
    have, need = saved.get("lora"), want["lora"]
    if have is not None and need is not None:
        for key in ("rank", "alpha", "rslora", "target_modules", "quantize_base", "quantize_block_size"):
            saved_value = have.get(key, _BEFORE_QUANTIZATION.get(key))  # older manifests: an unquantized base
            if saved_value != need[key]:
                problems.append(f"lora.{key}={need[key]} differs from the checkpoint's {saved_value}; set "
                                f"lora.{key}={saved_value} to continue it (the adapters were trained on that base)")
    # the frozen base (adapters) and the reference (preference objectives) are rebuilt from the recipe
    depends_on_base = want["model"] == "adapters" or want["reference"] is not None
    base = saved.get("base")
    if depends_on_base and base is not None and base != want["base"]:
        rebuilt = "frozen base" if want["model"] == "adapters" else "reference model"
        problems.append(f"it was trained from {_base_text(base)} and the recipe starts from "
                        f"{_base_text(want['base'])}, so the {rebuilt} would differ: set {_base_setting(base)} "
                        f"to continue it")
    return problems


def architecture_problems(saved_config: Any, recipe: Recipe) -> list[str]:
    """The architecture fields in which the recipe's model differs from the one a checkpoint's
    manifest records (``model_config``): each would fail as a shape mismatch only after launch.
    The vocabulary size the tokenizer sets is taken from the checkpoint when the recipe leaves it
    open."""
    if not isinstance(saved_config, dict):
        return []
    try:
        mine = recipe.model.to_model_config(saved_config.get("vocab_size"))
    except (ModelConfigError, ValueError, OSError):
        return []  # the recipe's own rules report a model they cannot build
    problems = []
    derived = {"head_dim"} if recipe.model.hf_path is None and recipe.model.head_dim is None else set()
    for name in ARCH_FIELDS:
        if name in derived:  # follows hidden_size / num_attention_heads, named there
            continue
        if name in saved_config and hasattr(mine, name) and getattr(mine, name) != saved_config[name]:
            problems.append(f"model.{name} is {getattr(mine, name)!r} here and {saved_config[name]!r} in the "
                            f"checkpoint; set model.{name}={saved_config[name]!r} (the model it was trained as)")
    return problems


def check_resumable(directory: str | Path, recipe: Recipe) -> None:
    """Raise :class:`CheckpointError` naming ``directory`` and every problem of resuming it."""
    manifest = read_manifest(Path(directory))
    problems = resume_problems(saved_contents(manifest), recipe) + architecture_problems(manifest.get("model_config"),
                                                                                        recipe)
    if problems:
        raise CheckpointError(f"checkpoint.resume: {directory} cannot continue this recipe: " + "; ".join(problems))


def resume_target(recipe: Recipe, save_dir: str | Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``auto``: the newest complete one), or ``None``."""
    resume = recipe.checkpoint.resume
    if resume == "none":
        return None
    return latest_checkpoint(save_dir) if resume == "auto" else Path(resume).expanduser()
