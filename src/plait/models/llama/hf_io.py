"""Hugging Face checkpoint I/O for the Llama family.

The reader and writer are family-generic and live in :mod:`plait.models.hf_io`; this module keeps
their names importable from here and adds :func:`load_llama_from_hf`.
"""

from __future__ import annotations

import torch

from plait.models.hf_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointMismatchError,
    HFTensors,
    PathLike,
    _weight_map,
    check_hf_tensors,
    gguf_to_hf_dir,
    load_from_hf,
    load_hf_config,
    load_hf_weights,
    read_hf_tensors,
    save_hf_checkpoint,
    write_hf_dir,
)
from plait.models.llama.model import LlamaForCausalLM


def load_llama_from_hf(path: PathLike, mesh, *, sequence_parallel: bool = False,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """This rank's shard of the Hugging Face model at ``path`` on ``mesh``: :func:`load_from_hf`
    under its first name (it loads any family the directory's ``model_type`` names)."""
    return load_from_hf(path, mesh, sequence_parallel=sequence_parallel, dtype=dtype, device=device)


__all__ = ["INDEX_FILE", "SINGLE_FILE", "CheckpointMismatchError", "HFTensors", "check_hf_tensors", "gguf_to_hf_dir",
           "load_from_hf", "load_hf_config", "load_hf_weights", "load_llama_from_hf", "read_hf_tensors",
           "save_hf_checkpoint", "write_hf_dir", "_weight_map"]
