"""Find the chain of modules a pipeline can be cut along: embedding, blocks, final norm, head.

A pipeline stage boundary may only fall between two consecutive blocks, and only if the one
tensor that crosses it is the earlier block's output (side inputs computed from the model's own
inputs or buffers, such as the rotary cos/sin tables, the position ids or an attention mask, are
recomputed or shared by every stage). This module traces the model, lists its *units* in execution
order and checks exactly that, so the partitioner never proposes a cut the runtime cannot honour.

Units are the modules at the level of the block list: the blocks themselves (children of the
``nn.ModuleList`` holding the layers) and the siblings of the block list and of its ancestors
(``model.embed_tokens``, ``model.rotary_emb``, ``model.norm``, ``lm_head``, ...). Every graph node
is assigned to the unit whose code produced it (from the ``nn_module_stack`` metadata that both
``torch.fx`` and ``torch.export`` record); nodes of the enclosing forwards are glue.

Two tracers are used:

- :func:`trace_units`: ``torch.fx`` symbolic tracing with plait's decoder blocks (classes marked
  ``pipeline_block = True``, as every model family's block is) and the caller's ``leaf_types`` as
  leaf modules (fx calls them as black boxes). Needs no inputs.
- :func:`trace_units_export`: ``torch.export`` with example inputs, for models fx cannot trace
  (Hugging Face ``transformers`` 5.x models, for instance). :func:`trace_units` falls back to it
  when fx fails and ``example_inputs`` are given.
"""

from __future__ import annotations

import builtins
import inspect
import operator
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.fx
from torch import nn

if TYPE_CHECKING:
    from plait.models.llama.config import LlamaConfig

#: the values of :attr:`Unit.kind`
UNIT_KINDS = ("embedding", "block", "norm", "head", "other")

# Reading these from a tensor depends on its metadata, not its values: a side input computed from
# ``h.dtype`` or ``h.shape`` (the rotary tables, a mask) does not make the hidden state cross a cut.
_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"})
_META_OPS = frozenset({
    "size", "dim", "numel", "get_device", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset",
    "new_ones", "new_zeros", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like", "full_like",
})


class TraceError(ValueError):
    """The model cannot be traced, or its traced graph is not a chain through its blocks."""


@dataclass(frozen=True)
class Unit:
    """One module on the model's chain, in execution order.

    ``name`` is the qualified module name (``model.layers.3``), ``kind`` one of
    :data:`UNIT_KINDS`, ``module_type`` the module's class name (``LlamaDecoderLayer``).
    """

    name: str
    kind: str
    module_type: str


# ---------------------------------------------------------------------------------------- tracing
def trace_units(model: nn.Module, leaf_types: tuple[type, ...] = (),
                example_inputs: torch.Tensor | tuple[Any, ...] | None = None, *,
                block_list: str | None = None, concrete_args: dict[str, Any] | None = None,
                export_kwargs: dict[str, Any] | None = None) -> list[Unit]:
    """The model's units in execution order, traced with ``torch.fx``.

    ``leaf_types``: extra module classes fx must not trace into (a module whose class sets
    ``pipeline_block = True``, such as every plait family's decoder block, is always a leaf); use it
    for modules with data-dependent Python control flow.
    ``example_inputs`` (a tensor or a tuple of positional inputs): only used when fx fails, to
    retry with :func:`trace_units_export` (with ``export_kwargs``, default ``use_cache=False``
    when the forward takes it). ``block_list``: qualified name of the module list holding the
    blocks (default: the ``ModuleList``/``Sequential``/``ModuleDict`` holding the most parameters).
    ``concrete_args``: fx's argument of that name; default ``None`` for each of plait's optional
    forward inputs the forward takes (``labels``, the packed layout ``position_ids`` /
    ``segment_ids``, ``loss_normalizer``) and ``logits_to_keep=0``: the traced path is the plain
    next-token one.

    Raises :class:`TraceError` when tracing fails (naming the code and how to make it a leaf) or
    when the graph is not a chain through the blocks.
    """
    blocks = block_list if block_list is not None else find_block_list(model)
    leaves = tuple(leaf_types)
    if concrete_args is None:
        params = inspect.signature(model.forward).parameters
        concrete_args = {name: value for name, value in _OPTIONAL_INPUTS.items() if name in params} or None
    tracer = _UnitTracer(leaves, blocks)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:  # fx fails in many ways (TraceError, TypeError, ValueError, ...)
        message = _describe_fx_failure(exc, tracer, model, blocks)
        if example_inputs is None:
            raise TraceError(message) from exc
        try:
            return trace_units_export(model, example_inputs, export_kwargs, block_list=blocks)
        except TraceError as export_exc:
            raise TraceError(f"{message}\n\nThe torch.export fallback failed too: {export_exc}") from exc
    repeated = sorted(name for name, count in tracer.num_calls.items()
                      if count > 1 and _unit_of_path(name, _ancestors(blocks)) == name)
    if repeated:
        raise TraceError(f"module(s) {', '.join(repeated)} run more than once in one forward; a pipeline "
                         f"stage must hold each module's only call")
    return _units_from_graph(graph, model, blocks)


def trace_units_export(model: nn.Module, example_inputs: torch.Tensor | tuple[Any, ...],
                       kwargs: dict[str, Any] | None = None, *,
                       block_list: str | None = None) -> list[Unit]:
    """The model's units in execution order, traced with ``torch.export.export``.

    For models ``torch.fx`` cannot trace. ``example_inputs``: a tensor or a tuple of positional
    inputs; ``kwargs``: keyword inputs, default ``{"use_cache": False}`` when the forward takes
    ``use_cache`` (a KV cache would add outputs that cross every cut). The export runs the model
    on fake tensors once; the units come from the ``nn_module_stack`` metadata of its ATen graph.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if kwargs is None:
        params = inspect.signature(model.forward).parameters
        kwargs = {"use_cache": False} if "use_cache" in params else {}
    blocks = block_list if block_list is not None else find_block_list(model)
    try:
        program = torch.export.export(model, args, dict(kwargs))
    except Exception as exc:
        raise TraceError(f"torch.export could not trace {type(model).__name__}: "
                         f"{type(exc).__name__}: {_first_lines(str(exc), 12)}") from exc
    return _units_from_graph(program.graph_module.graph, model, blocks)


def decoder_units(num_layers: int, block_type: str) -> list[Unit]:
    """The units :func:`trace_units` finds in a plait decoder (embedding, rotary tables, ``num_layers``
    blocks of class ``block_type``, final norm, output head), without building or tracing a model
    (for ``plait config show`` and cost estimates). Model families describe their units with it."""
    return ([Unit("model.embed_tokens", "embedding", "Embedding"), Unit("model.rotary_emb", "other", "RotaryEmbedding")]
            + [Unit(f"model.layers.{i}", "block", block_type) for i in range(num_layers)]
            + [Unit("model.norm", "norm", "RMSNorm"), Unit("lm_head", "head", "Linear")])


def llama_units(config: LlamaConfig) -> list[Unit]:
    """The units of plait's unsharded ``LlamaForCausalLM`` for ``config`` (:func:`decoder_units`)."""
    return decoder_units(config.num_hidden_layers, "LlamaDecoderLayer")


def find_block_list(model: nn.Module) -> str:
    """Qualified name of the module list holding the blocks: among the ``ModuleList``,
    ``Sequential`` and ``ModuleDict`` submodules (not the root), the one with the most parameters
    (then the most children; the first in module order on a tie)."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if not name or not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or not len(module):
            continue
        key = (sum(p.numel() for p in module.parameters()), len(module))
        if best_key is None or key > best_key:
            best, best_key = name, key
    if best is None:
        raise TraceError(f"{type(model).__name__} has no nn.ModuleList/Sequential/ModuleDict of blocks; "
                         f"pass block_list='<qualified name of the module holding the layers>'")
    return best


# ------------------------------------------------------------------------------------- fx tracer
#: optional inputs of plait's causal-LM forward, fixed to ``None`` when tracing
#: plait's optional forward inputs and the value each is traced with (the plain next-token path)
_OPTIONAL_INPUTS: dict[str, Any] = {"labels": None, "position_ids": None, "segment_ids": None,
                                    "loss_normalizer": None, "logits_to_keep": 0}


class _UnitTracer(torch.fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...], block_list: str) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.ancestors = _ancestors(block_list)
        self.record_stack_traces = True
        self.failed_node: torch.fx.Node | None = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, self.leaf_types) or getattr(type(m), "pipeline_block", False):
            return True
        if qualname in self.ancestors:  # an nn.Sequential block list must be traced through
            return False
        return super().is_leaf_module(m, qualname)

    # Remember the value that reached Python control flow, to name it in the error.
    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        self.failed_node = obj.node
        return super().to_bool(obj)

    def iter(self, obj: torch.fx.Proxy) -> Iterator[Any]:
        self.failed_node = obj.node
        return super().iter(obj)

    def keys(self, obj: torch.fx.Proxy) -> torch.fx.Proxy:
        self.failed_node = obj.node
        return super().keys(obj)


def _describe_fx_failure(exc: Exception, tracer: _UnitTracer, model: nn.Module, block_list: str) -> str:
    lines = [f"torch.fx cannot trace {type(model).__name__}: {type(exc).__name__}: {_first_lines(str(exc), 6)}"]
    frame = _user_frame(exc)
    if frame is not None:
        lines.append(f"  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
    stack = list(tracer.module_stack.values())  # still holds the modules being traced when it failed
    if tracer.failed_node is not None:
        node = tracer.failed_node
        where = f" (computed at {_last_stack_line(node.stack_trace)})" if node.stack_trace else ""
        lines.append(f"  the traced value that reached Python control flow is node `{node.name}` = "
                     f"{node.op} {_target_name(node)}{where}")
    control_flow = tracer.failed_node is not None or "control flow" in str(exc)
    ancestors = _ancestors(block_list)
    inner = [(path, typ) for path, typ in stack if path not in ancestors]
    fallback = "pass example_inputs to use the torch.export fallback (trace_units_export)"
    if inner:
        path, typ = inner[-1]
        cls = _cls_name(typ)
        lines.append(f"  inside module `{path}` ({cls})")
        unit_cls = _cls_name(inner[0][1])
        also = f" (or its enclosing unit's class: leaf_types=({unit_cls},))" if inner[0][0] != path else ""
        lines.append(f"Make that module a leaf, which fx calls as a black box without tracing into it: "
                     f"trace_units(model, leaf_types=({cls},)){also}; or {fallback}.")
    elif control_flow:
        where = stack[-1][0] if stack else ""
        lines.append(f"  in the forward of {f'`{where}`' if where else 'the root module'}, which holds the block "
                     f"list and cannot be a leaf: move that code into a submodule and pass its class in "
                     f"leaf_types, or {fallback}.")
    else:
        lines.append(f"To trace it anyway, {fallback}.")
    if control_flow:
        lines.append("(fx traces with symbolic values: Python `if`/`for`/`bool()` on tensor values cannot be "
                     "recorded; leaf_types lists the module classes fx must not trace into.)")
    return "\n".join(lines)


def _cls_name(typ: object) -> str:
    return typ.__name__ if isinstance(typ, type) else str(typ).rsplit(".", 1)[-1]


def _user_frame(exc: Exception) -> traceback.FrameSummary | None:
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(torch_dir) and os.path.abspath(f.filename) != here]
    return frames[-1] if frames else None


def _last_stack_line(stack_trace: str) -> str:
    """``File "...", line N, in f: code`` of the innermost frame outside torch in an fx stack trace."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    lines = [ln.strip() for ln in stack_trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith('File "') and not lines[i][6:].startswith(torch_dir):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return lines[-1] if lines else "?"


def _first_lines(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n]) + ("\n  ..." if len(lines) > n else "")


# ---------------------------------------------------------------------------- graph -> units
def _ancestors(block_list: str) -> set[str]:
    """``{"", "model", "model.layers"}`` for ``"model.layers"``: the modules whose forwards are glue."""
    parts = block_list.split(".") if block_list else []
    return {".".join(parts[:i]) for i in range(len(parts) + 1)}


def _unit_of_path(path: str, ancestors: set[str]) -> str | None:
    """The unit a module path belongs to: the path cut one level below its deepest ancestor."""
    if path in ancestors:
        return None
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if ".".join(parts[:i]) in ancestors:
            return ".".join(parts[:i + 1])
    return None


def _node_unit(node: torch.fx.Node, ancestors: set[str]) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else value
        unit = _unit_of_path(str(path), ancestors)
        if unit is not None:
            return unit
    return None


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    name = getattr(t, "_opname", None) or getattr(t, "__name__", None) or str(t)
    return str(name)


def _is_meta(node: torch.fx.Node) -> bool:
    """True when the node reads only the metadata (shape, dtype, device) of its tensor inputs."""
    if node.op == "call_function" and node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _META_ATTRS
    if node.op in ("call_function", "call_method"):
        return _target_name(node) in _META_OPS
    return False


def _ignored_user(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and "_assert" in _target_name(node)


def _kind(module: nn.Module, position: str, seen_head: bool) -> str:
    cls = type(module).__name__
    has_params = any(True for _ in module.parameters())
    if position == "block":
        return "block"
    if position == "before" and has_params and (isinstance(module, nn.Embedding) or cls.endswith("Embedding")):
        return "embedding"
    if position == "after" and "norm" in cls.lower():
        return "norm"
    if position == "after" and has_params and not seen_head:
        return "head"
    return "other"


def _units_from_graph(graph: torch.fx.Graph, model: nn.Module, block_list: str) -> list[Unit]:
    ancestors = _ancestors(block_list)
    try:
        container = model.get_submodule(block_list)
    except AttributeError as exc:
        raise TraceError(f"block_list={block_list!r} is not a submodule of {type(model).__name__}") from exc
    block_names = {f"{block_list}.{child}" if block_list else child for child, _ in container.named_children()}

    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    unit_of = {n: _node_unit(n, ancestors) for n in nodes}

    # Execution order and one-piece check: each unit's nodes form one run among the unit nodes.
    runs: list[str] = []
    for n in nodes:
        u = unit_of[n]
        if u is None or _ignored_user(n):
            continue
        if not runs or runs[-1] != u:
            if u in runs:
                raise TraceError(f"module `{u}` runs in more than one piece (its code is interleaved with "
                                 f"`{runs[-1]}`, or it is called more than once); a pipeline stage must "
                                 f"hold each unit's whole, single call")
            runs.append(u)
    order = runs
    blocks = [u for u in order if u in block_names]
    if not blocks:
        raise TraceError(f"no block of `{block_list}` runs in the traced graph of {type(model).__name__}")
    missing = sorted(block_names - set(blocks), key=_natural_key)
    if missing:
        raise TraceError(f"block(s) {', '.join(missing)} of `{block_list}` never run in the forward; "
                         f"every block must run once to be placed on a stage")
    first, last = order.index(blocks[0]), order.index(blocks[-1])
    between = [u for u in order[first:last + 1] if u not in block_names]
    if between:
        raise TraceError(f"module(s) {', '.join(between)} run between the blocks of `{block_list}`; "
                         f"a pipeline chain needs the blocks to run back to back")

    units: list[Unit] = []
    seen_head = False
    for i, name in enumerate(order):
        module = model.get_submodule(name)
        position = "before" if i < first else "block" if i <= last else "after"
        kind = _kind(module, position, seen_head)
        seen_head |= kind == "head"
        units.append(Unit(name, kind, type(module).__name__))

    _check_chain(nodes, index, unit_of, units, blocks)
    return units


def _check_chain(nodes: list[torch.fx.Node], index: dict[torch.fx.Node, int], unit_of: dict[torch.fx.Node, str | None],
                 units: list[Unit], blocks: list[str]) -> None:
    """Every value crossing the boundary before block k (k >= 1) must be block k-1's output (a
    single value, consumed by block k) or a side value that no embedding or block output feeds."""
    sources = {u.name for u in units if u.kind in ("embedding", "block")}
    streamy: dict[torch.fx.Node, bool] = {}
    for n in nodes:
        streamy[n] = unit_of[n] in sources or (
            not _is_meta(n) and any(streamy.get(a, False) for a in n.all_input_nodes))
    first_index: dict[str, int] = {}
    for n in nodes:
        u = unit_of[n]
        if u is not None and u not in first_index and not _ignored_user(n):
            first_index[u] = index[n]

    def output_of(value: torch.fx.Node, block: str) -> bool:
        while value.op == "call_function" and value.target is operator.getitem:
            value = cast(torch.fx.Node, value.args[0])  # the indexed value of a traced getitem
        return unit_of[value] == block

    def describe(node: torch.fx.Node) -> str:
        u = unit_of[node]
        return f"`{node.name}` ({'in ' + u if u else 'in the enclosing forward'})"

    for k in range(1, len(blocks)):
        prev, cur, pos = blocks[k - 1], blocks[k], first_index[blocks[k]]
        carried: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = []
        for n in nodes[:pos]:
            if n.op == "get_attr" or not streamy[n]:
                continue
            later = [u for u in n.users if index[u] >= pos and not _ignored_user(u)]
            if not later:
                continue
            if not output_of(n, prev):
                raise TraceError(
                    f"the graph is not a chain through the blocks: value {describe(n)} is computed before "
                    f"`{cur}` from an embedding or block output and used after it by {describe(later[0])}; "
                    f"a stage boundary before `{cur}` carries only the output of `{prev}` (side inputs "
                    f"computed from the model inputs, like rotary tables or masks, may be shared)")
            carried.append((n, later))
        if len(carried) != 1:
            what = ", ".join(describe(n) for n, _ in carried) or "nothing"
            raise TraceError(f"the graph is not a chain through the blocks: the boundary before `{cur}` must "
                             f"carry exactly one value, the output of `{prev}`, but carries {what}")
        value, later = carried[0]
        if not any(unit_of[u] == cur for u in later):
            raise TraceError(f"the graph is not a chain through the blocks: `{cur}` does not consume the "
                             f"output of `{prev}` (`{value.name}` is used by {describe(later[0])})")


def _natural_key(name: str) -> list[int | str]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]
