"""Hugging Face checkpoint I/O for every plait model family: ``config.json`` + ``*.safetensors``.

The family comes from ``config.json``'s ``model_type`` (:mod:`plait.models.registry`); plait's
parameter names are Hugging Face's, mapped through the family's ``hf_name``.

Why this shape:

* **Loading reads only this rank's shard.** Every sharded parameter has a :class:`ShardSpec`;
  each contiguous run of it is read with ``safe_open(...).get_slice(name)[a:b]`` (memory-mapped),
  so a rank never materialises a full tensor it does not hold. Padding entries stay zero. One
  code path covers any TP layout: vocabulary padding, head padding, KV replication.
* **Shapes are checked before any data is read**, so a config that does not match the files fails
  fast with the tensor name, both shapes and the config field most likely at fault, instead of a
  broadcast error deep inside a copy. Names and shapes are checked against the *full* model
  (:func:`check_hf_tensors`), so a pipeline stage reads only its own tensors
  (:func:`read_hf_tensors`) without reporting the other stages' as unexpected. The same holds
  for expert parallelism: the builder checks the full model, then removes the other ranks'
  experts before reading, so a rank opens the files with ``safe_open`` and reads the bytes of its
  own experts and the dense tensors only (the other experts' headers are read for the check).
* **Saving gathers one tensor at a time** over the TP group and rank 0 writes each safetensors
  shard as soon as it is complete, so peak host memory is one shard plus one tensor, not the model.
  Files go to a temporary directory that is renamed into place, so readers never see half a
  checkpoint.

``transformers`` is imported only inside :func:`gguf_to_hf_dir`: it is not needed to train.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.models.decoder.config import DecoderConfig
from plait.models.family import config_of
from plait.models.hf_files import INDEX_FILE, SINGLE_FILE, weight_map
from plait.models.registry import family_of, read_hf_config_file
from plait.outputs.whole import written_whole
from plait.parallel_state import shard_specs
from plait.tensor_parallel.sharding import ShardSpec, assemble_from_shards

PathLike = str | os.PathLike
#: tensors that old checkpoints carry but that are recomputed, never loaded (a family adds its own:
#: ``ModelFamily.hf_ignored``)
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model the config describes."""


def hf_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``module`` a Hugging Face checkpoint holds: its parameters and the buffers its
    family names in ``hf_buffers`` (DeepSeek-V3's router balancing biases), by plait name."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters())
    patterns = family_of(config_of(module)).hf_buffers
    if patterns:
        tensors.update({n: b for n, b in module.named_buffers() if any(re.fullmatch(p, n) for p in patterns)})
    return tensors


def ignored_tensor(config: DecoderConfig, name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a buffer that is never read into ``config``'s model: a
    rotary ``inv_freq`` table, or one of the family's ``hf_ignored`` patterns."""
    return bool(_IGNORED.match(name)) or any(re.match(p, name) for p in family_of(config).hf_ignored)


# ---------------------------------------------------------------------------------- config
def load_hf_config(path: PathLike) -> DecoderConfig:
    """The config of a Hugging Face model directory (its ``config.json``), of the family its
    ``model_type`` names (a :class:`~plait.models.llama.LlamaConfig` for Llama and Qwen2)."""
    return read_hf_config_file(path)


# ---------------------------------------------------------------------------------- loading
def _field_hint(name: str, dim: int | None) -> str:
    """The config field whose value sets dimension ``dim`` of HF tensor ``name``."""
    heads_q = "num_attention_heads/head_dim"
    heads_kv = "num_key_value_heads/head_dim"
    table = {
        "embed_tokens.weight": ("vocab_size", "hidden_size"), "lm_head.weight": ("vocab_size", "hidden_size"),
        "q_proj.weight": (heads_q, "hidden_size"), "q_proj.bias": (heads_q,),
        "k_proj.weight": (heads_kv, "hidden_size"), "k_proj.bias": (heads_kv,),
        "v_proj.weight": (heads_kv, "hidden_size"), "v_proj.bias": (heads_kv,),
        "o_proj.weight": ("hidden_size", heads_q), "o_proj.bias": ("hidden_size",),
        "gate_proj.weight": ("intermediate_size", "hidden_size"), "gate_proj.bias": ("intermediate_size",),
        "up_proj.weight": ("intermediate_size", "hidden_size"), "up_proj.bias": ("intermediate_size",),
        "down_proj.weight": ("hidden_size", "intermediate_size"), "down_proj.bias": ("hidden_size",),
        "norm.weight": ("hidden_size",), "layernorm.weight": ("hidden_size",),
    }
    key = ".".join(name.split(".")[-2:])
    key = "layernorm.weight" if key.endswith("layernorm.weight") else key
    fields = table.get(key)
    if fields is None:
        return "the model architecture"
    if dim is None or dim >= len(fields):
        return " / ".join(dict.fromkeys(fields))
    return fields[dim]


def _mismatch_message(name: str, found: tuple[int, ...], expected: tuple[int, ...]) -> str:
    dim = None
    if len(found) == len(expected):
        dim = next(i for i, (a, b) in enumerate(zip(found, expected, strict=True)) if a != b)
    return (f"tensor {name!r} has shape {list(found)} in the checkpoint but the config expects "
            f"{list(expected)}" + (f" (dim {dim})" if dim is not None else "")
            + f"; check the config field {_field_hint(name, dim)}")


def _unexpected_hint(names: list[str], config: Any) -> str:
    layers = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if layers and max(layers) >= config.num_hidden_layers:
        return f"the checkpoint has more layers than num_hidden_layers={config.num_hidden_layers}"
    if any(n.endswith(".bias") for n in names):
        return "attention_bias / o_proj_bias / mlp_bias is false in the config but the checkpoint has biases"
    return f"the checkpoint is not a {type(config).family} model of this config"


def _sources(config: Any, names: list[str], weights: dict[str, Path]) -> dict[str, str]:
    """``{plait parameter name: checkpoint tensor name}`` for the full model's ``names``, raising
    for missing/unexpected tensors."""
    c = config
    hf_name = family_of(config).hf_name
    src = {n: hf_name(n, c) for n in names}
    if c.tie_word_embeddings and "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights:
        src["model.embed_tokens.weight"] = "lm_head.weight"  # tied checkpoint stored under the head's name
    missing = [n for n, s in src.items() if s not in weights]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = "; a checkpoint without lm_head.weight ties it to the embedding (tie_word_embeddings=true)"
        elif any(n.endswith(".bias") for n in missing):
            hint = "; check attention_bias / o_proj_bias / mlp_bias"
        elif any(re.match(r"model\.layers\.\d+\.", n) for n in missing):
            hint = f"; check num_hidden_layers={c.num_hidden_layers}"
        raise CheckpointMismatchError(f"{len(missing)} tensor(s) the config needs are missing from the "
                                      f"checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}{hint}")
    used = set(src.values()) | ({"lm_head.weight"} if c.tie_word_embeddings else set())
    unexpected = sorted(k for k in weights if k not in used and not ignored_tensor(c, k))
    if unexpected:
        raise CheckpointMismatchError(f"the checkpoint has tensor(s) the config does not describe: "
                                      f"{unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}; "
                                      f"{_unexpected_hint(unexpected, c)}")
    return src


@dataclass(frozen=True)
class HFTensors:
    """A Hugging Face directory checked against one full model: where each parameter is read from.

    ``weights``: ``{checkpoint tensor: file}``; ``sources``: ``{plait parameter: checkpoint tensor}``
    for every parameter of the full model (any TP layout; shapes already checked).
    """

    path: Path
    weights: dict[str, Path]
    sources: dict[str, str]


def check_hf_tensors(model: nn.Module, path: PathLike) -> HFTensors:
    """Check the names and full shapes of the directory at ``path`` against the full ``model``
    (allocated or on the meta device, any TP layout), reading no tensor data.

    Raises :class:`CheckpointMismatchError` naming the tensor, both shapes and the config field
    most likely at fault.
    """
    path = Path(path)
    weights = weight_map(path)
    config = config_of(model)
    specs = shard_specs(model)
    params = hf_state(model)
    src = _sources(config, list(params), weights)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                   for f in sorted(set(weights[s] for s in src.values()))}
        checks = [(n, s, tuple(handles[weights[s]].get_slice(s).get_shape())) for n, s in src.items()]
        tied_head = (config.tie_word_embeddings and "lm_head.weight" in weights
                     and src.get("model.embed_tokens.weight") != "lm_head.weight")
        if tied_head and "model.embed_tokens.weight" in src:
            head_shape = tuple(handles[weights["lm_head.weight"]].get_slice("lm_head.weight").get_shape())
            checks.append(("model.embed_tokens.weight", "lm_head.weight", head_shape))
    for name, ckpt_name, shape in checks:  # every shape before any data
        expected = specs[name].full_shape if name in specs else tuple(params[name].shape)
        if shape != expected:
            raise CheckpointMismatchError(_mismatch_message(ckpt_name, shape, expected))
    return HFTensors(path, weights, src)


@torch.no_grad()
def read_hf_tensors(module: nn.Module, tensors: HFTensors) -> None:
    """Fill the allocated parameters of ``module`` (the full model, or one pipeline stage of the
    model :func:`check_hf_tensors` checked) in place; each rank reads only the runs of the full
    tensors its shards hold, and padding stays zero."""
    specs = shard_specs(module)
    params = hf_state(module)
    src = {n: tensors.sources[n] for n in params}
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                   for f in sorted(set(tensors.weights[s] for s in src.values()))}
        for name, p in params.items():
            tensor_slice = handles[tensors.weights[src[name]]].get_slice(src[name])
            spec = specs.get(name)
            if spec is None:
                p.copy_(tensor_slice[:])
                continue
            _read_shard(tensor_slice, spec, p)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: PathLike) -> None:
    """Fill an allocated plait model (any family, any TP layout) in place from a Hugging Face directory.

    Each rank reads only the runs of the full tensors its shards hold; padding stays zero.
    Raises :class:`CheckpointMismatchError` before reading any data when names or shapes differ.
    """
    read_hf_tensors(model, check_hf_tensors(model, path))


def _read_shard(tensor_slice: Any, spec: ShardSpec, out: torch.Tensor) -> None:
    """Copy each contiguous run of ``spec`` from the checkpoint slice into ``out``."""
    _read_rows(tensor_slice, spec, out, 0)


def _read_rows(tensor_slice: Any, spec: ShardSpec | None, out: torch.Tensor, first: int) -> None:
    """Copy local rows ``[first, first + len(out))`` of a parameter (``spec``: its TP shard, or
    None when replicated) from its checkpoint slice into ``out``, reading only those rows' runs."""
    end = first + out.shape[0]
    if spec is None:
        out.copy_(tensor_slice[first:end])
        return
    if any(i < 0 for i in spec.index):
        out.zero_()
    for local, full, length in spec.runs():
        index = [slice(None)] * len(spec.full_shape)
        if spec.dim == 0:  # the local rows are runs of full rows: read the runs' part inside the window
            lo, hi = max(local, first), min(local + length, end)
            if lo < hi:
                index[0] = slice(full + lo - local, full + hi - local)
                out[lo - first:hi - first].copy_(tensor_slice[tuple(index)])
            continue
        index[0] = slice(first, end)
        index[spec.dim] = slice(full, full + length)
        out.narrow(spec.dim, local, length).copy_(tensor_slice[tuple(index)])


class HFRowReader:
    """Reads row windows of a rank's local parameters from a checked Hugging Face directory, the
    files kept open while in use (``with``): a rank that keeps only part of each parameter
    (ZeRO-3) reads the rows of that part and nothing else."""

    def __init__(self, tensors: HFTensors) -> None:
        self.tensors = tensors
        self._stack: ExitStack | None = None
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> HFRowReader:
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack, self._handles = None, {}

    def rows(self, name: str, spec: ShardSpec | None, local_shape: tuple[int, ...], first: int,
             end: int) -> torch.Tensor:
        """Local rows ``[first, end)`` of parameter ``name`` (fp32, on the CPU)."""
        out = torch.empty((end - first,) + tuple(local_shape[1:]))
        self.read_rows_(out, name, spec, first)
        return out

    def read_rows_(self, out: torch.Tensor, name: str, spec: ShardSpec | None, first: int) -> None:
        """Read local rows ``[first, first + len(out))`` of parameter ``name`` into ``out``."""
        if self._stack is None:
            raise RuntimeError("HFRowReader.rows outside its with block")
        source = self.tensors.sources[name]
        file = self.tensors.weights[source]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        _read_rows(self._handles[file].get_slice(source), spec, out, first)

# ---------------------------------------------------------------------------------- saving
def _plan_shards(entries: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, order-preserving split of ``(name, nbytes)`` into files of at most ``max_shard_bytes``."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_hf_dir(path: PathLike, config_dict: dict[str, Any], entries: list[tuple[str, int]],
                 tensors: Iterable[tuple[str, torch.Tensor]], *, max_shard_bytes: int,
                 extra_files: Iterable[tuple[str, Any]] = (), replace: bool = False) -> None:
    """Write a HF directory atomically from a stream of tensors in ``entries`` order.

    ``entries`` gives ``(name, nbytes)`` up front so the shard file names (``-of-N``) are known
    before the first tensor arrives; each file is written as soon as its tensors are in.
    ``extra_files`` are ``(name, writer(dir))`` callables run inside the temporary directory.

    ``path`` must be absent, empty, or (with ``replace``) a model directory plait wrote before;
    anything else raises :class:`~plait.outputs.OutputDirError` before a byte is written. The
    new directory carries plait's marker, so a later write can tell it from the user's files.
    """
    with written_whole(path, "hf-model", what="the output directory", replace=replace,
                       replace_hint="allow replacing it (--overwrite, checkpoint.overwrite=true)") as tmp:
        shards = _plan_shards(entries, max_shard_bytes)
        files = [SINGLE_FILE] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
        weight_map: dict[str, str] = {}
        for names, file in zip(shards, files, strict=True):
            chunk: dict[str, torch.Tensor] = {}
            for expected in names:
                name, t = next(stream)
                assert name == expected, f"tensor stream out of order: {name} != {expected}"
                chunk[name] = t.detach().cpu().contiguous()
                weight_map[name] = file
            save_file(chunk, str(tmp / file), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(n for _, n in entries)}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2))
        for _, writer in extra_files:
            writer(tmp)


def _gathered(model: nn.Module, names: list[str], tp: GroupInfo,
              is_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors one at a time (all TP ranks must iterate; only the writer assembles)."""
    specs = shard_specs(model)
    params = hf_state(model)
    all_specs: list[dict[str, ShardSpec]] = [specs]
    if tp.size > 1:
        all_specs = [{} for _ in range(tp.size)]
        dist.all_gather_object(all_specs, specs, group=tp.group)
    for name in names:
        p = params[name].detach()
        if name not in specs:
            yield name, p
            continue
        locals_ = [p]
        if tp.size > 1:
            locals_ = [torch.empty_like(p) for _ in range(tp.size)]
            dist.all_gather(locals_, p.contiguous(), group=tp.group)
        yield name, assemble_from_shards([s[name] for s in all_specs], locals_) if is_writer else p


def _hf_layout(model: nn.Module) -> tuple[dict[str, Any], list[str], list[tuple[str, int]]]:
    """``(config.json content, plait names, (Hugging Face name, full bytes) entries)`` of ``model``."""
    config = config_of(model)
    config_dict = config.to_hf_dict()  # raises for configs HF cannot express, before any I/O
    specs = shard_specs(model)
    hf_name = family_of(config).hf_name
    names, entries = [], []
    for name, p in hf_state(model).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shape = specs[name].full_shape if name in specs else tuple(p.shape)
        names.append(name)
        entries.append((hf_name(name, config), p.element_size() * int(torch.Size(shape).numel())))
    config_dict["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return config_dict, names, entries


def write_local_model(model: nn.Module, path: PathLike, *, max_shard_bytes: int = 5 * 1024**3,
                      extra_files: Iterable[tuple[str, Any]] = ()) -> None:
    """Write ``model``, held whole by this process (no tensor parallelism), as a Hugging Face
    directory, with no collective: one rank may call it alone."""
    config_dict, names, entries = _hf_layout(model)
    config = config_of(model)
    hf_name = family_of(config).hf_name
    params = hf_state(model)
    write_hf_dir(path, config_dict, entries, ((hf_name(n, config), params[n]) for n in names),
                 max_shard_bytes=max_shard_bytes, extra_files=extra_files)


def save_hf_checkpoint(model: nn.Module, path: PathLike, tp_info: GroupInfo, *,
                       max_shard_bytes: int = 5 * 1024**3, replace: bool = False,
                       extra_files: Iterable[tuple[str, Any]] = ()) -> None:
    """Write ``model`` (sharded over ``tp_info``) as a Hugging Face directory at ``path``.

    Every rank of the job must call this (tensors are gathered over the TP group, and rank 0's
    outcome is broadcast to all ranks); global rank 0 writes. Pipeline-parallel models (each stage
    holding some layers) are not supported yet. ``lm_head.weight`` is dropped when the embeddings
    are tied, as Hugging Face does. Returns after the directory is complete on every rank.
    ``replace``: a model directory plait wrote before at ``path`` may be replaced, and
    ``extra_files`` are written into it (on the writing rank), as in :func:`write_hf_dir`.
    """
    config_dict, names, entries = _hf_layout(model)
    is_writer = dist.get_rank() == 0 if dist.is_initialized() else tp_info.rank == 0
    config = config_of(model)
    hf_name = family_of(config).hf_name
    stream = ((hf_name(name, config), t) for name, t in _gathered(model, names, tp_info, is_writer))
    error: BaseException | None = None
    if is_writer:
        try:
            write_hf_dir(path, config_dict, entries, stream, max_shard_bytes=max_shard_bytes, replace=replace,
                         extra_files=extra_files)
        except Exception as e:  # reported to every rank below, so none waits forever
            error = e
            for _ in stream:  # finish the gathers the other ranks are waiting in
                pass
    else:
        for _ in stream:  # take part in every gather
            pass
    if dist.is_initialized():  # doubles as the barrier: nobody returns before the files exist
        status = [error is None]
        dist.broadcast_object_list(status, src=0)  # object form: works on gloo and NCCL alike
        if not status[0] and error is None:
            raise RuntimeError(f"rank 0 failed to write the checkpoint {path}")
    if error is not None:
        raise error


# ---------------------------------------------------------------------------------- GGUF
def gguf_to_hf_dir(gguf_file: PathLike, out_dir: PathLike, *, max_shard_bytes: int = 5 * 1024**3,
                   overwrite: bool = False) -> Path:
    """Dequantise a GGUF model into a float32 safetensors HF directory with its tokenizer, chat
    template and generation config.

    transformers can read GGUF but refuses ``save_pretrained`` on the result, so the tensors and
    config are written here instead. Used to get real weights without a model hub.
    """
    # lazy: transformers is the optional ``hf`` extra and slow to import; only this converter needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    kw = {"gguf_file": gguf_file.name}
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    cfg = hf.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"
    cfg["architectures"] = cfg.get("architectures") or [type(hf).__name__]
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    entries = [(k, v.numel() * v.element_size()) for k, v in state.items()]
    extra: list[tuple[str, Any]] = [("tokenizer", tokenizer.save_pretrained)]  # with its chat template
    if getattr(hf, "generation_config", None) is not None:  # the decoding defaults (BOS/EOS/pad ids)
        extra.append(("generation config", hf.generation_config.save_pretrained))
    write_hf_dir(out_dir, cfg, entries, state.items(), max_shard_bytes=max_shard_bytes, extra_files=extra,
                 replace=overwrite)
    return Path(out_dir)


__all__ = ["CheckpointMismatchError", "HFTensors", "check_hf_tensors", "gguf_to_hf_dir", "load_hf_config",
           "load_hf_weights", "read_hf_tensors", "save_hf_checkpoint", "write_hf_dir"]
