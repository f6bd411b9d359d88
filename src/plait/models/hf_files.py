"""Which tensors a Hugging Face model directory holds, and in which file, read from its index or
the safetensors headers (no tensor data): what the reader checks before any read, and what a
family consults when a ``config.json`` promises tensors a checkpoint may not carry."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def has_weights(path: Path) -> bool:
    """Whether ``path`` holds a safetensors index or file (a config-only directory holds none)."""
    return (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))


def weight_map(path: Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` for a single-file or index-sharded directory."""
    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            return {k: path / v for k, v in json.load(f)["weight_map"].items()}
    files = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


__all__ = ["INDEX_FILE", "SINGLE_FILE", "has_weights", "weight_map"]
