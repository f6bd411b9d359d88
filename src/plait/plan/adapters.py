"""The model states of a LoRA or QLoRA run, as the planner prices them.

Under LoRA only the adapters train: they alone have gradients, optimizer moments and fp32 master
copies (sharded by ZeRO like any trained weight); the base is a frozen weight in the parameter
dtype. With ``lora.quantize_base`` the base projections of every decoder block are stored as
:mod:`plait.quantize` stores them, priced element for element here: per unit (a row of a column
projection, a column of a row projection; ``length`` values along the hidden size) NF4 takes
``length / 2`` code bytes, ``length / block`` int8 scales and two fp32 numbers (factor and
mean); int8 takes ``length`` bytes and ``length / block`` fp32 scales. Embeddings, norms, biases
and the head stay in the parameter dtype. ``tests/test_qlora_memory.py`` checks the prices against
the bytes the built model holds, at TP=1 and TP=2.

The frozen weights are priced in fp32, as a run holds them (it builds in fp32, and the optimizer
moves only what it trains into the preset's parameter dtype); the adapters in the parameter dtype.
Under ZeRO-3 the adapters and the dense frozen weights are sharded over the data-parallel ranks
and the quantized projections are not (the blocks gathered at a time are left out: a lower
bound). Dense families only: for an MoE or latent-attention family the planner keeps the
full-training price.
Activations are priced as for full training (the adapters' rank-``r`` intermediates are small;
the quantized base's dequantized weights exist only inside one matmul).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.models.decoder.shapes import BlockShape, LocalShapes


@dataclass(frozen=True)
class AdapterPlan:
    """The LoRA section as the planner needs it: rank, targets, and how the base is stored."""

    rank: int
    target_modules: tuple[str, ...]
    quantize_base: str = "none"
    block_size: int = 64


@dataclass(frozen=True)
class Projection:
    """One local projection matrix of a block: ``rows x cols`` elements on this rank (its
    ``out x in``), and whether tensor parallelism splits its output (column) or its input (row)."""

    name: str
    rows: int
    cols: int
    column: bool


def block_projections(block: BlockShape, sh: LocalShapes) -> list[Projection]:
    """The local projection matrices of one dense block (q/k/v or a fused q/k/v, o, the MLP)."""
    h, i = sh.hidden, sh.intermediate
    if block.fused_qkv:
        out = [Projection("query_key_value", sh.q + 2 * sh.kv, h, True), Projection("dense", h, sh.q, False)]
    else:
        out = [Projection("q_proj", sh.q, h, True), Projection("k_proj", sh.kv, h, True),
               Projection("v_proj", sh.kv, h, True), Projection("o_proj", h, sh.q, False)]
    if block.gated_mlp:
        out += [Projection("gate_proj", i, h, True), Projection("up_proj", i, h, True),
                Projection("down_proj", h, i, False)]
    else:
        out += [Projection("dense_h_to_4h", i, h, True), Projection("dense_4h_to_h", h, i, False)]
    return out


def quantized_bytes(proj: Projection, method: str, block_size: int) -> int:
    """Bytes of ``proj``'s weight stored as :mod:`plait.quantize` stores it."""
    units, length = (proj.rows, proj.cols) if proj.column else (proj.cols, proj.rows)
    blocks = length // block_size
    if method == "nf4":
        return units * (length // 2 + blocks + 8)
    if method == "int8":
        return units * (length + 4 * blocks)
    raise ValueError(f"unknown quantization method {method!r}")


def adapter_elements(block: BlockShape, sh: LocalShapes, plan: AdapterPlan) -> int:
    """Adapter elements of one block on this rank: ``A`` (``[r, in]``, the input split as the base's
    for a row projection) and ``B`` (``[out, r]``, the output split for a column projection)."""
    total = 0
    for proj in block_projections(block, sh):
        if proj.name in plan.target_modules:
            total += plan.rank * (proj.cols + proj.rows)
    return total


def frozen_base_bytes(block: BlockShape, sh: LocalShapes, plan: AdapterPlan, param_bytes: int) -> int:
    """Bytes of one block's projection weights (biases apart) as the run stores its frozen base."""
    projs = block_projections(block, sh)
    if plan.quantize_base == "none":
        return sum(p.rows * p.cols for p in projs) * param_bytes
    return sum(quantized_bytes(p, plan.quantize_base, plan.block_size) for p in projs)


def projection_elements(block: BlockShape, sh: LocalShapes) -> int:
    """Elements of one block's projection weights (what a quantized base replaces)."""
    return sum(p.rows * p.cols for p in block_projections(block, sh))



#: bytes per value of the frozen base as a run holds it: it is built in fp32, and the optimizer
#: moves only what it trains into the precision preset's parameter dtype
FROZEN_BYTES = 4


def adapter_states(block: BlockShape | None, sh: LocalShapes, plan: AdapterPlan, layers: int, P: int,
                   param_bytes: int, *, shards: int = 1) -> tuple[int, int] | None:
    """``(trained elements, parameter bytes)`` of a rank holding ``layers`` decoder layers and ``P``
    base parameters, the adapters in ``param_bytes`` per value, or ``None`` where the planner keeps
    the full-training price (see the module doc). ``shards``: ZeRO-3's data-parallel degree, over
    which the trained weights and the dense frozen ones are sharded (the quantized ones are not);
    the blocks gathered at a time are left out, so the figure is a lower bound there."""
    if block is None or block.latent is not None:
        return None
    trained = layers * adapter_elements(block, sh, plan)
    dense_frozen = (P - layers * projection_elements(block, sh)) * FROZEN_BYTES
    projections = layers * frozen_base_bytes(block, sh, plan, FROZEN_BYTES)
    if plan.quantize_base == "none":  # the projections are dense frozen weights too
        dense_frozen, projections = dense_frozen + projections, 0
    return trained, -(-dense_frozen // shards) + projections + -(-trained * param_bytes // shards)
