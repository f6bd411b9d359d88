"""Block-wise quantization of a weight's rows: NF4 with double-quantized scales, or int8.

QLoRA (Dettmers et al., 2023) stores a frozen weight as 4-bit NormalFloat codes, one absmax
scale per block of 64 values, and quantizes those scales again to int8 ("double quantization":
the scales minus their mean, in groups, each group with one fp32 factor). plait follows torchao's
``NF4Tensor`` step for step (the same code book, rounding, packing and scale arithmetic) with one
difference, which is the reason this file exists: torchao flattens the whole tensor it is given
and subtracts ONE mean over all of its scales, so a rank that quantizes its tensor-parallel slice
would get other values than one process quantizing the full weight. Here each ROW is its own
unit: its blocks run along the row and its scales form one double-quantization group with their
own mean. Cutting a weight into any set of rows therefore gives exactly the rows of the full
weight's quantization, and :mod:`plait.quantize.apply` lays every projection out so that tensor
parallelism only ever splits between rows (``tests/test_quantize.py`` checks both: each row
bitwise against torchao's ``to_nf4`` of that row, and every TP shard against the full weight).

A row of zeros (head padding, never trained) quantizes to zeros instead of torchao's NaNs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Method = Literal["nf4", "int8"]
METHODS: tuple[str, ...] = ("nf4", "int8")

#: the 16 NormalFloat levels (QLoRA's NF4 code book, as torchao and bitsandbytes store it)
NF4_LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
#: rows quantized at once when searching the nearest level (bounds the ``[rows, in, 16]`` temporary)
_ELEMENTS_PER_CHUNK = 1 << 20


@dataclass(frozen=True)
class QuantizedRows:
    """A ``[rows, length]`` matrix, quantized row by row in blocks of ``block_size``.

    ``nf4``: ``codes`` uint8 ``[rows, length / 2]`` (two 4-bit level indices per byte, the even
    element in the high nibble), ``scales`` int8 ``[rows, blocks]`` (the double-quantized block
    absmax), ``factor`` and ``mean`` fp32 ``[rows, 1]`` (a row's scale = ``scales / factor + mean``).
    ``int8``: ``codes`` int8 ``[rows, length]``, ``scales`` fp32 ``[rows, blocks]`` (absmax / 127);
    ``factor`` and ``mean`` are ``None``.
    """

    method: Method
    block_size: int
    codes: torch.Tensor
    scales: torch.Tensor
    factor: torch.Tensor | None
    mean: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        rows = int(self.codes.shape[0])
        return (rows, int(self.codes.shape[1]) * (2 if self.method == "nf4" else 1))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.factor, self.mean) if t is not None]

    def nbytes(self) -> int:
        """The bytes this matrix occupies (codes, scales and the per-row factors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedRows:
        def each(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)
        return QuantizedRows(self.method, self.block_size, fn(self.codes), fn(self.scales), each(self.factor),
                             each(self.mean))

    def clone(self) -> QuantizedRows:
        """A copy with its own storage."""
        return self._map(torch.clone)

    def to(self, device: torch.device) -> QuantizedRows:
        return self._map(lambda t: t.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[rows, length]`` values the codes stand for (computed in fp32, returned in ``dtype``)."""
        rows, length = self.shape
        blocks = length // self.block_size
        if self.method == "int8":
            values = self.codes.float().view(rows, blocks, self.block_size) * self.scales.unsqueeze(-1)
            return values.reshape(rows, length).to(dtype)
        assert self.factor is not None and self.mean is not None
        # row chunks into the output: the fp32 temporaries stay a few MB whatever the weight's size
        out = torch.empty(rows, length, dtype=dtype, device=self.codes.device)
        table = _byte_pairs(self.codes.device)
        step = max(1, _ELEMENTS_PER_CHUNK // max(1, length))
        for start in range(0, rows, step):
            end = min(rows, start + step)
            # a lookup of each code byte's two levels (``embedding``: several times faster than indexing)
            pairs = F.embedding(self.codes[start:end].int(), table).view(end - start, blocks, self.block_size)
            scales = self.scales[start:end].float() / self.factor[start:end] + self.mean[start:end]
            out[start:end] = pairs.mul_(scales.unsqueeze(-1)).view(end - start, length)
        return out


def _byte_pairs(device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the two levels each code byte stands for (high nibble first), so that
    dequantizing is one gather rather than two lookups and an interleave."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([levels[byte >> 4], levels[byte & 0b1111]], dim=-1)


def quantize_rows(matrix: torch.Tensor, method: str, block_size: int) -> QuantizedRows:
    """Quantize ``matrix`` (``[rows, length]``, ``length`` a multiple of ``block_size``) row by row.

    The arithmetic runs in fp32 whatever ``matrix``'s dtype, so a weight read in bf16 or fp32
    quantizes to the codes of its fp32 values.
    """
    if matrix.dim() != 2:
        raise ValueError(f"quantize_rows takes a [rows, length] matrix, got shape {tuple(matrix.shape)}")
    rows, length = matrix.shape
    if length % block_size or (method == "nf4" and block_size % 2):
        raise ValueError(f"rows of length {length} do not split into blocks of {block_size}"
                         f"{' (an even block size is needed for nf4)' if block_size % 2 else ''}")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; use one of {', '.join(METHODS)}")
    values = matrix.detach().float().contiguous().view(rows, length // block_size, block_size)
    absmax = values.abs().amax(dim=-1)  # [rows, blocks]
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    if method == "int8":
        scales = safe / 127.0
        codes = (values / scales.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        return QuantizedRows("int8", block_size, codes.view(rows, length),
                             torch.where(absmax == 0, torch.zeros_like(scales), scales), None, None)
    # double quantization: the block scales minus their row mean, to int8 against the row's absmax
    mean = absmax.mean(dim=-1, keepdim=True)
    centred = absmax - mean
    spread = centred.abs().amax(dim=-1, keepdim=True)
    factor = 256 / (2 * torch.where(spread == 0, torch.ones_like(spread), spread))
    scales = (centred * factor).round().clamp(-128, 127).to(torch.int8)
    codes = _nearest_levels(values / safe.unsqueeze(-1))
    packed = (codes[..., 0::2] << 4 | codes[..., 1::2]).view(rows, length // 2)
    return QuantizedRows("nf4", block_size, packed, scales, factor, mean)


def _nearest_levels(scaled: torch.Tensor) -> torch.Tensor:
    """Index of the NF4 level nearest each element (the first one on a tie, as torchao), uint8."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=scaled.device)
    flat = scaled.reshape(scaled.shape[0], -1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=scaled.device)
    step = max(1, _ELEMENTS_PER_CHUNK // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        chunk = flat[start:start + step]
        out[start:start + step] = (chunk.unsqueeze(-1) - levels).abs().min(dim=-1).indices.to(torch.uint8)
    return out.view(scaled.shape)
