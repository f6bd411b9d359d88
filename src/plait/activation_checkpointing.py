"""Activation checkpointing of decoder blocks or named parts of them, with exact dropout replay.

Applied last: after the tensor-parallel swap (so the modules checkpointed are the parallel ones,
collectives included) and after pipeline splitting (so it works on whole models and on stages
alike, finding the blocks under ``.layers.<i>`` in each module it is given).

A checkpointed module's ``forward`` is replaced on the instance by one that runs the original
under ``torch.utils.checkpoint`` (non-reentrant). Nothing is re-parented or renamed: parameter
and module names, which the rest of plait maps everything by, stay what they were.

Recomputation must redraw exactly the dropout masks of the original forward, or the gradients
belong to a different network than the loss. ``torch.utils.checkpoint`` restores the global CPU
and CUDA generators; the per-TP-rank stream (:class:`~plait.tensor_parallel.random.TensorParallelRNG`)
is a separate state it does not know about, so a ``context_fn`` records the tracker's state when
the checkpointed forward starts and, around the recomputation, sets the tracker to it and puts
the tracker's then-current state back afterwards (later forwards, e.g. the next pipeline
micro-batch's, may have advanced it in between).

Recomputation runs the module's TP collectives again; every rank of a TP group recomputes the
same modules in the same order (backward order is the same on all ranks), so they still match.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from plait.tensor_parallel.random import RNGState, TensorParallelRNG

#: the accepted ``mode`` values; ``"none"`` is an alias of ``"off"`` (the planner's spelling)
MODES = ("off", "full", "selective")
_ALIASES = {"none": "off"}

#: what ``"selective"`` checkpoints when no names are given and the model config does not say
#: (its ``selective_checkpoint_modules``): the weight-free parts of Llama's block, whose saved
#: activations are large and cheap to recompute (what :mod:`plait.plan.memory` models)
DEFAULT_SELECTIVE = ("self_attn.core", "mlp.act")
#: the block submodules of Llama's block, for a config that does not name its own
_LLAMA_BLOCK = ("input_layernorm", "self_attn", "self_attn.core", "post_attention_layernorm", "mlp", "mlp.act")

_BLOCK_NAME = re.compile(r"(?:^|\.)layers\.\d+$")
_WRAPPED = "_plait_checkpointed"
#: the instance attribute of a wrapped module holding the tracker its recomputation replays
_CHECKPOINT_RNG = "_checkpoint_rng"


def checkpointable_names(config: Any) -> list[str]:
    """Module names inside one decoder block that ``"selective"`` may checkpoint (block-relative).

    The same names exist before and after the tensor-parallel swap. In Llama's block (and the
    families built on it) ``self_attn.core`` is rotary, SDPA and attention dropout and ``mlp.act``
    the SwiGLU product; a family whose block differs names its own in its config's
    ``checkpointable_modules`` (GPT-NeoX: ``attention``, ``attention.core``, ``mlp.act`` its GeLU).
    """
    return list(getattr(config, "checkpointable_modules", _LLAMA_BLOCK))


def default_selective(config: Any) -> tuple[str, ...]:
    """What ``"selective"`` checkpoints without names: the config's ``selective_checkpoint_modules``
    (the weight-free parts of its block), :data:`DEFAULT_SELECTIVE` for a config that names none."""
    return tuple(getattr(config, "selective_checkpoint_modules", DEFAULT_SELECTIVE))


def decoder_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` for every module at ``...layers.<i>`` (a whole model or a stage)."""
    return [(name, m) for name, m in module.named_modules() if _BLOCK_NAME.search(name)]


def apply_activation_checkpointing(modules: list[nn.Module], mode: str, names: list[str] | None = None) -> int:
    """Checkpoint the decoder blocks of ``modules`` (whole models or pipeline stages), in place.

    ``mode``: ``"off"`` (nothing; ``"none"`` is accepted too), ``"full"`` (each decoder block) or
    ``"selective"`` (the submodules ``names`` of each block, relative to the block; default
    :func:`default_selective` of the first module's config; valid names: :func:`checkpointable_names`).
    Returns the number of
    modules wrapped. Each module's ``rng_tracker`` (set by :mod:`plait.materialize` and
    ``parallelize``) is replayed on recomputation. Applying it twice to one module is an error.
    """
    if mode not in MODES and mode not in _ALIASES:
        raise ValueError(f"activation checkpointing mode={mode!r} is not valid; valid: "
                         f"{', '.join(map(repr, MODES))}")
    mode = _ALIASES.get(mode, mode)
    if names is not None and mode != "selective":
        raise ValueError(f"activation checkpointing names={names!r} are only used with mode='selective', "
                         f"not mode={mode!r}")
    if mode == "off":
        return 0
    selected: list[str] = []
    if mode == "selective":
        config = getattr(modules[0], "config", None) if modules else None
        selected = list(default_selective(config) if names is None else names)
        if not selected:
            raise ValueError("activation checkpointing mode='selective' with names=[] checkpoints nothing; "
                             "give module names or use mode='off'")
        for outer in selected:  # nested checkpoints would recompute the inner module twice
            for inner in selected:
                if inner.startswith(outer + "."):
                    raise ValueError(f"activation checkpointing names overlap: {inner!r} is inside {outer!r}; "
                                     f"name one of them")

    targets: list[tuple[nn.Module, TensorParallelRNG | None]] = []
    for root in modules:
        tracker = getattr(root, "rng_tracker", None)
        blocks = decoder_blocks(root)
        if mode == "full":
            targets += [(block, tracker) for _, block in blocks]
            continue
        if getattr(root, "config", None) is None:
            raise ValueError(f"activation checkpointing mode='selective' needs modules with a model config "
                             f"`config` attribute (a model or a pipeline stage); {type(root).__name__} has none")
        valid = checkpointable_names(root.config)
        for block_name, block in blocks:
            present = {n for n, _ in block.named_modules()}
            for name in selected:
                if name not in valid or name not in present:
                    raise ValueError(
                        f"activation checkpointing: {name!r} is not a checkpointable module of block "
                        f"{block_name!r}; valid names: {', '.join(n for n in valid if n in present)}")
                targets.append((block.get_submodule(name), tracker))

    seen: set[int] = set()
    for module, _ in targets:
        if getattr(module, _WRAPPED, False) or id(module) in seen:
            raise ValueError(f"activation checkpointing: {type(module).__name__} is already checkpointed "
                             f"(apply_activation_checkpointing was called twice, or names overlap)")
        if "forward" in vars(module):
            raise ValueError(f"activation checkpointing: {type(module).__name__} already has an instance-level "
                             f"forward; cannot wrap it without losing it")
        seen.add(id(module))
    for module, tracker in targets:
        _wrap(module, tracker)
    return len(targets)


# ------------------------------------------------------------------------------ wrapping
def _wrap(module: nn.Module, tracker: TensorParallelRNG | None) -> None:
    """Replace ``module.forward`` on the instance by the checkpointed class forward.

    Bound with ``MethodType`` (not a closure over ``module``) so that ``copy.deepcopy`` of a model
    rebinds it to the copy; the tracker is a module attribute for the same reason.
    """
    setattr(module, _CHECKPOINT_RNG, tracker)
    setattr(module, _WRAPPED, True)
    module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():  # evaluation / generation: nothing is saved, nothing to recompute
        return inner(*args, **kwargs)
    tracker: TensorParallelRNG | None = getattr(self, _CHECKPOINT_RNG)
    context_fn = torch_checkpoint.noop_context_fn if tracker is None else tracker_context_fn(tracker)
    return torch_checkpoint.checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True,
                                       context_fn=context_fn, **kwargs)


def tracker_context_fn(*trackers: TensorParallelRNG) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that replays ``trackers`` on recomputation.

    ``checkpoint`` calls it once per checkpointed forward, just before running it; the first
    context wraps that forward and records the trackers' states on entry, the second wraps the
    recomputation and runs it from those states, restoring the trackers' current states after.
    """
    def context_fn() -> tuple[Any, Any]:
        recorded: list[RNGState] = []
        return _Record(trackers, recorded), _Replay(trackers, recorded)

    return context_fn


class _Record:
    def __init__(self, trackers: Iterable[TensorParallelRNG], recorded: list[RNGState]) -> None:
        self.trackers, self.recorded = tuple(trackers), recorded

    def __enter__(self) -> None:
        self.recorded[:] = [t.get_state() for t in self.trackers]

    def __exit__(self, *exc: Any) -> Literal[False]:
        return False


class _Replay:
    def __init__(self, trackers: Iterable[TensorParallelRNG], recorded: list[RNGState]) -> None:
        self.trackers, self.recorded = tuple(trackers), recorded
        self._current: list[RNGState] = []

    def __enter__(self) -> None:
        assert len(self.recorded) == len(self.trackers), "recomputation before the checkpointed forward ran"
        self._current = [t.get_state() for t in self.trackers]
        for t, state in zip(self.trackers, self.recorded, strict=True):
            t.set_state(state)

    def __exit__(self, *exc: Any) -> Literal[False]:
        # also on checkpoint's early stop, which ends the recomputation with an exception
        for t, state in zip(self.trackers, self._current, strict=True):
            t.set_state(state)
        return False


def checkpointed_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs under ``module`` that :func:`apply_activation_checkpointing` wrapped."""
    return ((n, m) for n, m in module.named_modules() if getattr(m, _WRAPPED, False))


__all__ = ["DEFAULT_SELECTIVE", "MODES", "apply_activation_checkpointing", "checkpointable_names",
           "checkpointed_modules", "decoder_blocks", "tracker_context_fn"]
