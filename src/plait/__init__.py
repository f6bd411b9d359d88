"""plait: hardware-agnostic distributed training of large language models on PyTorch."""

__version__ = "0.1.0"
