"""A frozen weight held quantized, that every operator sees as the dense weight it stands for.

:class:`QuantizedWeight` is a tensor subclass (``__torch_dispatch__``, below autograd) of the
weight's logical shape and compute dtype. Layers use it exactly like the dense weight:
``F.linear``, the fused column-parallel matmul, ``.to(bf16)`` under a precision preset. Every
operator but the few handled here receives the dequantized values, computed at the moment of use.
The handled ones keep it quantized: ``detach`` and ``alias``; ``t`` / ``transpose``, which flip a
flag; ``_to_copy``, which changes the (floating) dtype it dequantizes to or moves its storage;
``clone`` and ``deepcopy``, which copy the codes. An operator that would write into it is refused
(the write would go to a dense temporary and be lost). Autograd
therefore saves the quantized weight, not a dense copy, for the input gradient of a matmul (the
frozen base has no gradient of its own), and the dense values exist only inside one operator.

The storage is a :class:`~plait.quantize.blockwise.QuantizedRows`: the weight's rows, or its
columns (``stored_transposed``) for a row-parallel projection, whose input features tensor
parallelism splits. The quantized rows are then always whole units of the full weight (see
:mod:`plait.quantize.apply`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from plait.quantize.blockwise import QuantizedRows

aten = torch.ops.aten


class QuantizedWeight(torch.Tensor):
    """The dense ``[out, in]`` weight (``dtype``) that ``rows`` encode (``stored_transposed``: rows are columns)."""

    rows: QuantizedRows
    stored_transposed: bool

    @staticmethod
    def __new__(cls, rows: QuantizedRows, stored_transposed: bool, dtype: torch.dtype) -> QuantizedWeight:
        r, c = rows.shape
        shape = (c, r) if stored_transposed else (r, c)
        strides = (1, shape[0]) if stored_transposed else (shape[1], 1)
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=strides, dtype=dtype,
                                                   device=rows.codes.device, requires_grad=False)

    def __init__(self, rows: QuantizedRows, stored_transposed: bool, dtype: torch.dtype) -> None:
        self.rows, self.stored_transposed = rows, stored_transposed

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def dense(self) -> torch.Tensor:
        """The dequantized weight (a plain tensor of this tensor's shape and dtype)."""
        values = self.rows.dequantize(self.dtype)
        return values.t() if self.stored_transposed else values

    def nbytes_stored(self) -> int:
        """Bytes the quantized storage takes (what this weight costs in memory)."""
        return self.rows.nbytes()

    def _with(self, *, rows: QuantizedRows | None = None, flip: bool = False,
              dtype: torch.dtype | None = None) -> QuantizedWeight:
        return QuantizedWeight(self.rows if rows is None else rows, self.stored_transposed ^ flip,
                               self.dtype if dtype is None else dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"QuantizedWeight({self.rows.method}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"block_size={self.rows.block_size}, stored_transposed={self.stored_transposed})")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, QuantizedWeight):
            if func in (aten.detach.default, aten.alias.default):
                return first._with()
            if func is aten.t.default:
                return first._with(flip=True)
            if func is aten.transpose.int and {d % 2 for d in args[1:3]} == {0, 1}:
                return first._with(flip=True)
            if func is aten._to_copy.default and _keeps_quantized(kwargs):
                device = kwargs.get("device")
                rows = first.rows.to(device) if device is not None and device != first.device else None
                return first._with(rows=rows, dtype=kwargs.get("dtype"))
            if func is aten.clone.default:
                return first._with(rows=first.rows.clone())
        _refuse_writes(func, args, kwargs)

        def unwrap(x: Any) -> Any:
            return x.dense() if isinstance(x, QuantizedWeight) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    def __deepcopy__(self, memo: dict) -> QuantizedWeight:
        return self._with(rows=self.rows.clone())


def _keeps_quantized(kwargs: dict) -> bool:
    """Whether a ``_to_copy`` only changes the floating dtype or the device (``.to(bf16)``,
    ``.to("cuda")``, ``module.to(...)``): then the copy stays quantized; anything else (an integer
    dtype, another layout or memory format, pinned memory) gets the dense values."""
    dtype = kwargs.get("dtype")
    return ((dtype is None or dtype.is_floating_point)
            and kwargs.get("layout") in (None, torch.strided)
            and kwargs.get("memory_format") in (None, torch.preserve_format)
            and not kwargs.get("pin_memory"))


def _refuse_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """An operator that writes into a :class:`QuantizedWeight` (``add_``, ``copy_``, an initialiser)
    would write into a dense temporary and be lost: refuse it instead."""
    schema = func._schema
    if not schema.is_mutable:
        return
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, QuantizedWeight):
            raise QuantizedWeightWriteError(
                f"{func} would write into a quantized weight, and the write would be lost (it holds codes, "
                f"not values); dequantize the base first (plait.quantize.dequantize_base_)")


class QuantizedWeightWriteError(RuntimeError):
    """An in-place operator applied to a :class:`QuantizedWeight`."""
