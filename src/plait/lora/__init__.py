"""Tensor-parallel LoRA: adapters on the decoder projections, laid out like their base weights.

See ``docs/lora.md`` for how ``A`` and ``B`` are sharded, initialised and saved.
"""

from plait.lora.apply import (
    LoraApplyError,
    adapters_disabled,
    apply_lora,
    init_lora_,
    lora_parameters,
    merge_lora_,
)
from plait.lora.layers import LoraAdapter
from plait.lora.peft_io import PeftAdapterError, load_peft_adapter, read_peft_settings, save_peft_adapter
from plait.lora.settings import LoraSettings, LoraSettingsError

__all__ = [
    "LoraAdapter", "LoraApplyError", "LoraSettings", "LoraSettingsError", "PeftAdapterError", "adapters_disabled",
    "apply_lora",
    "init_lora_", "load_peft_adapter", "lora_parameters", "merge_lora_", "read_peft_settings", "save_peft_adapter",
]
