"""The on-disk format of a plait checkpoint: a directory of safetensors files and one JSON manifest.

::

    <checkpoint root>/
      step-00000100/             a complete checkpoint (committed by an atomic rename)
        manifest.json            every tensor by original name: global shape, dtype, and which
                                 file holds which slice; a sha256 and size per file; counters,
                                 the resolved recipe and the layout it was written under
        rank-00000.safetensors   the slices rank 0 wrote (and its RNG states)
        part-00000.json          rank 0's share of the manifest (merged into manifest.json)
        ...
      step-00000200.tmp/         being written, or interrupted: never loaded, cleaned up

Tensor names are ``<kind>/<parameter name>`` with kind ``model`` (the weights in the model's
dtype), ``master`` (fp32 master weights, bf16-mixed only), ``exp_avg`` and ``exp_avg_sq``
(AdamW moments), so the optimizer state is keyed by parameter, not by rank or layout, and
``buffer`` (module state outside the optimizer that a module lists in ``checkpoint_buffers``). A slice
covers ``[start, start + length)`` of the full tensor along ``dim`` (``dim`` null: the whole
tensor). Loading needs no pickle: JSON and safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _SliceShape(_Shape):
    file: str
    key: str
    dim: Annotated[int, Field(ge=0)] | None
    start: Annotated[int, Field(ge=0)]
    length: Annotated[int, Field(ge=0)]


class _TensorShape(_Shape):
    shape: list[Annotated[int, Field(ge=0)]]
    dtype: Literal["float32", "bfloat16", "float16"]
    slices: list[_SliceShape]

    @model_validator(mode="after")
    def _slices_inside(self) -> _TensorShape:
        for sl in self.slices:
            if sl.dim is not None and (sl.dim >= len(self.shape) or sl.start + sl.length > self.shape[sl.dim]):
                raise ValueError(f"slice {sl.key!r} (dim {sl.dim}, rows {sl.start}..{sl.start + sl.length}) lies "
                                 f"outside the tensor's shape {self.shape}")
        return self


class _FileShape(_Shape):
    sha256: str
    bytes: Annotated[int, Field(ge=0)]


class _ManifestShape(_Shape):
    """The entries every reader relies on (others, such as the recipe, are read where used)."""

    step: Annotated[int, Field(ge=0)]
    tensors: dict[str, _TensorShape]
    files: dict[str, _FileShape]
    train_step: Annotated[int, Field(ge=0)] | None = None
    optimizer_step: Annotated[int, Field(ge=0)] | None = None
    model_config_: dict[str, Any] | None = Field(default=None, alias="model_config")
    contents: dict[str, Any] | None = None
    layout: dict[str, Any] | None = None


FORMAT = "plait-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("model", "master", "exp_avg", "exp_avg_sq", "buffer")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, incomplete, or not matching the model."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def part_file(rank: int) -> str:
    return f"part-{rank:05d}.json"


def tensor_key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


@dataclass(frozen=True)
class SliceRef:
    """Where one slice of a full tensor lives."""

    file: str
    key: str
    dim: int | None
    start: int
    length: int

    def as_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "dim": self.dim, "start": self.start, "length": self.length}


def sha256_of(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync'ed and renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    fsync_file(tmp)
    os.replace(tmp, path)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, validated; :class:`CheckpointError` if unusable."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a complete plait checkpoint")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a plait checkpoint manifest (format {data.get('format')!r})"
                              if isinstance(data, dict) else f"{path} does not hold a JSON object")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {data.get('version')!r}; this plait reads {VERSION}")
    if data.get("complete") is not True:
        raise CheckpointError(f"{path} is not marked complete")
    for key in ("step", "tensors", "files"):
        if key not in data:
            raise CheckpointError(f"{path} lacks the {key!r} entry")
    try:
        _ManifestShape.model_validate(data)  # a hand-edited manifest is refused by entry, not a traceback
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(f"{path}: entry {where}: {first['msg'].lower()} (got {first['input']!r:.60}); the "
                              f"manifest was edited or damaged: restore it, or use another checkpoint") from None
    return data
