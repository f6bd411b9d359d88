"""Reading a checkpoint into any layout: each rank reads only the slices its shards need.

A target parameter is described by its :class:`~plait.tensor_parallel.sharding.ShardSpec` (or
none: the full tensor). For every run of full rows the target holds, the reader intersects it
with the slices the manifest lists for that tensor and copies the overlap, reading through
``safetensors``' lazy slicing, so host memory stays near one slice. Before a file is opened its
sha256 is checked against the manifest: a flipped byte, a truncated file or anything planted in
its place is rejected by name before any of its bytes are parsed. Nothing is unpickled.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from plait.checkpoint.format import CheckpointError, rank_file, read_manifest, sha256_of, tensor_key
from plait.tensor_parallel.sharding import ShardSpec


class CheckpointReader:
    """``keep_open=False`` opens a file for each read and closes it after: a streaming reader
    (``plait convert``) then never keeps a whole file's pages mapped into the process."""

    def __init__(self, directory: str | Path, *, keep_open: bool = True) -> None:
        self.dir = Path(directory)
        self.keep_open = keep_open
        self._verified: set[str] = set()
        self.manifest = read_manifest(self.dir)
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        for fname in self.manifest["files"]:
            if not (self.dir / fname).is_file():
                raise CheckpointError(f"{self.dir}: the manifest references {fname}, which is missing")
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ files
    def _open(self, fname: str, stack: ExitStack | None = None):
        handle = self._handles.get(fname)
        if handle is not None:
            return handle
        path = self.dir / fname
        info = self.manifest["files"].get(fname)
        if info is None:
            raise CheckpointError(f"{path} is not listed in the manifest")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the manifest references it)")
        if fname not in self._verified:
            actual = sha256_of(path)
            if actual != info["sha256"]:
                raise CheckpointError(f"{path}: sha256 {actual} does not match the manifest's {info['sha256']}; "
                                      f"the file is corrupt or was replaced")
            self._verified.add(fname)
        try:
            handle = (stack or self._stack).enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file, named
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        if stack is None:
            self._handles[fname] = handle
        return handle

    def has(self, kind: str, name: str) -> bool:
        return tensor_key(kind, name) in self.tensors

    def shape(self, kind: str, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[tensor_key(kind, name)]["shape"])

    def check_model(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """Every parameter of the target model is in the checkpoint with its full shape.

        Raises :class:`CheckpointError` naming the first mismatching tensor and both shapes; returns
        the checkpoint's model tensors that ``expected`` does not name.
        """
        for name, shape in expected.items():
            key = tensor_key("model", name)
            if key not in self.tensors:
                have = sorted(k[len("model/"):] for k in self.tensors if k.startswith("model/"))
                raise CheckpointError(f"{self.dir}: tensor {name!r} of the model is not in the checkpoint "
                                      f"(it has {len(have)} model tensors, e.g. {have[:3]}); "
                                      f"the recipe's model does not match the checkpoint")
            saved = tuple(self.tensors[key]["shape"])
            if saved != tuple(shape):
                raise CheckpointError(f"{self.dir}: tensor {name!r} has shape {list(saved)} in the checkpoint but "
                                      f"{list(shape)} in the recipe's model; the model does not match the checkpoint")
        extra = sorted(k[len("model/"):] for k in self.tensors if k.startswith("model/")
                       and k[len("model/"):] not in expected)
        return extra  # tensors of other pipeline stages are expected here; the caller decides

    # ------------------------------------------------------------------ reading
    @torch.no_grad()
    def read_into(self, kind: str, name: str, out: torch.Tensor, spec: ShardSpec | None = None) -> None:
        """Fill ``out`` (this rank's local tensor, any dtype) with ``kind/name`` as ``spec`` shards it."""
        key = tensor_key(kind, name)
        entry = self.tensors.get(key)
        if entry is None:
            raise CheckpointError(f"{self.dir}: {key} is not in the checkpoint")
        if spec is not None and any(i < 0 for i in spec.index):
            out.zero_()
        runs = [] if spec is None else spec.runs()  # spec None: the whole tensor
        covered = 0
        for sl in entry["slices"]:
            with ExitStack() as transient:
                handle = self._open(sl["file"], None if self.keep_open else transient)
                try:
                    src = handle.get_slice(sl["key"])
                except Exception:  # noqa: BLE001 - a key the manifest names but the file lacks
                    raise CheckpointError(f"{self.dir}: {sl['file']} holds no tensor {sl['key']!r}, which the "
                                          f"manifest lists for {key}; the manifest was edited or damaged") from None
                expected = list(entry["shape"])
                if sl["dim"] is not None:
                    expected[sl["dim"]] = sl["length"]
                if list(src.get_shape()) != expected:
                    raise CheckpointError(f"{self.dir}: {sl['key']} in {sl['file']} has shape {list(src.get_shape())}, "
                                          f"the manifest says {expected}; the manifest was edited or damaged")
                if spec is None:
                    covered += self._copy_whole(src, sl, out)
                else:
                    for local, full, length in runs:
                        covered += self._copy_run(src, sl, out, spec.dim, local, full, length)
        need = out.numel() if spec is None else sum(
            length * (out.numel() // max(out.shape[spec.dim], 1)) for _, _, length in runs)
        if covered < need:
            raise CheckpointError(f"{self.dir}: {key} does not cover every entry this rank needs "
                                  f"({covered} of {need} elements)")

    @staticmethod
    def _copy_whole(src: Any, sl: dict[str, Any], out: torch.Tensor) -> int:
        """Copy one saved slice into the whole target tensor; returns the elements copied."""
        sdim = sl["dim"]
        if sdim is None:
            out.copy_(src[:])
            return out.numel()
        region = out.narrow(sdim, sl["start"], sl["length"])
        region.copy_(src[:])
        return region.numel()

    @staticmethod
    def _copy_run(src: Any, sl: dict[str, Any], out: torch.Tensor, dim: int, local: int, full: int,
                  length: int) -> int:
        """Copy the overlap of one saved slice with one target run; returns the elements copied."""
        sdim, sstart, slen = sl["dim"], sl["start"], sl["length"]
        lo, hi = full, full + length
        if sdim is None:  # saved whole: read the target's run from it
            index = [slice(None)] * out.dim()
            index[dim] = slice(lo, hi)
            region = out.narrow(dim, local, length)
            region.copy_(src[tuple(index)])
            return region.numel()
        if sdim != dim:
            raise CheckpointError(f"slice {sl['key']} is split along dim {sdim}, the model along dim {dim}")
        a, z = max(lo, sstart), min(hi, sstart + slen)
        if a >= z:
            return 0
        index = [slice(None)] * out.dim()
        index[dim] = slice(a - sstart, z - sstart)
        region = out.narrow(dim, local + (a - lo), z - a)
        region.copy_(src[tuple(index)])
        return region.numel()

    def read_rng(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG states rank ``rank`` saved (from its own file)."""
        fname = rank_file(rank)
        if fname not in self.manifest["files"]:
            return {}
        handle = self._open(fname)
        return {k[len("rng/"):]: handle.get_tensor(k) for k in handle.keys() if k.startswith("rng/")}
