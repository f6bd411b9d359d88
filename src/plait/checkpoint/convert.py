"""``plait convert``: a plait checkpoint to a Hugging Face directory and back, tensor by tensor.

Both directions stream. Each full tensor is assembled from its slices, or read from its file,
then written and dropped before the next one is read. Output files are cut at the size of the
largest tensor, so host memory stays near one tensor (plus safetensors' serialisation copy)
whatever the model size. Neither direction needs a process group or the training code.

* plait -> HF: ``config.json`` from the checkpoint's model config, the weights in their saved
  dtype (``--dtype`` casts), and the files that say how the model is used when the checkpoint
  carries them (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
  ``special_tokens_map.json``, ``generation_config.json``: :mod:`plait.data.tokenizer_files`).
  ``lm_head.weight`` is left out for tied embeddings, as Hugging Face does.
* HF -> plait: a checkpoint at step 0 with the weights only (no optimizer state) and the same
  files of the Hugging Face directory. ``plait train`` with ``checkpoint.resume=<dir>`` starts
  from it, with fresh AdamW moments.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from plait.checkpoint.contents import model_config_dict, saved_contents
from plait.checkpoint.format import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    SliceRef,
    fsync_dir,
    fsync_file,
    sha256_of,
    step_dir_name,
    tensor_key,
    write_json_atomic,
)
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.store import commit
from plait.checkpoint.writer import DTYPE_NAMES
from plait.data.tokenizer_files import copy_model_use_files
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.hf_files import weight_map
from plait.models.hf_io import ignored_tensor, load_hf_config, write_hf_dir
from plait.models.registry import get_family
from plait.outputs.ownership import OutputDirError, require_not_containing, require_target, write_marker
from plait.outputs.permissions import apply_umask

TOKENIZER = "tokenizer.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)


def _config_of(manifest: dict) -> Any:
    """The model config a manifest records, of its family (``model_family``; Llama when absent, as
    in checkpoints written before families existed)."""
    data = manifest.get("model_config")
    if not isinstance(data, dict):
        raise CheckpointError("the checkpoint's manifest has no model_config; it was not written by plait train "
                              "or plait convert")
    family = manifest.get("model_family", "llama")
    try:
        return get_family(family).config_cls(**data)
    except (TypeError, ValueError) as e:  # an unknown family or fields its config does not take
        raise CheckpointError(f"the checkpoint's manifest has model_family={family!r} with a model_config that "
                              f"does not describe such a model: {e}") from None


def plait_to_hf(checkpoint: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                progress: bool = True, overwrite: bool = False, max_shard_bytes: int | None = None) -> Path:
    """Write the Hugging Face directory of a plait checkpoint; returns it.

    ``out_dir`` must be absent or empty, or a model directory plait wrote (replaced only with
    ``overwrite``); it may never contain the checkpoint. Checked before anything is read.
    ``max_shard_bytes``: size cap of an output file (default: the largest tensor, so host memory
    stays near one tensor; the end of training uses Hugging Face's usual 5 GiB).
    """
    require_not_containing(out_dir, [("the source checkpoint", checkpoint)], what="the output directory")
    require_target(out_dir, "hf-model", what="the output directory", replace=overwrite,
                   replace_hint="pass --overwrite")
    with CheckpointReader(checkpoint, keep_open=False) as reader:
        if saved_contents(reader.manifest)["model"] == "adapters":
            raise CheckpointError(f"{checkpoint} holds a LoRA run's adapters, not a whole model; the run's final/ "
                                  f"directory is its adapter in the PEFT layout, and plait convert ADAPTER DEST "
                                  f"--merge-lora writes the base model with the adapter folded in")
        config = _config_of(reader.manifest)
        # the tensors must be the recorded architecture's (an edited model_config would write a
        # config.json that does not describe the weights)
        expected = build_model(config, single_process_mesh(), device="meta", init=False)
        try:
            reader.check_model({n: tuple(p.shape) for n, p in expected.named_parameters()})
        except CheckpointError as e:
            raise CheckpointError(f"the manifest's model_config does not describe the checkpoint's tensors ({e}); "
                                  f"the manifest was edited or damaged") from None
        config_dict = config.to_hf_dict()
        names = [k[len("model/"):] for k in reader.tensors if k.startswith("model/")]
        if config.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        cast = DTYPES[dtype] if dtype else None
        entries = []
        for name in names:
            info = reader.tensors[tensor_key("model", name)]
            item = torch.empty((), dtype=cast or DTYPES[info["dtype"]]).element_size()
            entries.append((name, item * int(torch.Size(info["shape"]).numel())))
        config_dict["dtype"] = str(cast or DTYPES[reader.tensors[tensor_key("model", names[0])]["dtype"]]
                                   ).removeprefix("torch.")
        largest = max(n for _, n in entries)
        bar = _progress(len(names), "plait -> HF", progress)

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                info = reader.tensors[tensor_key("model", name)]
                full = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]])
                reader.read_into("model", name, full)
                bar.update(1)
                yield name, full if cast is None else full.to(cast)

        extra = [("model use files", lambda d: copy_model_use_files(d, checkpoint))]
        try:
            write_hf_dir(out_dir, config_dict, entries, stream(), max_shard_bytes=max_shard_bytes or largest,
                         extra_files=extra,
                         replace=overwrite)
        finally:
            bar.close()
    return Path(out_dir)


def hf_to_plait(hf_dir: str | Path, out_root: str | Path, *, progress: bool = True, overwrite: bool = False) -> Path:
    """Write a weights-only plait checkpoint (step 0) of a Hugging Face directory under ``out_root``.

    ``out_root`` must be absent, empty or a plait checkpoint directory; an existing step 0 there
    is replaced only with ``overwrite``. Checked before anything is read.
    """
    hf_dir, out_root = Path(hf_dir), Path(out_root)
    require_target(out_root, "checkpoints", what="the output directory")
    if (out_root / step_dir_name(0)).exists() and not overwrite:
        raise OutputDirError(f"{out_root / step_dir_name(0)} already exists; pass --overwrite to replace it")
    config = load_hf_config(hf_dir)
    weights = weight_map(hf_dir)
    names = [n for n in weights if not ignored_tensor(config, n)]
    if config.tie_word_embeddings:
        if "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights:
            raise CheckpointError(f"{hf_dir}: tied embeddings stored only as lm_head.weight are not supported here; "
                                  f"load it with model.hf_path instead")
        names = [n for n in names if n != "lm_head.weight"]
    tmp = out_root / (step_dir_name(0) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted conversion of ours (the name is plait's)
    tmp.mkdir(parents=True)
    write_marker(out_root, "checkpoints")
    tensors_json: dict[str, dict] = {}
    files: dict[str, dict] = {}
    bar = _progress(len(names), "HF -> plait", progress)
    try:
        for i, name in enumerate(names):
            with safe_open(str(weights[name]), framework="pt") as f:
                t = f.get_tensor(name)
            fname = f"tensor-{i:05d}.safetensors"
            key = tensor_key("model", name)
            save_file({key: t.contiguous()}, str(tmp / fname), metadata={"format": FORMAT})
            apply_umask(tmp / fname)
            fsync_file(tmp / fname)
            files[fname] = {"sha256": sha256_of(tmp / fname), "bytes": (tmp / fname).stat().st_size}
            tensors_json[key] = {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype],
                                 "slices": [SliceRef(fname, key, None, 0, t.shape[0] if t.dim() else 1).as_json()]}
            del t
            bar.update(1)
    finally:
        bar.close()
    copy_model_use_files(tmp, hf_dir)  # tokenizer, chat template, ...: plait_to_hf writes them out again
    manifest = {"format": FORMAT, "version": VERSION, "step": 0, "train_step": 0, "optimizer_step": 0,
                "complete": True, "world_size": 1, "source": str(hf_dir), "tensors": tensors_json, "files": files,
                "model_config": model_config_dict(config), "model_family": type(config).family}
    write_json_atomic(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    return commit(tmp, 0)


def describe(checkpoint: str | Path) -> str:
    """A one-paragraph summary of a checkpoint (for ``plait convert --info``)."""
    with CheckpointReader(checkpoint) as reader:
        m = reader.manifest
        sizes = sum(f["bytes"] for f in m["files"].values())
        kinds = sorted({k.split("/", 1)[0] for k in m["tensors"]})
        return json.dumps({"step": m["step"], "layout": m.get("layout"), "kinds": kinds,
                           "tensors": len(m["tensors"]), "files": len(m["files"]), "bytes": sizes}, indent=1)
