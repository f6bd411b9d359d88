"""Model FLOPs per token and model FLOPs utilisation (MFU), PaLM convention.

MFU counts only the FLOPs the model mathematically needs (forward + backward of the matmuls,
attention scores included), never recomputation or padding, so it compares runs with different
parallel layouts, activation checkpointing or kernels on equal terms (PaLM, Chowdhery et al.
2022, appendix B):

    flops_per_token = 6 * N + 12 * L * H * Q * T

with ``N`` the matmul parameters (every parameter except the input embedding, plus the output
head's ``vocab x hidden`` matrix, counted even when it is tied to the embedding because its
matmul still runs), ``L`` layers, ``H`` query heads, ``Q`` head dim and ``T`` the sequence
length. The factor 6 is 2 (multiply-add) x 3 (forward, input gradient, weight gradient); the
attention term is ``QK^T`` and ``PV`` at full (unmasked) size, except that a sliding-window
family (Mistral) counts ``min(T, window)`` keys per query (``config.attention_span``), and a
family whose keys and values differ in width (DeepSeek-V3's latent attention) counts
``6 * L * H * (Q_k + Q_v) * T`` (``config.attention_matmul_width``). Blocks the model runs after its
last layer (``config.tail_layer_ids``: DeepSeek-V3's multi-token prediction) count as layers; their
second pass through the shared output head is not counted.
The config may be of any model family. For Mixture-of-Experts families ``N`` counts the experts a
token is routed to (``num_experts_per_tok`` of each MoE layer, the router included), not every
expert: the config's ``inactive_expert_parameters()`` are left out, so MFU stays the share of the
peak the model's own computation uses (dropped tokens under a capacity are still counted).
"""

from __future__ import annotations

from plait.models.decoder.config import DecoderConfig


def matmul_params(config: DecoderConfig) -> int:
    """Non-embedding parameters plus the output head's matrix, less the experts a token does not use
    (the ``N`` of ``6N``)."""
    embedding = config.vocab_size * config.hidden_size
    head = config.vocab_size * config.hidden_size
    non_embedding = config.num_parameters() - embedding - (0 if config.tie_word_embeddings else head)
    inactive = getattr(config, "inactive_expert_parameters", None)  # MoE families: experts a token skips
    return non_embedding + head - (inactive() if callable(inactive) else 0)


def model_flops_per_token(config: DecoderConfig, seq_len: int, *, weight_gradients: bool = True) -> int:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``weight_gradients=False`` is a frozen base (LoRA): the backward pass computes the input
    gradients of every matmul but no weight gradients, 4N instead of 6N (the adapters' own few
    FLOPs are not counted)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    span = config.attention_span(seq_len)
    layers = config.num_hidden_layers + len(config.tail_layer_ids())
    attention = 6 * layers * config.attention_matmul_width() * span
    return int((6 if weight_gradients else 4) * matmul_params(config) + attention)


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak (0..1).

    ``tokens_per_s_per_device`` is the job's training throughput divided by its number of
    devices (all of DP x TP x PP x CP), so a TP group that processes one batch counts it once.
    """
    if peak <= 0:
        raise ValueError(f"peak={peak!r} FLOP/s must be positive")
    return tokens_per_s_per_device * flops_per_token / peak


__all__ = ["matmul_params", "mfu", "model_flops_per_token"]
