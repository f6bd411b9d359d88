"""GRPO's pure pieces against a plain-loop fp64 reference: advantages, token weights, the clipped
loss and its gradient, exact splitting over micro-batches and ranks, entropy, argument errors."""

from __future__ import annotations

import math

import pytest
import torch

from plait.post_training.grpo_loss import (
    VARIANTS,
    entropy_from_logits,
    group_advantages,
    policy_loss,
    token_means,
    token_weights,
)

P, G, T = 3, 4, 7
N = P * G
EPS_LOW, EPS_HIGH = 0.2, 0.28
#: group 1 has equal rewards: no signal (dapo drops it); the others mix right, wrong and partial
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.2, 0.9, 0.4]]


# ------------------------------------------------------------------------------ the reference
def ref_advantages(rewards: list[list[float]], variant: str, eps: float = 1e-4) -> tuple[list[float], list[bool]]:
    advantages, kept = [], []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))  # unbiased
        equal = max(group) == min(group)
        for r in group:
            a = 0.0 if equal else (r - mean) if variant == "dr_grpo" else (r - mean) / (std + eps)
            advantages.append(a)
        kept.append(not (equal and variant == "dapo"))
    return advantages, kept


def ref_loss_and_grad(logp, old, ref, adv, mask, variant, kl_coef, rows, max_tokens=T):
    """Loss and d loss / d logp over the sequences ``rows``, with plain Python floats."""
    lengths = {n: sum(mask[n]) for n in rows}
    num_tokens = sum(lengths.values())
    loss, grad = 0.0, [[0.0] * T for _ in range(N)]
    for n in rows:
        for t in range(T):
            if not mask[n][t]:
                continue
            w = {"grpo": 1 / (lengths[n] * len(rows)), "dapo": 1 / num_tokens,
                 "dr_grpo": 1 / (len(rows) * max_tokens)}[variant]
            ratio, a = math.exp(logp[n][t] - old[n][t]), adv[n]
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - EPS_LOW), 1 + EPS_HIGH) * a
            inside = 1 - EPS_LOW <= ratio <= 1 + EPS_HIGH
            d_surrogate = ratio * a if inside or unclipped < clipped else 0.0
            d = ref[n][t] - logp[n][t]
            loss += w * (-min(unclipped, clipped) + kl_coef * (math.exp(d) - d - 1))
            grad[n][t] = w * (-d_surrogate + kl_coef * (1 - math.exp(d)))
    return loss, grad


# -------------------------------------------------------------------------------- the rollouts
@pytest.fixture(scope="module")
def rollout():
    g = torch.Generator().manual_seed(0)
    lengths = [1, T, 3, 5, 2, 6, 4, T, 1, 3, 5, 2]
    starts = [0, 0, 2, 1, 0, 1, 3, 0, 4, 0, 2, 5]
    mask = torch.zeros(N, T, dtype=torch.bool)
    for n, (s, length) in enumerate(zip(starts, lengths, strict=True)):
        mask[n, s:s + length] = True
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.6  # ratios in ~[0.2, 5]
    ref = logp + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3
    old[~mask] = -math.inf  # padding may hold anything: it must not reach the loss or the gradient
    logp[~mask] = -math.inf
    return logp, old, ref, mask


def _lists(*tensors):
    return [t.tolist() for t in tensors]


def _loss(rollout, variant, kl_coef, rows=range(N), dtype=torch.float64):
    logp, old, ref, mask = rollout
    adv, kept = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), variant)
    seq_kept = kept.repeat_interleave(G)
    mask = mask & seq_kept[:, None]  # dropped groups: their completions count nowhere
    counted = [n for n in rows if seq_kept[n]]
    weights = token_weights(mask.to(dtype), variant, num_sequences=len(counted), num_tokens=int(mask.sum()),
                            max_completion_tokens=T)  # an fp64 mask gives fp64 weights
    x = logp.to(dtype).clone().requires_grad_(True)  # a fresh leaf: the fixture is shared
    loss, metrics = policy_loss(x, old.to(dtype), adv.flatten().to(dtype), weights.to(dtype), eps_low=EPS_LOW,
                                eps_high=EPS_HIGH, kl_coef=kl_coef, ref_logp=ref.to(dtype))
    loss.backward()
    return loss, x.grad, metrics, adv, counted


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_gradient_match_the_loop_reference(rollout, variant, kl_coef):
    loss, grad, metrics, adv, counted = _loss(rollout, variant, kl_coef)
    ref_adv, ref_kept = ref_advantages(REWARDS, variant)
    assert adv.flatten().tolist() == pytest.approx(ref_adv, rel=1e-12, abs=1e-12)
    assert counted == [n for n in range(N) if ref_kept[n // G]]
    logp, old, ref, mask = _lists(*rollout)
    want_loss, want_grad = ref_loss_and_grad(logp, old, ref, ref_adv, mask, variant, kl_coef, counted)
    assert loss.dtype == torch.float64 and loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    # the rollouts are not vacuous: both clip sides bite, and a ratio outside the range still
    # passes its gradient where the clip does not apply (A > 0 with a low ratio, A < 0 with a high one)
    assert metrics["clipped_low"] > 0 and metrics["clipped_high"] > 0
    ratio = (rollout[0] - rollout[1]).exp()
    a = adv.flatten()[:, None].expand(N, T)
    outside_but_free = rollout[3] & (((ratio < 1 - EPS_LOW) & (a > 0)) | ((ratio > 1 + EPS_HIGH) & (a < 0)))
    assert outside_but_free.any()


def test_metrics_are_token_sums_with_their_count(rollout):
    _, _, metrics, adv, counted = _loss(rollout, "grpo", 0.05)
    logp, old, ref, mask = _lists(*rollout)
    ref_adv, _ = ref_advantages(REWARDS, "grpo")
    tokens = clipped = 0
    ratio_sum = kl_sum = 0.0
    for n in counted:
        for t in range(T):
            if mask[n][t]:
                r, d = math.exp(logp[n][t] - old[n][t]), ref[n][t] - logp[n][t]
                tokens += 1
                clipped += (r > 1 + EPS_HIGH and ref_adv[n] > 0) or (r < 1 - EPS_LOW and ref_adv[n] < 0)
                ratio_sum += r
                kl_sum += math.exp(d) - d - 1
    assert metrics["tokens"].item() == tokens and metrics["clipped"].item() == clipped
    assert metrics["clipped"] == metrics["clipped_low"] + metrics["clipped_high"]
    assert metrics["ratio"].item() == pytest.approx(ratio_sum) and metrics["kl"].item() == pytest.approx(kl_sum)
    means = token_means(metrics)
    assert means["clip_fraction"].item() == pytest.approx(clipped / tokens)
    assert means["kl_mean"].item() == pytest.approx(kl_sum / tokens)
    assert means["ratio_mean"].item() == pytest.approx(ratio_sum / tokens)
    assert not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_micro_batches_and_ranks_with_global_counts_add_up_to_the_whole(rollout, variant):
    """Advantages of whole groups first; then two ranks of two micro-batches each, weights from
    the global counts: the summed losses, gradients and metric sums are the whole batch's."""
    logp, old, ref, mask = rollout
    whole_loss, whole_grad, whole_metrics, adv, _ = _loss(rollout, variant, 0.05)
    _, kept = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), variant)
    mask = mask & kept.repeat_interleave(G)[:, None]
    counts = {"num_sequences": int(kept.sum()) * G, "num_tokens": int(mask.sum()), "max_completion_tokens": T}
    x = logp.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    sums = dict.fromkeys(whole_metrics, 0.0)
    for rank_rows in ((slice(0, 3), slice(3, 7)), (slice(7, 10), slice(10, N))):
        for rows in rank_rows:
            weights = token_weights(mask[rows].double(), variant, **counts)
            loss, metrics = policy_loss(x[rows], old[rows], adv.flatten()[rows], weights, eps_low=EPS_LOW,
                                        eps_high=EPS_HIGH, kl_coef=0.05, ref_logp=ref[rows])
            loss.backward()  # gradient accumulation; summing over ranks is the all-reduce with SUM
            total = total + loss.detach()
            sums = {k: sums[k] + metrics[k] for k in sums}
    torch.testing.assert_close(total, whole_loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, whole_grad, rtol=1e-12, atol=1e-14)
    for k in sums:
        torch.testing.assert_close(sums[k], whole_metrics[k], rtol=1e-12, atol=1e-12)


def test_dapo_weights_sum_to_one_over_the_kept_tokens_and_grpo_per_sequence(rollout):
    mask = rollout[3]
    dapo = token_weights(mask, "dapo", num_sequences=N, num_tokens=int(mask.sum()), max_completion_tokens=T)
    grpo = token_weights(mask, "grpo", num_sequences=N, num_tokens=int(mask.sum()), max_completion_tokens=T)
    dr = token_weights(mask, "dr_grpo", num_sequences=N, num_tokens=int(mask.sum()), max_completion_tokens=T)
    assert dapo.dtype == torch.float32 and dapo.sum().item() == pytest.approx(1.0)
    assert grpo.sum(dim=1).tolist() == pytest.approx([1 / N] * N)  # every sequence weighs the same
    assert dr[mask].tolist() == pytest.approx([1 / (N * T)] * int(mask.sum()))  # every token weighs the same
    assert (dapo[~mask] == 0).all() and (grpo[~mask] == 0).all() and (dr[~mask] == 0).all()
    empty = torch.zeros(1, T, dtype=torch.bool)
    assert (token_weights(empty, "grpo", num_sequences=1, num_tokens=1, max_completion_tokens=T) == 0).all()


# ------------------------------------------------------------------------------------ advantages
def test_dapo_drops_equal_reward_groups_and_the_others_keep_them():
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    for variant in VARIANTS:
        adv, kept = group_advantages(rewards, variant)
        assert kept.dtype == torch.bool and kept.shape == (4,)
        assert kept.tolist() == ([True, False, False, True] if variant == "dapo" else [True] * 4)
        assert (adv[1:3] == 0).all()  # exactly 0, though the mean of 0.1s is rounded
        assert adv[0].sum().abs() < 1e-6 and (adv[0] > 0).tolist() == [True, False, True]


def test_dr_grpo_does_not_divide_by_the_std_and_grpo_does():
    rewards = torch.tensor([[0.0, 1.0, 3.0, 4.0]], dtype=torch.float64)
    dr, _ = group_advantages(rewards, "dr_grpo")
    assert dr.tolist() == [[-2.0, -1.0, 1.0, 2.0]]
    grpo, _ = group_advantages(rewards, "grpo", eps=1e-4)
    std = math.sqrt((4 + 1 + 1 + 4) / 3)  # unbiased: divided by G - 1
    assert grpo.tolist()[0] == pytest.approx([v / (std + 1e-4) for v in (-2.0, -1.0, 1.0, 2.0)], rel=1e-12)
    scaled_grpo, _ = group_advantages(rewards * 10, "grpo")
    scaled_dr, _ = group_advantages(rewards * 10, "dr_grpo")
    torch.testing.assert_close(scaled_grpo, grpo, rtol=1e-4, atol=0)  # scale-free (up to eps)
    torch.testing.assert_close(scaled_dr, dr * 10)


def test_dtypes_at_least_fp32_and_fp64_stays(rollout):
    logp, old, ref, mask = rollout
    bf16_adv, _ = group_advantages(torch.tensor(REWARDS, dtype=torch.bfloat16), "grpo")
    assert bf16_adv.dtype == torch.float32
    weights = token_weights(mask, "dapo", num_sequences=N, num_tokens=int(mask.sum()), max_completion_tokens=T)
    x = logp.to(torch.bfloat16).requires_grad_(True)
    loss, metrics = policy_loss(x, old.to(torch.bfloat16), torch.ones(N, dtype=torch.bfloat16), weights,
                                eps_low=0.2, eps_high=0.2)
    loss.backward()
    assert loss.dtype == torch.float32 and metrics["tokens"].dtype == torch.float32 and "kl" not in metrics
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    assert _loss(rollout, "grpo", 0.0, dtype=torch.float64)[0].dtype == torch.float64


# --------------------------------------------------------------------------------------- entropy
def test_entropy_matches_the_definition_and_tolerates_masked_logits():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = entropy_from_logits(logits)
    for n in range(2):
        for t in range(3):
            z = [math.exp(v) for v in logits[n, t].tolist()]
            p = [v / sum(z) for v in z]
            assert got[n, t].item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-12)
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32
    masked = logits.clone()
    masked[..., 3:] = -math.inf
    masked.requires_grad_(True)
    h = entropy_from_logits(masked)
    torch.testing.assert_close(h, entropy_from_logits(logits[..., :3]).detach())
    h.sum().backward()
    assert torch.isfinite(masked.grad).all() and (masked.grad[..., 3:] == 0).all()
    uniform = entropy_from_logits(torch.zeros(1, 1, 8))
    assert uniform.item() == pytest.approx(math.log(8))


# --------------------------------------------------------------------------------- argument errors
def _call(**overrides):
    args = {"logp": torch.zeros(2, 3), "old_logp": torch.zeros(2, 3), "advantages": torch.zeros(2),
            "weights": torch.zeros(2, 3), "eps_low": 0.2, "eps_high": 0.2, "kl_coef": 0.0, "ref_logp": None}
    args.update(overrides)
    return policy_loss(args.pop("logp"), args.pop("old_logp"), args.pop("advantages"), args.pop("weights"), **args)


@pytest.mark.parametrize("overrides, named", [
    ({"eps_low": 1.0}, "eps_low"), ({"eps_low": -0.1}, "eps_low"), ({"eps_low": math.nan}, "eps_low"),
    ({"eps_high": -0.1}, "eps_high"), ({"kl_coef": -1.0}, "kl_coef"), ({"kl_coef": 0.1}, "ref_logp"),
    ({"old_logp": torch.zeros(2, 4)}, "old_logp"), ({"weights": torch.zeros(3, 3)}, "weights"),
    ({"advantages": torch.zeros(2, 3)}, "advantages"), ({"logp": torch.zeros(6)}, "logp"),
    ({"ref_logp": torch.zeros(2, 2)}, "ref_logp"),
])
def test_policy_loss_errors_name_the_argument(overrides, named):
    with pytest.raises(ValueError, match=named):
        _call(**overrides)


def test_other_errors_name_the_argument():
    mask = torch.ones(2, 3, dtype=torch.bool)
    counts = {"num_sequences": 2, "num_tokens": 6, "max_completion_tokens": 3}
    with pytest.raises(ValueError, match="variant='ppo'"):
        token_weights(mask, "ppo", **counts)
    for name, bad in (("num_sequences", 0), ("num_tokens", True), ("max_completion_tokens", 2.5)):
        with pytest.raises(ValueError, match=name):
            token_weights(mask, "dapo", **{**counts, name: bad})
    with pytest.raises(ValueError, match="completion_mask"):
        token_weights(torch.ones(6, dtype=torch.bool), "dapo", **counts)
    with pytest.raises(ValueError, match="variant"):
        group_advantages(torch.zeros(2, 4), "GRPO")
    with pytest.raises(ValueError, match=r"rewards .*G >= 2"):
        group_advantages(torch.zeros(2, 1), "grpo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, math.nan]]), "dr_grpo")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 4), "grpo", eps=0.0)
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.zeros(2, 5))
