"""The record, beside an adapter, of the quantized base it was trained on (``base_quantization.json``).

A QLoRA adapter learned against the quantized base, not the weights ``base_model_name_or_path``
names: evaluating or merging it on the unquantized base gives a different model. PEFT's
``adapter_config.json`` has no place for this, so plait writes one more file in the adapter
directory; plait's own readers (held-out evaluation, lm-eval, ``plait convert --merge-lora``)
quantize the base again the same way (the values are the same: the quantization is
deterministic and independent of the layout), and PEFT ignores the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from plait.quantize.apply import QuantizeError, quantize_base_
from plait.quantize.blockwise import METHODS

QUANTIZATION_FILE = "base_quantization.json"


class QuantizationRecordError(ValueError):
    """An unreadable ``base_quantization.json`` (the message names the file and the problem)."""


#: the dtypes a base may be rounded to before it is quantized (the precision preset's parameter dtype)
ROUNDED_TO = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class BaseQuantization:
    """How the base was stored: ``method`` (nf4 or int8) in blocks of ``block_size`` along the hidden
    size, from its values rounded to ``rounded_to`` (the run's parameter dtype: a bf16 preset
    quantizes the bf16 base it would otherwise hold, which is also the dtype its exported base has)."""

    method: str
    block_size: int
    rounded_to: str = "float32"

    @property
    def round_to(self) -> torch.dtype:
        return ROUNDED_TO[self.rounded_to]

    def to_json(self) -> str:
        return json.dumps({"method": self.method, "block_size": self.block_size, "rounded_to": self.rounded_to,
                           "quantized_by": "plait",
                           "layout": "per row of column projections, per column of row projections; "
                                     "blocks along the hidden size; nf4 scales double-quantized per row"},
                          indent=2) + "\n"

    def write(self, directory: Path) -> Path:
        path = Path(directory) / QUANTIZATION_FILE
        path.write_text(self.to_json())
        return path


def read_base_quantization(adapter_dir: str | Path) -> BaseQuantization | None:
    """The record in ``adapter_dir``, or ``None`` when the adapter was trained on the base as read."""
    path = Path(adapter_dir) / QUANTIZATION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        method, block, rounded = data["method"], data["block_size"], data.get("rounded_to", "float32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise QuantizationRecordError(f"{path} is not a readable base-quantization record ({e!r}); plait train "
                                      f"writes it beside a QLoRA adapter: write it again from the run's recipe "
                                      f"(its lora.quantize_base and lora.quantize_block_size)") from e
    if method not in METHODS or isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2 \
            or rounded not in ROUNDED_TO:
        raise QuantizationRecordError(f"{path}: method={method!r}, block_size={block!r}, rounded_to={rounded!r} is "
                                      f"not a quantization plait makes (methods: {', '.join(METHODS)}; an even "
                                      f"block size; rounded_to one of {', '.join(ROUNDED_TO)})")
    return BaseQuantization(method, block, rounded)


def quantize_as_recorded(modules: list[nn.Module], adapter_dir: str | Path) -> BaseQuantization | None:
    """Quantize the (frozen, adapted) base of ``modules`` as ``adapter_dir``'s record says, so the
    adapter is evaluated on the base it was trained on; returns the record (``None``: nothing done)."""
    record = read_base_quantization(adapter_dir)
    if record is not None:
        try:
            quantize_base_(modules, record.method, block_size=record.block_size,
                           round_to=record.round_to)
        except QuantizeError as e:  # the record does not fit this base: name the record, not a recipe field
            raise QuantizationRecordError(f"{Path(adapter_dir) / QUANTIZATION_FILE} does not fit the adapter's base "
                                          f"model: {e}") from None
    return record
