"""Fast generation from plait models: a KV-cache decoding engine for every family and layout.

- :mod:`~plait.inference.kv_cache`: the per-layer key/value buffers and the shared decode mask;
- :mod:`~plait.inference.attach`: a model in decoding mode for one generation (caches attached,
  sequence parallelism and MoE capacity off, eval mode), restored afterwards;
- :mod:`~plait.inference.sampling`: greedy, temperature, top-k and top-p, one seeded generator per row;
- :mod:`~plait.inference.engine`: batched prompts, prefill then one token per step, stop rules;
- :mod:`~plait.inference.uncached`: the full-recompute path, the reference and the benchmark baseline.

See docs/generation.md.
"""

from plait.inference.engine import Completion, StopRules, generate, generate_tokens, model_context, stop_ids
from plait.inference.sampling import Sampling, filtered_logits, next_tokens, top_k_filter, top_p_filter
from plait.inference.uncached import generate_uncached

__all__ = ["Completion", "Sampling", "StopRules", "filtered_logits", "generate", "generate_tokens", "generate_uncached",
           "model_context", "next_tokens", "stop_ids", "top_k_filter", "top_p_filter"]
