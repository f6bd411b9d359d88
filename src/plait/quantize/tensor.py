"""A frozen weight held quantized, that every operator sees as the dense weight it stands for.

:class:`QuantizedWeight` is a tensor subclass (``__torch_dispatch__``, below autograd) of the
weight's logical shape and compute dtype. Layers use it exactly like the dense weight:
``F.linear``, the fused column-parallel matmul, ``.to(bf16)`` under a precision preset. Every
operator but the few handled here receives the dequantized values, computed at the moment of use.
The handled ones keep it quantized: ``detach`` and ``alias``; ``t`` / ``transpose``, which flip a
flag; ``_to_copy``, which changes the dtype it dequantizes to or moves its storage. Autograd
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
            if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device", "non_blocking"}:
                device = kwargs.get("device")
                rows = first.rows.to(device) if device is not None and device != first.device else None
                return first._with(rows=rows, dtype=kwargs.get("dtype"))

        def unwrap(x: Any) -> Any:
            return x.dense() if isinstance(x, QuantizedWeight) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
