"""Preference-training losses from sequence log-probabilities: DPO, IPO, ORPO and SimPO.

Inputs are one value per preference pair (``[P]`` tensors): the policy's and, for DPO and IPO,
the frozen reference model's summed log-probabilities of the chosen and rejected responses,
and the number of response tokens in each (from
:func:`plait.post_training.logprobs.segment_logprob_sums`). The formulas, with the papers they
come from, are in ``docs/preference.md``; each function below states its own.

Everything is computed in at least fp32 (fp64 inputs stay fp64). Losses are means over the pairs
of the micro-batch; metrics are detached device tensors (no host synchronisation), also means
over the pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
import torch.nn.functional as F

Objective = Literal["dpo", "ipo", "orpo", "simpo"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
#: objectives whose implicit reward is measured against a frozen reference model
REFERENCE_OBJECTIVES: tuple[str, ...] = ("dpo", "ipo")
#: objectives with a sigmoid (logistic) loss, where label smoothing has a meaning
_SMOOTHED: tuple[str, ...] = ("dpo", "simpo")

Metrics = dict[str, torch.Tensor]


class PreferenceSettingsError(ValueError):
    """Preference settings that are out of range or do not apply to the chosen objective."""


@dataclass(frozen=True, kw_only=True)
class PreferenceSettings:
    """The knobs of the preference objectives.

    Attributes:
        beta: DPO/IPO: the KL strength (IPO: ``tau``, the target margin is ``1 / (2 beta)``);
            ORPO: ``lambda``, the weight of the odds-ratio term; SimPO: the reward scale. > 0.
        label_smoothing: DPO (conservative DPO) and SimPO: the assumed probability that a
            preference label is flipped, in ``[0, 0.5)``. Must be 0 for IPO and ORPO.
        sft_weight: weight of the chosen responses' mean token NLL added to the loss. ``None``:
            the objective's own default (1.0 for ORPO, whose loss includes the SFT term; 0.0
            otherwise). >= 0.
        gamma: SimPO's target reward margin, >= 0. Must be 0 for the other objectives.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float | None = None
    gamma: float = 0.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise PreferenceSettingsError("invalid preference settings:\n  " + "\n  ".join(problems))

    def problems(self) -> list[str]:
        """Every out-of-range field, one line each (field, value, the valid range)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "sft_weight":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                out.append(f"{f.name}={value!r} is not a finite number; give a float")
        if out:
            return out
        if self.beta <= 0:
            out.append(f"beta={self.beta!r} must be > 0 (typical: 0.1 for DPO/ORPO, 2.0 for SimPO)")
        if not 0 <= self.label_smoothing < 0.5:
            out.append(f"label_smoothing={self.label_smoothing!r} must be in [0, 0.5) (0 disables it)")
        if self.sft_weight is not None and self.sft_weight < 0:
            out.append(f"sft_weight={self.sft_weight!r} must be >= 0 (0 disables the SFT term)")
        if self.gamma < 0:
            out.append(f"gamma={self.gamma!r} must be >= 0 (SimPO's target reward margin)")
        return out

    def check_for(self, objective: str) -> None:
        """Refuse an unknown objective, or a knob set that the objective would silently ignore."""
        if objective not in OBJECTIVES:
            raise PreferenceSettingsError(f"objective={objective!r} is not known; choose one of {OBJECTIVES}")
        problems = []
        if self.label_smoothing and objective not in _SMOOTHED:
            problems.append(f"label_smoothing={self.label_smoothing!r} has no meaning for objective "
                            f"{objective!r}; set it to 0 (it applies to {_SMOOTHED})")
        if self.gamma and objective != "simpo":
            problems.append(f"gamma={self.gamma!r} has no meaning for objective {objective!r}; set it to 0 "
                            f"(it is SimPO's target margin)")
        if problems:
            raise PreferenceSettingsError("invalid preference settings:\n  " + "\n  ".join(problems))

    def sft_weight_for(self, objective: str) -> float:
        if self.sft_weight is not None:
            return self.sft_weight
        return 1.0 if objective == "orpo" else 0.0


# ---------------------------------------------------------------------------------------- pieces
def _work(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: bf16 log-prob sums would lose the small reward differences."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _mean_logprobs(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-token average; a response with no token counts as one (its sum is then 0)."""
    return _work(sums) / counts.to(_work(sums).dtype).clamp(min=1)


def _sigmoid_loss(h: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - eps) log sigmoid(h) - eps log sigmoid(-h)``, per pair."""
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler, 2012).

    Each branch sees its input clamped to its own range, so the branch ``where`` discards
    cannot put an infinite gradient into the result.
    """
    cut = -math.log(2.0)
    near_zero = torch.log(-torch.expm1(x.clamp(min=cut)))
    far = torch.log1p(-torch.exp(x.clamp(max=cut)))
    return torch.where(x > cut, near_zero, far)


def _chosen_nll(policy_chosen: torch.Tensor, chosen_counts: torch.Tensor) -> torch.Tensor:
    """The SFT loss on the chosen responses: mean NLL over all their tokens in the micro-batch."""
    total = chosen_counts.to(_work(policy_chosen).dtype).sum().clamp(min=1)
    return -_work(policy_chosen).sum() / total


def _reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> Metrics:
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/margin": (c - r).mean(),
        "rewards/accuracy": (c > r).to(c.dtype).mean(),
        "logps/chosen": _work(policy_chosen).detach().mean(),
        "logps/rejected": _work(policy_rejected).detach().mean(),
    }


# ------------------------------------------------------------------------------------ objectives
def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """DPO (Rafailov et al., 2023), conservative DPO when ``label_smoothing > 0``.

    ``h = beta ((pi_c - ref_c) - (pi_r - ref_r))`` on summed log-probabilities;
    loss ``= mean(-(1 - eps) log sigmoid(h) - eps log sigmoid(-h))``.
    Rewards: ``beta (pi - ref)``.
    """
    chosen_rewards = beta * (_work(policy_chosen) - _work(ref_chosen))
    rejected_rewards = beta * (_work(policy_rejected) - _work(ref_rejected))
    loss = _sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing).mean()
    return loss, _reward_metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected)


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, chosen_counts: torch.Tensor, rejected_counts: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, Metrics]:
    """IPO (Azar et al., 2023) on length-normalised log-probabilities.

    With per-token averages ``a = sum / count``: ``h = (a_pi_c - a_ref_c) - (a_pi_r - a_ref_r)``;
    loss ``= mean((h - 1 / (2 beta))^2)``. The paper writes ``h`` with whole-sequence
    log-probabilities; averaging per token (as trl does) keeps the target margin ``1 / (2 beta)``
    on the same scale for short and long responses. Rewards: ``beta (a_pi - a_ref)``.
    """
    chosen_ratio = _mean_logprobs(policy_chosen, chosen_counts) - _mean_logprobs(ref_chosen, chosen_counts)
    rejected_ratio = (_mean_logprobs(policy_rejected, rejected_counts)
                      - _mean_logprobs(ref_rejected, rejected_counts))
    loss = ((chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2).mean()
    return loss, _reward_metrics(beta * chosen_ratio, beta * rejected_ratio, policy_chosen, policy_rejected)


def orpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, chosen_counts: torch.Tensor,
              rejected_counts: torch.Tensor, beta: float, sft_weight: float = 1.0) -> tuple[torch.Tensor, Metrics]:
    """ORPO (Hong et al., 2024): SFT on the chosen responses plus an odds-ratio penalty.

    With per-token averages ``a`` and ``log odds(y) = a - log(1 - exp(a))``:
    ``L_OR = mean(-log sigmoid(log odds(y_c) - log odds(y_r)))``;
    loss ``= sft_weight * NLL_chosen + beta * L_OR`` (the paper's ``lambda`` is ``beta``;
    ``NLL_chosen`` is the mean token NLL of the chosen responses). No reference model.
    Rewards: ``beta a``.
    """
    chosen_avg = _mean_logprobs(policy_chosen, chosen_counts)
    rejected_avg = _mean_logprobs(policy_rejected, rejected_counts)
    log_odds = (chosen_avg - _log1mexp(chosen_avg)) - (rejected_avg - _log1mexp(rejected_avg))
    odds_ratio_loss = -F.logsigmoid(log_odds).mean()
    nll = _chosen_nll(policy_chosen, chosen_counts)
    loss = sft_weight * nll + beta * odds_ratio_loss
    metrics = _reward_metrics(beta * chosen_avg, beta * rejected_avg, policy_chosen, policy_rejected)
    metrics["orpo/log_odds_ratio"] = log_odds.detach().mean()
    metrics["orpo/odds_ratio_loss"] = odds_ratio_loss.detach()
    metrics["loss/nll"] = nll.detach()
    return loss, metrics


def simpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, chosen_counts: torch.Tensor,
               rejected_counts: torch.Tensor, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """SimPO (Meng et al., 2024): length-averaged log-probability as the reward, no reference.

    ``h = beta (a_c - a_r) - gamma``; loss ``= mean(-(1 - eps) log sigmoid(h) - eps log sigmoid(-h))``.
    Rewards: ``beta a``.
    """
    chosen_rewards = beta * _mean_logprobs(policy_chosen, chosen_counts)
    rejected_rewards = beta * _mean_logprobs(policy_rejected, rejected_counts)
    loss = _sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing).mean()
    return loss, _reward_metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected)


# ------------------------------------------------------------------------------------ dispatcher
def _check_inputs(objective: str, per_pair: dict[str, torch.Tensor],
                  references: dict[str, torch.Tensor | None]) -> None:
    """Shapes and the presence of reference log-probabilities (metadata only, no synchronisation)."""
    needs_ref = objective in REFERENCE_OBJECTIVES
    for name, ref in references.items():
        if needs_ref and ref is None:
            raise ValueError(f"objective {objective!r} needs the reference model's log-probabilities; "
                             f"{name} is None")
        if not needs_ref and ref is not None:
            raise ValueError(f"objective {objective!r} uses no reference model, but {name} was given; pass "
                             f"None (and skip the reference forward pass)")
        if ref is not None:
            per_pair = {**per_pair, name: ref}
    shape = per_pair["policy_chosen"].shape
    shapes = {k: tuple(v.shape) for k, v in per_pair.items()}
    if any(v.dim() != 1 or v.shape != shape for v in per_pair.values()):
        raise ValueError(f"preference inputs must all be 1-D with one value per pair; got shapes {shapes}")


def preference_loss(objective: str, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
                    chosen_counts: torch.Tensor, rejected_counts: torch.Tensor,
                    settings: PreferenceSettings) -> tuple[torch.Tensor, Metrics]:
    """The loss of ``objective`` (plus ``settings``' SFT term) and its metrics.

    All inputs ``[P]``, one value per pair: summed response log-probabilities (policy, and the
    reference's for DPO/IPO, ``None`` otherwise) and response token counts. Returns the scalar
    loss (mean over pairs) and detached metrics: ``rewards/{chosen,rejected,margin,accuracy}``,
    ``logps/{chosen,rejected}`` (policy sums, mean over pairs) and ``loss/nll`` when an SFT term
    is added.
    """
    settings.check_for(objective)
    _check_inputs(objective, {"policy_chosen": policy_chosen, "policy_rejected": policy_rejected,
                              "chosen_counts": chosen_counts, "rejected_counts": rejected_counts},
                  {"ref_chosen": ref_chosen, "ref_rejected": ref_rejected})
    sft_weight = settings.sft_weight_for(objective)
    if objective == "orpo":
        return orpo_loss(policy_chosen, policy_rejected, chosen_counts, rejected_counts, settings.beta, sft_weight)
    if objective == "simpo":
        loss, metrics = simpo_loss(policy_chosen, policy_rejected, chosen_counts, rejected_counts, settings.beta,
                                   settings.gamma, settings.label_smoothing)
    else:
        assert ref_chosen is not None and ref_rejected is not None  # _check_inputs refused None
        if objective == "dpo":
            loss, metrics = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, settings.beta,
                                     settings.label_smoothing)
        else:
            loss, metrics = ipo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_counts,
                                     rejected_counts, settings.beta)
    if sft_weight > 0:
        nll = _chosen_nll(policy_chosen, chosen_counts)
        loss = loss + sft_weight * nll
        metrics["loss/nll"] = nll.detach()
    return loss, metrics
