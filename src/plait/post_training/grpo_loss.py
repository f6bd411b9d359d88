"""The GRPO policy loss and its pieces, as pure functions of per-token tensors.

GRPO (Shao et al., 2024, "DeepSeekMath") samples ``G`` completions for each of ``P`` prompts,
scores them with a verifiable reward and pushes the policy towards the completions that beat
their own group. Three published variants differ only in how the advantages are scaled and how
the per-token losses are averaged:

* ``grpo``: advantages ``(r - mean_g) / (std_g + eps)``; each completion's token losses are
  averaged, then the completions are averaged.
* ``dr_grpo`` (Liu et al., 2025, "Understanding R1-Zero-like training"): advantages
  ``r - mean_g`` (no division by the std, which favours groups that are nearly all right or
  all wrong); the token losses are summed and divided by a constant,
  ``num_sequences * max_completion_tokens``, so a long completion is not down-weighted per token.
* ``dapo`` (Yu et al., 2025, "DAPO"): advantages as ``grpo``; groups whose rewards are all equal
  carry no signal and are dropped; the token losses are averaged over every completion token of
  the rollout batch (a token-level mean), and the clip range may be asymmetric
  (``eps_high > eps_low``, "clip-higher").

The per-token loss is PPO's clipped surrogate with the importance ratio
``rho = exp(logp - old_logp)``::

    loss_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_coef * kl_t

with ``kl_t`` the k3 estimator of ``KL(pi || ref)``: ``exp(ref - logp) - (ref - logp) - 1``
(Schulman, 2020), unbiased and never negative.

Why the loss is a weighted *sum*: every variant's average is written as fixed per-token weights
(:func:`token_weights`) computed from *global* counts (sequences and tokens of the whole rollout
batch, over every micro-batch and data-parallel rank), so ``loss = sum(weights * loss_t)``
over any subset of the tokens is that subset's exact share of the whole. Summing the
micro-batch losses (gradient accumulation) and summing the gradients over data-parallel ranks
then gives exactly the loss and gradient of the whole batch (a gradient sync that averages
over ``dp`` ranks instead needs the loss scaled by ``dp``).

Everything is computed in at least fp32 (fp64 inputs stay fp64). No function here communicates.
"""

from __future__ import annotations

import math
from functools import reduce
from typing import Literal, get_args

import torch

Variant = Literal["grpo", "dr_grpo", "dapo"]
VARIANTS: tuple[str, ...] = get_args(Variant)

Metrics = dict[str, torch.Tensor]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not known; choose one of {VARIANTS}")


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The widest floating dtype among the inputs, at least fp32."""
    return reduce(torch.promote_types, (t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int (the count over the whole rollout batch)")


# ------------------------------------------------------------------------------------ advantages
def group_advantages(rewards: torch.Tensor, variant: str, eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages of ``G`` completions for each of ``P`` prompts.

    Args:
        rewards: ``[P, G]``, the reward of completion ``g`` of prompt ``p``; finite, ``G >= 2``.
        variant: one of :data:`VARIANTS`.
        eps: added to the group std before dividing (``grpo``, ``dapo``), so a group of nearly
            equal rewards does not blow up; > 0.

    Returns:
        ``advantages [P, G]`` (at least fp32) and ``kept [P]`` (bool):

        * ``grpo``, ``dapo``: ``A = (r - mean_g(r)) / (std_g(r) + eps)``, with the *unbiased*
          group std (``sqrt(sum (r - mean)^2 / (G - 1))``, ``torch.std``'s default, as trl uses).
        * ``dr_grpo``: ``A = r - mean_g(r)``, no std division.
        * ``kept``: ``dapo`` drops (``False``) the groups whose rewards are all equal, since they
          carry no learning signal and would only dilute the token mean; ``grpo`` and ``dr_grpo``
          keep every group.

    A group whose rewards are all equal has advantages exactly 0 in every variant (the
    subtraction of a rounded mean could otherwise leave a residue that ``1 / (0 + eps)`` scales
    up). The caller removes the sequences of dropped groups (or zeroes their completion masks)
    and counts only kept sequences and their tokens in :func:`token_weights`.

    Checks that the rewards are finite (one host synchronisation: rewards are scored on the host).
    """
    _check_variant(variant)
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [P, G] with G >= 2 completions per prompt (a group of one has no "
                         f"baseline); got shape {tuple(rewards.shape)}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r} must be a finite number > 0")
    r = rewards.to(_work_dtype(rewards))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must all be finite; got NaN or inf (see plait.post_training.rewards."
                         "score_completions, which refuses them)")
    centred = r - r.mean(dim=1, keepdim=True)
    advantages = centred if variant == "dr_grpo" else centred / (r.std(dim=1, keepdim=True) + eps)
    all_equal = r.amax(dim=1) == r.amin(dim=1)
    advantages = torch.where(all_equal[:, None], torch.zeros_like(advantages), advantages)
    kept = ~all_equal if variant == "dapo" else torch.ones_like(all_equal)
    return advantages, kept


# --------------------------------------------------------------------------------------- weights
def token_weights(completion_mask: torch.Tensor, variant: str, *, num_sequences: int, num_tokens: int,
                  max_completion_tokens: int) -> torch.Tensor:
    """The weight of each completion token in the loss, so that the loss is ``sum(w * loss_t)``.

    Args:
        completion_mask: ``[N, T]`` bool or 0/1, one whole completion per row (its tokens 1).
        variant: one of :data:`VARIANTS`.
        num_sequences: sequences of the whole rollout batch (every micro-batch and data-parallel
            rank), counting only *kept* ones (dapo's dropped groups are not counted).
        num_tokens: completion tokens of those kept sequences (``dapo``'s normaliser).
        max_completion_tokens: the generation limit (``dr_grpo``'s constant normaliser).

    Returns ``[N, T]`` (fp32, or fp64 for an fp64 mask), 0 outside the completions:

    * ``grpo``: ``mask / (len_n * num_sequences)``, ``len_n`` the row's completion tokens: each
      completion's mean token loss, then the mean over completions.
    * ``dapo``: ``mask / num_tokens``: the mean over every completion token of the batch.
    * ``dr_grpo``: ``mask / (num_sequences * max_completion_tokens)``: no length normalisation.

    Every count except ``len_n`` is global, so the weights of a micro-batch are its exact share
    and the weights of the whole batch add up to 1 (``grpo``, ``dapo``; for ``grpo`` only when no
    counted row is empty: an empty row has weight 0 but still counts as a sequence, as in trl).
    Nothing here synchronises; the caller's counts are trusted (no check that a row is shorter
    than ``max_completion_tokens``).
    """
    _check_variant(variant)
    if completion_mask.dim() != 2:
        raise ValueError(f"completion_mask must be [N, T]; got shape {tuple(completion_mask.shape)}")
    for name, value in (("num_sequences", num_sequences), ("num_tokens", num_tokens),
                        ("max_completion_tokens", max_completion_tokens)):
        _check_count(name, value)
    mask = completion_mask.to(_work_dtype(completion_mask))
    if variant == "grpo":
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        return mask / (lengths * num_sequences)
    if variant == "dapo":
        return mask / num_tokens
    return mask / (num_sequences * max_completion_tokens)


# ------------------------------------------------------------------------------------------ loss
def _check_loss_args(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                     ref_logp: torch.Tensor | None, eps_low: float, eps_high: float, kl_coef: float) -> None:
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high), ("kl_coef", kl_coef)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} is not a finite number")
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low={eps_low!r} must be in [0, 1) (the ratio is clipped below at 1 - eps_low; "
                         f"typical 0.2)")
    if eps_high < 0:
        raise ValueError(f"eps_high={eps_high!r} must be >= 0 (the ratio is clipped above at 1 + eps_high; "
                         f"typical 0.2, DAPO 0.28)")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r} must be >= 0 (0 disables the KL penalty)")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef!r} needs the reference model's log-probabilities; ref_logp is None "
                         f"(pass them, or set kl_coef to 0)")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T]; got shape {tuple(logp.shape)}")
    shaped = {"old_logp": old_logp, "weights": weights, **({"ref_logp": ref_logp} if ref_logp is not None else {})}
    for name, t in shaped.items():
        if t.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}; got {tuple(t.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [N] with N={logp.shape[0]} (one per sequence); got shape "
                         f"{tuple(advantages.shape)}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, *,
                eps_low: float, eps_high: float, kl_coef: float = 0.0,
                ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """The clipped-surrogate policy loss of a micro-batch, ``sum(weights * loss_t)``.

    Args:
        logp: ``[N, T]`` the policy's log-probability of each completion token (differentiable).
        old_logp: ``[N, T]`` the same under the policy that sampled the rollouts (detached here);
            ``logp.detach()`` when each rollout batch is trained on once.
        advantages: ``[N]``, one per sequence (:func:`group_advantages`, flattened).
        weights: ``[N, T]`` from :func:`token_weights`; 0 outside the completions.
        eps_low, eps_high: the clip range ``[1 - eps_low, 1 + eps_high]`` of the ratio;
            ``eps_low`` in ``[0, 1)``, ``eps_high >= 0``.
        kl_coef: weight of the k3 KL penalty to the reference model, >= 0.
        ref_logp: ``[N, T]`` the reference model's log-probabilities (detached here); required
            when ``kl_coef > 0``, and when given the KL is measured even at ``kl_coef = 0``.

    With ``rho = exp(logp - old_logp)`` and ``d = ref_logp - logp`` per token::

        loss_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_coef (exp(d) - d - 1)
        loss   = sum(weights * loss_t)

    Tokens of weight 0 contribute exactly 0 to the loss, its gradient and the metrics, whatever
    ``logp`` holds there (padding may hold anything finite or not).

    Returns the scalar loss (the work dtype: at least fp32) and detached metrics as plain *sums
    over the tokens of weight != 0 with their count*, so they add over micro-batches and
    data-parallel ranks and mean the same under every variant (:func:`token_means` divides):

    * ``tokens``: the number of tokens counted;
    * ``clipped``: tokens whose ratio was clipped where it stops the gradient: ``rho > 1 + eps_high``
      with ``A > 0``, or ``rho < 1 - eps_low`` with ``A < 0``; ``clipped_low``/``clipped_high``
      split it;
    * ``ratio``: the sum of ``rho``;
    * ``kl``: the sum of the k3 KL (only when ``ref_logp`` is given).
    """
    _check_loss_args(logp, old_logp, advantages, weights, ref_logp, eps_low, eps_high, kl_coef)
    dtype = _work_dtype(logp, old_logp, advantages, weights, *([ref_logp] if ref_logp is not None else []))
    lp, w = logp.to(dtype), weights.to(dtype)
    counted = w != 0
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    # padding may hold -inf or garbage: zero the exponents there, so no inf * 0 reaches the sum or
    # the backward (torch.where passes no gradient to the branch it does not take)
    log_ratio = torch.where(counted, lp - old_logp.detach().to(dtype), zero)
    ratio = torch.exp(log_ratio)
    a = advantages.detach().to(dtype)[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
    per_token = -surrogate
    kl = None
    if ref_logp is not None:
        d = torch.where(counted, ref_logp.detach().to(dtype) - lp, zero)
        kl = torch.exp(d) - d - 1
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    loss = (w * per_token).sum()

    with torch.no_grad():
        count = counted.to(dtype)
        low = (ratio < 1 - eps_low) & (a < 0) & counted
        high = (ratio > 1 + eps_high) & (a > 0) & counted
        metrics = {
            "tokens": count.sum(),
            "clipped": (low | high).to(dtype).sum(),
            "clipped_low": low.to(dtype).sum(),
            "clipped_high": high.to(dtype).sum(),
            "ratio": (ratio * count).sum(),
        }
        if kl is not None:
            metrics["kl"] = (kl * count).sum()
    return loss, {k: v.detach() for k, v in metrics.items()}


def token_means(sums: Metrics) -> Metrics:
    """Per-token means of :func:`policy_loss`'s metric sums (after adding them over micro-batches and
    ranks): ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high``, ``ratio_mean`` and
    ``kl_mean`` (when measured); 0 when no token was counted."""
    tokens = sums["tokens"].clamp(min=1)
    names = {"clipped": "clip_fraction", "clipped_low": "clip_fraction_low", "clipped_high": "clip_fraction_high",
             "ratio": "ratio_mean", "kl": "kl_mean"}
    return {mean: sums[total] / tokens for total, mean in names.items() if total in sums}


# --------------------------------------------------------------------------------------- entropy
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's next-token distribution, ``[N, T, V] -> [N, T]``.

    ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)``, in at least fp32 (an exploration
    metric: a collapsing entropy is GRPO's usual failure). ``-inf`` logits (masked tokens) add 0
    and no NaN to the value or its gradient. The logits must hold the whole vocabulary; under
    tensor parallelism (a vocabulary block per rank) this is not the entropy.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [N, T, V]; got shape {tuple(logits.shape)}")
    log_p = torch.log_softmax(logits.to(_work_dtype(logits)), dim=-1)
    # p log p is 0 at p = 0, but 0 * -inf is NaN: clamp log p to the dtype's lowest finite value
    finite_log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    return -(log_p.exp() * finite_log_p).sum(dim=-1)
