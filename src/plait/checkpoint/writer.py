"""Saving a checkpoint: every distinct slice written once, by one rank, then an atomic commit.

Who writes what (decided locally, without communication, from the layout):

* a TP-sharded parameter: each TP rank writes the runs of full rows it holds; of the ranks
  holding the same K/V rows (KV replication) only the first of the KV-shared group writes;
* a TP-replicated parameter (norms, row-parallel biases, everything at TP=1): TP rank 0;
* the last pipeline stage's copy of a tied embedding: nobody (the first stage writes it);
* the data-parallel replicas split the parameters between them round-robin, so the write
  work is spread over DP ranks.
* a module's state outside the optimizer that it names in ``checkpoint_buffers`` (a sigmoid
  router's expert bias), kind ``buffer``: identical on every replica, written by the first
  data-parallel and TP rank.

Saving has two halves. :meth:`CheckpointWriter.snapshot` (every rank, in the training loop)
copies what this rank writes into host memory; under ZeRO-1 it all-gathers the optimizer state
bucket by bucket (collective). :meth:`CheckpointWriter.write` (no collectives, so it may run on a
background thread) writes the rank's safetensors file and manifest part into ``step-N.tmp``; rank 0
then waits for every rank's part, merges them into ``manifest.json``, syncs it, and renames the
directory to ``step-N``. A crash anywhere before the rename leaves the previous checkpoints as
they were; the ``.tmp`` directory is removed at the next start or save.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from plait.checkpoint.format import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    SliceRef,
    fsync_dir,
    fsync_file,
    part_file,
    rank_file,
    sha256_of,
    step_dir_name,
    tensor_key,
    write_json_atomic,
)
from plait.checkpoint.store import apply_retention, commit, remove_incomplete
from plait.outputs.permissions import apply_umask
from plait.parallel_state import named_parameters_with_specs, writes_copy

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpointed_buffers(modules: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, buffer)`` of every buffer a module of ``modules`` lists in its
    ``checkpoint_buffers`` class attribute: state that is neither a parameter nor rebuilt from the
    config (e.g. an expert bias moved after each step), saved so that a resume is exact."""
    out = []
    for module in modules:
        for prefix, sub in module.named_modules():
            for name in getattr(sub, "checkpoint_buffers", ()):
                out.append((f"{prefix}.{name}" if prefix else name, getattr(sub, name)))
    return out


@dataclass
class Snapshot:
    """Host copies of what one rank writes for one checkpoint."""

    step: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  #: safetensors key -> CPU tensor
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  #: "kind/name" -> shape, dtype, slices
    meta: dict[str, Any] = field(default_factory=dict)  #: manifest fields (rank 0)
    attachments: dict[str, Path] = field(default_factory=dict)  #: small files rank 0 copies in (tokenizer.json)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class CheckpointWriter:
    """Snapshots and writes the checkpoints of one rank under ``root``."""

    def __init__(self, root: str | Path, *, rank: int, world: int, keep: int = 2, keep_every: int = 0,
                 commit_timeout: float = 600.0) -> None:
        self.root, self.rank, self.world = Path(root), rank, world
        self.keep, self.keep_every, self.commit_timeout = keep, keep_every, commit_timeout
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_committed: Path | None = None
        #: host buffers reused from one snapshot to the next (no fresh allocation, and so no page
        #: faults, after the first save; pinned when the source is on an accelerator)
        self._staging: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ snapshot (training loop)
    @torch.no_grad()
    def snapshot(self, step: int, modules: list[nn.Module], optimizer, mesh, meta: dict[str, Any],
                 rng: dict[str, torch.Tensor], attachments: dict[str, Path] | None = None) -> Snapshot:
        self.wait()  # the previous save still reads the staging buffers
        snap = Snapshot(step, meta=dict(meta) if self.rank == 0 else {},
                        attachments=dict(attachments or {}) if self.rank == 0 else {})
        fname = rank_file(self.rank)
        dp = mesh.info("dp_cp")  # replicas of the parameters: dp x cp ranks (the dp group when cp=1)
        holders = {name: (module, spec) for module, name, _, spec in named_parameters_with_specs(modules)}
        order = {e.name: i for i, e in enumerate(optimizer.bucket_plan.entries)}
        # expert parallelism: an expert's replicas are its expert-data-parallel group, not the dp group
        experts = {e.name for b in optimizer.bucket_plan.buckets if b.expert for e in b.entries}
        edp = mesh.info("dp_expert") if experts else dp
        for entry, states in optimizer.param_states():  # collective under ZeRO-1: every rank iterates
            name = entry.name
            module, spec = holders[name]
            owners = edp if name in experts else dp
            if order[name] % owners.size != owners.rank or not writes_copy(module, name, spec, mesh.info("tp").rank,
                                                                                  mesh.info("kv").rank):
                continue
            tensors = {"model": entry.param.detach(), **states}
            for kind, local in tensors.items():
                self._add(snap, fname, kind, name, local, spec)
        if dp.rank == 0 and mesh.info("tp").rank == 0:
            for name, buf in checkpointed_buffers(modules):
                self._add(snap, fname, "buffer", name, buf.detach(), None)
        for key, value in rng.items():
            snap.tensors[f"rng/{key}"] = value.detach().cpu().clone()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        return snap

    def _stage(self, key: str, src: torch.Tensor) -> torch.Tensor:
        """A host copy of ``src`` in the staging buffer of ``key`` (allocated on first use)."""
        buf = self._staging.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            self._staging[key] = buf
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf

    def _add(self, snap: Snapshot, fname: str, kind: str, name: str, local: torch.Tensor, spec) -> None:
        key = tensor_key(kind, name)
        full_shape = list(spec.full_shape) if spec is not None else list(local.shape)
        entry = snap.entries.setdefault(key, {"shape": full_shape, "dtype": DTYPE_NAMES[local.dtype], "slices": []})
        if spec is None:
            snap.tensors[key] = self._stage(key, local)
            entry["slices"].append(SliceRef(fname, key, None, 0, full_shape[0] if full_shape else 1).as_json())
            return
        for local_start, full_start, length in spec.runs():
            skey = f"{key}@{full_start}+{length}"
            snap.tensors[skey] = self._stage(skey, local.narrow(spec.dim, local_start, length))
            entry["slices"].append(SliceRef(fname, skey, spec.dim, full_start, length).as_json())

    # ------------------------------------------------------------------ write (any thread)
    def tmp_dir(self, step: int) -> Path:
        return self.root / (step_dir_name(step) + ".tmp")

    def write(self, snap: Snapshot) -> Path | None:
        """Write this rank's file and manifest part; rank 0 also commits. Returns the final directory on rank 0."""
        tmp = self.tmp_dir(snap.step)
        tmp.mkdir(parents=True, exist_ok=True)
        path = tmp / rank_file(self.rank)
        save_file(snap.tensors, str(path), metadata={"format": FORMAT, "step": str(snap.step)})
        apply_umask(path)  # safetensors writes owner-only files
        fsync_file(path)
        part = {"rank": self.rank, "file": path.name, "sha256": sha256_of(path), "bytes": path.stat().st_size,
                "tensors": snap.entries}
        write_json_atomic(tmp / part_file(self.rank), part)
        if self.rank != 0:
            return None
        for name, src in snap.attachments.items():
            shutil.copy(src, tmp / name)
        return self._commit(tmp, snap)

    def _commit(self, tmp: Path, snap: Snapshot) -> Path:
        deadline = time.monotonic() + self.commit_timeout
        parts = [tmp / part_file(r) for r in range(self.world)]
        while not all(p.is_file() for p in parts):
            if time.monotonic() > deadline:
                missing = [p.name for p in parts if not p.is_file()]
                raise CheckpointError(f"checkpoint step {snap.step}: ranks did not finish writing within "
                                      f"{self.commit_timeout:.0f} s (missing {missing[:8]}); left uncommitted in {tmp}")
            time.sleep(0.02)
        tensors: dict[str, dict[str, Any]] = {}
        files: dict[str, dict[str, Any]] = {}
        for p in parts:
            data = json.loads(p.read_text(encoding="utf-8"))
            files[data["file"]] = {"sha256": data["sha256"], "bytes": data["bytes"]}
            for key, entry in data["tensors"].items():
                merged = tensors.setdefault(key, {"shape": entry["shape"], "dtype": entry["dtype"], "slices": []})
                if merged["shape"] != entry["shape"]:
                    raise CheckpointError(
                        f"ranks disagree on the shape of {key}: {merged['shape']} vs {entry['shape']}")
                merged["slices"].extend(entry["slices"])
        manifest = {"format": FORMAT, "version": VERSION, "step": snap.step, "complete": True, **snap.meta,
                    "tensors": tensors, "files": files, "world_size": self.world}
        write_json_atomic(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        final = commit(tmp, snap.step)
        apply_retention(self.root, self.keep, self.keep_every)
        remove_incomplete(self.root, below_step=snap.step)
        self.last_committed = final
        return final

    # ------------------------------------------------------------------ async
    def write_async(self, snap: Snapshot) -> None:
        """Write ``snap`` on a background thread (waits for the previous one first: one in flight)."""
        self.wait()

        def run() -> None:
            try:
                self.write(snap)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name=f"plait-checkpoint-{snap.step}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the background save (if any) is done; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
