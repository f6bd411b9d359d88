"""Adapters to and from PEFT's directory layout (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT names an adapter tensor after the module it adapts, under its wrapper's prefix:
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``),
e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. plait's module names are
Hugging Face's, so ``<module>`` is plait's projection name. Tensors are full (unsharded); the
writer gathers them over the TP group and the reader cuts each rank's slices by the adapters'
:class:`~plait.tensor_parallel.sharding.ShardSpec`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.lora.apply import adapted
from plait.lora.settings import TARGETS, LoraSettings, LoraSettingsError
from plait.models.family import config_of
from plait.outputs.whole import written_whole
from plait.tensor_parallel.sharding import ShardSpec, assemble_from_shards

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
#: inside an adapter directory: the base it was trained on when that base exists nowhere else (a
#: LoRA run from a random initialisation), named by ``base_model_name_or_path``
BASE_SUBDIR = "base"
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*\.layers\.\d+\.(?:self_attn|attention|mlp)\.(?P<target>\w+))"
                  r"\.lora_(?P<ab>[AB])\.weight$")


class PeftAdapterError(ValueError):
    """A PEFT adapter directory plait cannot read into the model (the message says what and the fix)."""


def peft_key(module_name: str, which: str) -> str:
    """PEFT's tensor name for ``which`` (``"A"`` or ``"B"``) of the adapter on ``module_name``."""
    return f"{PREFIX}{module_name}.lora_{which}.weight"


# ------------------------------------------------------------------------------ write
def peft_config(settings: LoraSettings, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` content PEFT's ``LoraConfig`` reads back as these settings."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
        "use_rslora": settings.rslora, "target_modules": sorted(settings.target_modules), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def settings_of(modules: list[nn.Module]) -> LoraSettings:
    """The settings the adapters of ``modules`` were built with (rank, scale, dropout, targets)."""
    found = list(adapted(modules))
    if not found:
        raise PeftAdapterError("the model has no LoRA adapters; call plait.lora.apply_lora first")
    if found[0][1].settings is not None:
        return found[0][1].settings
    rank = found[0][1].full_a_shape[0]
    scale, dropout = found[0][1].scale, found[0][1].dropout
    targets = tuple(t for t in TARGETS if any(p.target == t for p, _ in found))
    # alpha is what gives ``scale``; whether it was rank-stabilised is not recorded, so use plain alpha / r
    return LoraSettings(rank=rank, alpha=scale * rank, dropout=dropout, target_modules=targets)


def save_peft_adapter(modules: list[nn.Module], directory: str | os.PathLike[str], tp_group_info: GroupInfo,
                      base_model_name_or_path: str | None, *, settings: LoraSettings | None = None,
                      pp: GroupInfo | None = None, replace: bool = False,
                      extra_files: Mapping[str, str | os.PathLike[str]] | None = None) -> None:
    """Write the adapters of ``modules`` as a PEFT adapter directory.

    Every rank of the TP group must call this (full tensors are gathered over it); global rank 0
    (tp rank 0 without ``torch.distributed``) writes. ``modules`` must hold every decoder block
    (pipeline stages of one rank are fine when that rank holds all blocks), or, with ``pp``, the
    stages of every pipeline rank together: the adapters (small) are gathered over the pipeline
    group, and every rank of it must call this. ``settings`` fills
    ``adapter_config.json``; by default, the settings ``apply_lora`` was given. ``extra_files``
    (``{name: file}``, read on the writing rank) are copied into the directory with the adapter,
    e.g. the tokenizer and chat template it was trained with
    (:func:`plait.data.tokenizer_files.model_use_files`). Returns after the files exist, on every rank.
    """
    settings = settings if settings is not None else settings_of(modules)
    tensors = _full_adapter_tensors(modules, tp_group_info)
    if pp is not None and pp.size > 1:
        parts: list[Any] = [None] * pp.size
        dist.all_gather_object(parts, tensors, group=pp.group)
        tensors = {key: value for part in parts for key, value in part.items()}
        _check_every_block_named(tensors, modules)
    else:
        _check_every_block(modules)
    is_writer = dist.get_rank() == 0 if dist.is_initialized() else tp_group_info.rank == 0
    error: BaseException | None = None
    if is_writer:
        try:
            _write(Path(directory), peft_config(settings, base_model_name_or_path), tensors, replace,
                   extra_files or {})
        except Exception as e:  # reported to every rank below, so none waits forever
            error = e
    if dist.is_initialized():  # doubles as the barrier: nobody returns before the files exist
        status = [error is None]
        dist.broadcast_object_list(status, src=0)
        if not status[0] and error is None:
            raise RuntimeError(f"rank 0 failed to write the PEFT adapter {directory}")
    if error is not None:
        raise error


def _check_every_block(modules: list[nn.Module]) -> None:
    config = getattr(modules[0], "config", None) if modules else None
    layers = {match.group(1) for proj, _ in adapted(modules) if (match := _LAYER.search(proj.name))}
    expected = getattr(config, "num_hidden_layers", None)
    if expected is not None and len(layers) != expected:
        raise PeftAdapterError(
            f"save_peft_adapter got adapters of {len(layers)} of the model's {expected} decoder blocks; under "
            f"pipeline parallelism gather the stages on one rank first (saving from a pipeline is not supported)")


def _check_every_block_named(tensors: dict[str, torch.Tensor], modules: list[nn.Module]) -> None:
    """The adapters gathered from every pipeline stage cover every decoder block."""
    config = getattr(modules[0], "config", None) if modules else None
    expected = getattr(config, "num_hidden_layers", None)
    layers = {key.split(".layers.")[1].split(".")[0] for key in tensors if ".layers." in key}
    if expected is not None and len(layers) != expected:
        raise PeftAdapterError(f"the pipeline stages hold adapters of {len(layers)} of the model's {expected} "
                               f"decoder blocks")


def _full_adapter_tensors(modules: list[nn.Module], tp: GroupInfo) -> dict[str, torch.Tensor]:
    """PEFT key -> full tensor (on every rank; all TP ranks take part in each gather)."""
    items: list[tuple[str, torch.Tensor, ShardSpec | None]] = []
    for proj, adapter in adapted(modules):
        items.append((peft_key(proj.name, "A"), adapter.A.detach(), adapter.a_spec))
        items.append((peft_key(proj.name, "B"), adapter.B.detach(), adapter.b_spec))
    specs = {key: spec for key, _, spec in items if spec is not None}
    every_rank: list[Any] = [specs]
    if tp.size > 1:
        every_rank = [None] * tp.size
        dist.all_gather_object(every_rank, specs, group=tp.group)
    out: dict[str, torch.Tensor] = {}
    for key, local, spec in items:
        if spec is None:
            out[key] = local.cpu().contiguous()
            continue
        parts = [local]
        if tp.size > 1:
            parts = [torch.empty_like(local) for _ in range(tp.size)]
            dist.all_gather(parts, local.contiguous(), group=tp.group)
        out[key] = assemble_from_shards([s[key] for s in every_rank], parts).cpu().contiguous()
    return out


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], replace: bool,
           extra_files: Mapping[str, str | os.PathLike[str]]) -> None:
    """The adapter directory, written whole under a temporary name and swapped in, carrying plait's
    marker: only an absent or empty directory, or (with ``replace``) a model directory plait wrote,
    is ever replaced, and a reader never sees half an adapter."""
    with written_whole(directory, "hf-model", what="the adapter directory", replace=replace,
                       replace_hint="allow replacing it (--overwrite, checkpoint.overwrite=true)") as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, source in extra_files.items():
            shutil.copyfile(source, tmp / name)


# ------------------------------------------------------------------------------ read
def read_peft_settings(directory: str | os.PathLike[str]) -> LoraSettings:
    """The :class:`LoraSettings` of a PEFT LoRA directory (to :func:`~plait.lora.apply_lora` before loading).

    Refuses what plait's adapters cannot express (DoRA, per-module ranks or alphas, trained biases,
    transposed weights, a subset of layers), naming the field.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PeftAdapterError(f"{path}: cannot read the PEFT adapter config ({e})") from None
    if not isinstance(config, dict):
        raise PeftAdapterError(f"{path}: holds a JSON {type(config).__name__}, not the object of a PEFT adapter "
                               f"config")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r} (plait reads LORA adapters only)")
    unsupported = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "rank_pattern": {},
                   "alpha_pattern": {}, "layers_to_transform": None, "modules_to_save": None}
    for field, wanted in unsupported.items():
        if config.get(field, wanted) not in (wanted, None, [], {}):
            problems.append(f"{field}={config[field]!r} (plait supports only {wanted!r})")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        problems.append(f"target_modules={targets!r} (plait needs a list of projection names, e.g. "
                        f"{list(TARGETS[:4])})")
    if problems:
        raise PeftAdapterError(f"{path}: " + "; ".join(problems))
    assert isinstance(targets, list)
    ordered = tuple(t for t in TARGETS if t in targets) + tuple(t for t in targets if t not in TARGETS)
    raw: Any = config  # LoraSettings checks each value's type and names the field
    try:
        return LoraSettings(rank=raw.get("r"), alpha=raw.get("lora_alpha"),
                            dropout=config.get("lora_dropout", 0.0), target_modules=ordered,
                            rslora=bool(config.get("use_rslora", False)))
    except LoraSettingsError as e:
        raise PeftAdapterError(f"{path}: {e} (PEFT fields: r, lora_alpha, lora_dropout, target_modules)") from e


@torch.no_grad()
def load_peft_adapter(modules: list[nn.Module], directory: str | os.PathLike[str]) -> int:
    """Read a PEFT LoRA adapter into the adapters of ``modules`` (each rank reads only its slices).

    The adapters must already exist (:func:`~plait.lora.apply_lora` with the directory's settings,
    see :func:`read_peft_settings`) with the same rank and scale. Tensors for blocks ``modules`` do
    not hold (other pipeline stages) are skipped; a missing tensor, or one for a projection that has
    no adapter here, is an error. Returns the number of projections read.
    """
    directory = Path(directory)
    settings = read_peft_settings(directory)
    found = {proj.name: (proj, adapter) for proj, adapter in adapted(modules)}
    if not found:
        raise PeftAdapterError("the model has no LoRA adapters; call plait.lora.apply_lora with "
                               "plait.lora.read_peft_settings(directory) first")
    _check_settings(directory, settings, found)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise PeftAdapterError(f"{weights}: missing; a PEFT adapter directory holds {WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
        held = _match_keys(weights, keys, found, config_of(modules[0]).num_hidden_layers)
        missing = [peft_key(n, ab) for n in found for ab in "AB" if (n, ab) not in held]
        if missing:
            raise PeftAdapterError(f"{weights}: no tensors {missing[:4]} ({len(missing)} missing); the adapter "
                                   f"does not cover the projections apply_lora adapted (target_modules)")
        for (name, ab), key in held.items():
            adapter = found[name][1]
            param, spec = (adapter.A, adapter.a_spec) if ab == "A" else (adapter.B, adapter.b_spec)
            full_shape = spec.full_shape if spec is not None else tuple(param.shape)
            got = tuple(f.get_slice(key).get_shape())
            if got != tuple(full_shape):
                raise PeftAdapterError(f"{weights}: {key} has shape {list(got)}, the model's adapter expects "
                                       f"{list(full_shape)}; apply_lora with the adapter's rank and target_modules")
            _read_slices(f.get_slice(key), spec, param)
    return len(found)


def _check_settings(directory: Path, settings: LoraSettings, found: dict[str, Any]) -> None:
    _, adapter = next(iter(found.values()))
    rank = adapter.full_a_shape[0]
    if rank != settings.rank or not math.isclose(adapter.scale, settings.scale, rel_tol=1e-6):
        raise PeftAdapterError(
            f"{directory / CONFIG_FILE}: r={settings.rank}, lora_alpha={settings.alpha}, use_rslora={settings.rslora} "
            f"(scale {settings.scale:g}) but the model's adapters have rank {rank} and scale {adapter.scale:g}; "
            f"apply_lora with plait.lora.read_peft_settings(directory)")


def _match_keys(weights: Path, keys: list[str], found: dict[str, Any],
                num_layers: int) -> dict[tuple[str, str], str]:
    """``(projection name, "A"/"B") -> key`` for the tensors of projections ``found`` holds.

    Keys of blocks this rank does not hold are skipped (other pipeline stages), but a key of a
    layer the whole model does not have (``num_layers``) means the adapter is of another model."""
    held: dict[tuple[str, str], str] = {}
    unknown, unadapted, beyond = [], [], []
    held_blocks = {name.rsplit(".", 2)[0] for name in found}
    for key in keys:
        m = _KEY.match(key)
        if m is None:
            unknown.append(key)
            continue
        name = m.group("module")
        layer = _LAYER.search(name)
        if layer is not None and int(layer.group(1)) >= num_layers:
            beyond.append(key)
            continue
        if name in found:
            held[(name, m.group("ab"))] = key
        elif name.rsplit(".", 2)[0] in held_blocks:
            unadapted.append(key)
    if beyond:
        raise PeftAdapterError(f"{weights}: tensors {beyond[:2]} adapt layers beyond the model's {num_layers} "
                               f"decoder layers; the adapter was trained on another model: give its own base")
    if unknown:
        raise PeftAdapterError(f"{weights}: tensors {unknown[:4]} are not LoRA weights of a decoder projection "
                               f"(plait reads adapters on {', '.join(TARGETS)} only)")
    if unadapted:
        raise PeftAdapterError(f"{weights}: tensors {unadapted[:4]} adapt projections the model has no adapter "
                               f"on; apply_lora with the adapter's target_modules (read_peft_settings)")
    return held


def _read_slices(tensor_slice: Any, spec: ShardSpec | None, out: torch.Tensor) -> None:
    """Copy this rank's slices of one tensor (contiguous runs of ``spec``; padding stays zero)."""
    if spec is None:
        out.copy_(tensor_slice[:].to(out.dtype))
        return
    out.zero_()
    for local, full, n in spec.runs():
        if spec.dim == 0:
            out[local:local + n].copy_(tensor_slice[full:full + n].to(out.dtype))
        else:
            out[:, local:local + n].copy_(tensor_slice[:, full:full + n].to(out.dtype))
