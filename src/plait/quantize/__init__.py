"""Quantized frozen base weights under LoRA (QLoRA): block-wise NF4 or int8, tensor-parallel invariant."""

from plait.quantize.apply import (
    DEFAULT_BLOCK_SIZE,
    QuantizeError,
    QuantizeSummary,
    cast_base_,
    dequantize_base_,
    quantize_base_,
    quantized_weights,
)
from plait.quantize.blockwise import METHODS, QuantizedRows, quantize_rows
from plait.quantize.record import (
    QUANTIZATION_FILE,
    BaseQuantization,
    QuantizationRecordError,
    quantize_as_recorded,
    read_base_quantization,
)
from plait.quantize.tensor import QuantizedWeight

__all__ = ["DEFAULT_BLOCK_SIZE", "METHODS", "QUANTIZATION_FILE", "BaseQuantization", "QuantizationRecordError",
           "QuantizeError", "QuantizeSummary", "QuantizedRows", "QuantizedWeight", "cast_base_", "dequantize_base_",
           "quantize_as_recorded", "quantize_base_", "quantize_rows", "quantized_weights", "read_base_quantization"]
