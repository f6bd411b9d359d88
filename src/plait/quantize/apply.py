"""Store the frozen base projections of a model's decoder blocks quantized (QLoRA), in place.

Works on whatever a rank holds (the unsharded model, its tensor-parallel twin, pipeline stages):
each rank quantizes only the weights it holds, right after they were read.

Tensor-parallel invariance. A weight is quantized in units that tensor parallelism never cuts:
a column projection (q/k/v, gate/up, GPT-NeoX's query_key_value and dense_h_to_4h: output rows
split over TP) by rows, a row projection (o/down, dense, dense_4h_to_h: input features split) by
columns, each unit in blocks along the hidden size. A rank's slice is then a set of whole units
of the full weight (padding units are zero, replicated K/V rows are equal), and its quantized
values are exactly those of one process quantizing the full weight; the plain model quantizes
by the same rule, by projection name, so TP=1 holds the same values as TP=2.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from plait.deferred import DeferredValues, is_placeholder
from plait.lora.apply import projections
from plait.lora.settings import COLUMN_TARGETS, ROW_TARGETS
from plait.quantize.blockwise import METHODS, quantize_rows
from plait.quantize.tensor import QuantizedWeight
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear

#: the block length along the hidden size (QLoRA's 64)
DEFAULT_BLOCK_SIZE = 64


class QuantizeError(ValueError):
    """A model whose base cannot be quantized as asked (the message names the module and the fix)."""


@dataclass(frozen=True)
class QuantizeSummary:
    """What :func:`quantize_base_` did on this rank: projections, elements, bytes before and after."""

    projections: int
    elements: int
    dense_bytes: int
    stored_bytes: int

    def of_bf16(self) -> float:
        """The stored bytes as a fraction of the same weights in bf16 (QLoRA's figure of merit)."""
        return self.stored_bytes / max(1, 2 * self.elements)


def quantize_base_(modules: list[nn.Module], method: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
                   values: DeferredValues | None = None, round_to: torch.dtype | None = None) -> QuantizeSummary:
    """Replace the weight of every projection of every decoder block of ``modules`` by a
    :class:`QuantizedWeight` (biases stay as they are). The weights must already be frozen: the
    quantized base has no gradient. Every projection is checked before any is changed.

    ``values``: the stages were built with placeholders (:mod:`plait.deferred`); each projection's
    values are then read (or initialised) one projection at a time and quantized at once, and the
    other placeholders (embeddings, norms, biases, the head) are filled whole, so the build never
    holds more than one dense projection beyond the quantized base. The values are bitwise those
    of the normal build.

    ``round_to``: the values are rounded to this dtype first (a bf16 preset's parameter dtype: the
    base it would hold unquantized); ``None`` quantizes them as they are."""
    if method not in METHODS:
        raise QuantizeError(f"quantization method {method!r} is not known; use one of {', '.join(METHODS)}")
    found = list(projections(modules))
    if not found:
        raise QuantizeError("the model has no decoder-block projections to quantize")
    for proj in found:
        _check_quantizable(proj.name, proj.target, proj.module, block_size)
    elements = dense_bytes = stored = 0
    with values if values is not None else contextlib.nullcontext():  # the files open once
        for proj in found:
            weight = proj.module.weight
            assert isinstance(weight, nn.Parameter)  # checked above
            transposed = proj.target in ROW_TARGETS
            dense = _value_of(weight, values)
            if round_to is not None:
                dense = dense.to(round_to)
            rows = quantize_rows(dense.t() if transposed else dense, method, block_size)
            del dense
            quantized = QuantizedWeight(rows, transposed, weight.dtype)
            elements += weight.numel()
            dense_bytes += weight.numel() * weight.element_size()
            stored += quantized.nbytes_stored()
            del proj.module._parameters["weight"]
            # not persistent: a QLoRA run saves only its adapters, and the base is re-read and
            # quantized again on resume (the same values: quantization is deterministic)
            proj.module.register_buffer("weight", quantized, persistent=False)
        if values is not None:
            fill_placeholders_(modules, values)
    return QuantizeSummary(len(found), elements, dense_bytes, stored)


@torch.no_grad()
def fill_placeholders_(modules: list[nn.Module], values: DeferredValues) -> None:
    """Give every placeholder parameter left in ``modules`` its values, whole (tied ones once)."""
    with values:
        for module in modules:
            for p in module.parameters():
                if values.holds(p) and is_placeholder(p):
                    p.data = _value_of(p, values)


def _value_of(weight: torch.Tensor, values: DeferredValues | None) -> torch.Tensor:
    """The dense value of ``weight``: itself, or, for a placeholder, its values in its dtype."""
    if values is None or not values.holds(weight) or not is_placeholder(weight):
        return weight
    with values:
        return values.flat_range(weight, 0, weight.numel()).view(weight.shape).to(weight.dtype)


def quantized_weights(modules: list[nn.Module]) -> list[tuple[str, QuantizedWeight]]:
    """``(projection name, quantized weight)`` of every quantized projection of ``modules``."""
    return [(proj.name, proj.module.weight) for proj in projections(modules)
            if isinstance(proj.module.weight, QuantizedWeight)]


@torch.no_grad()
def dequantize_base_(modules: list[nn.Module]) -> int:
    """Put the dequantized values back as ordinary (frozen) parameters; returns how many. A model
    made so computes exactly what the quantized one did (merging an adapter into it is exact)."""
    count = 0
    for proj in projections(modules):
        weight = proj.module.weight
        if isinstance(weight, QuantizedWeight):
            dense = weight.dense().contiguous()
            del proj.module._buffers["weight"]
            proj.module.weight = nn.Parameter(dense, requires_grad=False)
            count += 1
    return count


def _check_quantizable(name: str, target: str, module: nn.Module, block_size: int) -> None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, QuantizedWeight):
        raise QuantizeError(f"{name} is already quantized; quantize_base_ was called twice on this model")
    linear = isinstance(module, nn.Linear | ColumnParallelLinear | RowParallelLinear)
    if not linear or not isinstance(weight, nn.Parameter):
        raise QuantizeError(f"{name} is a {type(module).__name__}; quantization supports nn.Linear, "
                            f"ColumnParallelLinear and RowParallelLinear projections only")
    if weight.requires_grad:
        raise QuantizeError(f"{name} trains (requires_grad); only a frozen base can be stored quantized: "
                            f"apply LoRA first, which freezes it")
    if target not in COLUMN_TARGETS + ROW_TARGETS:
        raise QuantizeError(f"{name}: {target} is neither a column nor a row projection; plait does not know "
                            f"which of its dimensions tensor parallelism splits")
    along = int(weight.shape[0] if target in ROW_TARGETS else weight.shape[1])
    if along % block_size or block_size % 2:
        raise QuantizeError(f"{name}: its {along} features along the hidden size do not split into blocks of "
                            f"{block_size} (an even number dividing the hidden size); use "
                            f"{suggested_block_size(along)}")


def suggested_block_size(hidden: int) -> str:
    """The even divisors of ``hidden`` closest to QLoRA's 64, for a message (largest first)."""
    sizes = [b for b in range(64, 1, -2) if hidden % b == 0][:2]
    return " or ".join(str(b) for b in sizes) if sizes else f"none: {hidden} has no even divisor up to 64"


@torch.no_grad()
def cast_base_(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Cast every frozen parameter and quantized weight of ``modules`` to ``dtype`` (the adapters and
    anything else that trains keep their dtype); a quantized weight keeps its codes and dequantizes
    into ``dtype`` from then on."""
    for module in modules:
        for sub in module.modules():
            for p in sub._parameters.values():
                if p is not None and not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(dtype)
            for key, b in sub._buffers.items():
                if isinstance(b, QuantizedWeight):
                    sub._buffers[key] = b.to(dtype)
