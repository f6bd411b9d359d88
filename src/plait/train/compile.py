"""Compiled decoder blocks and loss head (``train.compile``), their cache and their compile time.

What is compiled: in each of this rank's stages, the decoder blocks (``...layers.<i>``) and the
loss head (the final norm, ``model.norm`` in Llama's names, and the loss module ``output``), cut into units by
:func:`compile_units`; each unit is one ``torch.compile`` (inductor: C++/OpenMP kernels on CPU,
Triton on CUDA) installed through ``nn.Module``'s own compiled-call hook, so parameter names, state
dicts, hooks and the optimizer's flat buffers are untouched, and all blocks share one compiled
graph (dynamo treats the parameters as inputs). Without tensor parallelism a unit is a whole block.

Tensor parallelism: plait's TP layers communicate inside their own autograd Functions
(:mod:`plait.comm.collectives`, the column-parallel matmul), which dynamo would try to trace,
backward included, and cannot (process groups, async work handles, in-place all-reduce). The
modules that communicate are therefore not units (:func:`runs_eagerly`): they run eagerly, a graph
break at every TP boundary, and the compute between two collectives (rotary + SDPA, SwiGLU, norms
without sequence parallelism) is compiled. The collectives run exactly as in eager mode (same
process groups, same order on every rank), so sequence parallelism, KV replication and head
padding need nothing else.

Activation checkpointing: recomputation must run the same code as the forward it replaces, or
``torch.utils.checkpoint`` sees different saved tensors; a compiled region holding a checkpoint
would recompute eagerly (backward runs outside dynamo). So a checkpointed module is never inside
a unit: with ``full`` checkpointing each block's children (norms, attention, MLP) are the units and
the block's eager checkpoint recomputes them through the same compiled graphs; with ``selective``
checkpointing of ``self_attn.core``/``mlp.act`` those two run eagerly and the norms are compiled.

Dropout: inductor's own random number generator would draw masks unlike eager mode's; units are
compiled with ``fallback_random`` so dropout draws from the same generators as eagerly. Modules
that fork the per-TP-rank stream (:class:`~plait.tensor_parallel.random.TensorParallelRNG`, a
generator-state swap) with dropout on run eagerly. Compiled and eager runs draw identical masks,
and checkpoint recomputation replays them as before.

Mixture-of-Experts layers run eagerly, whole (:class:`~plait.nn.moe.MoELayer`: routing decides
the rows each expert gets, the expert-parallel exchange communicates, and the load statistics
and step-load hooks have side effects); the rest of an MoE block (norms, attention) is compiled
as in a dense block.

Evaluation and generation run with gradients off; compiled units then run their eager forward
(:class:`_TrainingOnly`), so sampling text of growing length does not recompile for every length.

The cache: inductor's and AOTAutograd's on-disk caches go to ``<plait cache>/compile`` (the
directory of ``data.cache_dir``, ``$PLAIT_CACHE`` or ``~/.cache/plait``) unless
``$TORCHINDUCTOR_CACHE_DIR`` is already set, so a second run of the same recipe loads its kernels
instead of generating and building them. :func:`compile_seconds` is the time dynamo and inductor
spent compiling in this process (forward and the lazily compiled backward), which the trainer
reports as ``compile_s`` and leaves out of tokens/s.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.activation_checkpointing import checkpointed_modules, decoder_blocks
from plait.data.tokenizer import cache_dir
from plait.models.decoder.config import DecoderConfig
from plait.models.registry import family_of
from plait.nn.moe import MoELayer
from plait.tensor_parallel.random import TensorParallelRNG

#: ``train.compile_mode`` values: torch.compile's modes without CUDA graphs (plait's steps keep
#: collectives and graph breaks between units, which CUDA graph capture does not take)
MODES = ("default", "max-autotune-no-cudagraphs")
#: inductor settings of every unit: dropout draws from the eager generators (see the module docstring)
INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}
#: the loss head's modules in a last stage of Llama's names (the whole model has the same names); a
#: family names its final norm among its pipeline units (:func:`head_modules`)
HEAD_MODULES = ("model.norm", "output")
#: weight-free modules worth compiling on their own (rotary + attention, SwiGLU, the loss)
WEIGHT_FREE = ("core", "act", "output")
#: the cumulative timers of :mod:`torch._dynamo.utils` that are compilation (forward frames and
#: the backward graphs AOTAutograd compiles at the first backward)
_COMPILE_TIMERS = ("entire_frame_compile", "entire_backward_compile")


def compile_cache_dir(root: str | os.PathLike | None = None) -> Path:
    """Where the compile caches live: ``$TORCHINDUCTOR_CACHE_DIR`` when the user set it, else
    ``<plait cache>/compile`` (``root``: ``data.cache_dir``). Inductor writes its own default
    (``/tmp/torchinductor_<user>``) into that variable once it has looked it up, so a value equal to
    that default counts as unset."""
    # imported here, not at the top: importing inductor costs seconds, which only compiling runs pay
    # (the trainer imports this module in every run)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and os.path.abspath(env) != os.path.abspath(default_cache_dir()):
        return Path(env)
    return cache_dir(root) / "compile"


def use_compile_cache(root: str | os.PathLike | None = None) -> Path:
    """Point inductor's caches at :func:`compile_cache_dir` (before the first compilation); returns it."""
    path = compile_cache_dir(root)
    path.mkdir(parents=True, exist_ok=True)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(path):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        from torch._inductor.utils import clear_caches  # see compile_cache_dir

        clear_caches()  # inductor's in-memory lookups of the previous directory
    return path


def compile_seconds() -> float:
    """Seconds dynamo and inductor have spent compiling in this process so far (cache hits included:
    loading a cached graph counts too, and is what a second run's ``compile_s`` measures)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    spent = getattr(dynamo_utils, "cumulative_time_spent_ns", {})
    return sum(spent.get(k, 0.0) for k in _COMPILE_TIMERS) / 1e9


def runs_eagerly(module: nn.Module) -> bool:
    """Whether ``module`` must stay out of compiled graphs: it communicates over a tensor-parallel
    group of more than one rank (plait's parallel layers, norms and losses call collectives inside
    their own autograd Functions, which dynamo cannot trace), or it draws dropout from the per-TP-rank
    stream (a generator-state swap). Its children may still be compiled."""
    tp = getattr(module, "tp", None)
    if getattr(tp, "size", 1) > 1:
        return True
    if getattr(module, "context_parallel", None) is not None:
        return True
    forks = isinstance(getattr(module, "rng", None), TensorParallelRNG)
    return forks and bool(getattr(module, "dropout", 0.0) or getattr(module, "p", 0.0))


def compile_units(stage: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the units :func:`compile_stages` compiles in ``stage`` (a whole model
    or a pipeline stage): in each decoder block and in the loss head (final norm, loss module), the
    largest modules that hold neither a module that :func:`runs_eagerly` nor an activation-
    checkpointed one; such a module runs eagerly and its children are considered in turn."""
    checkpointed = {id(m) for _, m in checkpointed_modules(stage)}

    def boundary(m: nn.Module) -> bool:
        return id(m) in checkpointed or runs_eagerly(m) or isinstance(m, MoELayer)

    units: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if isinstance(module, MoELayer):  # data-dependent routing: the whole layer runs eagerly
            return
        if not any(boundary(m) for m in module.modules()):
            # a lone projection is one matmul kernel either way: compiling it only adds a call layer
            if not isinstance(module, nn.Linear) and (any(True for _ in module.parameters())
                                                      or name.endswith(WEIGHT_FREE)):
                units.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}", child)

    present = dict(stage.named_modules())
    roots = decoder_blocks(stage) + [(name, present[name]) for name in head_modules(stage) if name in present]
    for name, root in roots:
        visit(name, root)
    return units


def head_modules(stage: nn.Module) -> tuple[str, ...]:
    """The loss head's module names in ``stage``: its family's final norm (the pipeline unit of kind
    ``norm``, e.g. ``gpt_neox.final_layer_norm``) and the loss module; :data:`HEAD_MODULES` for a
    module that is not a family's model or stage."""
    config = getattr(stage, "config", None)
    if not isinstance(config, DecoderConfig):
        return HEAD_MODULES
    norms = [u.name for u in family_of(config).units(config) if u.kind == "norm"]
    return (*norms, "output")


class _TrainingOnly:
    """A module's call: the compiled one while gradients are on (training steps), the eager one
    otherwise (evaluation, generation). Set as the module's ``_compiled_call_impl``, the hook
    ``nn.Module.compile`` itself uses; holds the module weakly-free (the bound call) like it does."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.compiled, self.eager = compiled, eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.compiled if torch.is_grad_enabled() else self.eager)(*args, **kwargs)


def inductor_options(mode: str) -> dict[str, Any]:
    """The inductor options of ``mode`` plus plait's own: torch.compile refuses ``mode`` and
    ``options`` together, so a mode is passed as the options it stands for."""
    from torch._inductor import list_mode_options  # dynamo/inductor load only in runs that compile

    return {**list_mode_options(mode), **INDUCTOR_OPTIONS}


def compile_stages(stages: list[nn.Module], mode: str = "default") -> list[str]:
    """Compile the :func:`compile_units` of ``stages`` in place (after tensor parallelism, LoRA,
    pipeline splitting and activation checkpointing); returns the qualified names compiled."""
    if mode not in MODES:
        raise ValueError(f"compile mode={mode!r} is not valid; valid: {', '.join(map(repr, MODES))}")
    names = []
    for stage in stages:
        for name, module in compile_units(stage):
            eager = module._call_impl
            compiled = torch.compile(eager, dynamic=False, options=inductor_options(mode))
            module._compiled_call_impl = _TrainingOnly(compiled, eager)
            names.append(name)
    if not names:
        warnings.warn("train.compile: nothing to compile in this rank's stages (every module of its blocks "
                      "communicates or is activation-checkpointed; see docs/compile.md)", stacklevel=2)
    return names


def is_compiled(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_compiled_call_impl", None), _TrainingOnly)


__all__ = ["HEAD_MODULES", "INDUCTOR_OPTIONS", "MODES", "compile_cache_dir", "compile_seconds", "compile_stages",
           "compile_units", "head_modules", "inductor_options", "is_compiled", "use_compile_cache"]
