"""Preference objectives and distributed sequence log-probabilities (plait.post_training).

Losses and their gradients are checked against fp64 formulas written out here from the papers
(DPO: Rafailov et al. 2023, conservative DPO: Mitchell 2023, IPO: Azar et al. 2023, ORPO: Hong et
al. 2024, SimPO: Meng et al. 2024) on random inputs. Log-probabilities from vocabulary-sharded
logits (TP=2, gloo) are checked against ``log_softmax`` of the full logits, with their gradient,
and per-sample sums of a packed row against the same samples scored one per row.
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_distributed
from plait.comm.primitives import GroupInfo
from plait.post_training import (
    PreferenceSettings,
    PreferenceSettingsError,
    preference_loss,
    segment_logprob_sums,
    shift_labels,
    split_pairs,
    target_segment_ids,
    token_logprobs,
)

P = 16  # preference pairs
B, S, V = 2, 24, 37  # V not divisible by 2: the last vocabulary block is padded


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pairs(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random per-pair inputs: counts 1..40, summed log-probs of -0.2..-3 nats per token."""
    g = _gen(seed)
    nc = torch.randint(1, 41, (P,), generator=g)
    nr = torch.randint(1, 41, (P,), generator=g)

    def sums(n: torch.Tensor) -> torch.Tensor:
        return (-(0.2 + 2.8 * torch.rand(P, generator=g, dtype=torch.float64)) * n).to(dtype)

    return {"pc": sums(nc), "pr": sums(nr), "rc": sums(nc), "rr": sums(nr), "nc": nc, "nr": nr}


# ------------------------------------------------------------------ fp64 reference formulas (papers)
def _log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return -torch.log(1 + torch.exp(-x))


def ref_dpo(pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    h = beta * ((pc - rc) - (pr - rr))
    return (-(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)).mean()


def ref_ipo(pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
    return ((h - 1 / (2 * beta)) ** 2).mean()


def ref_orpo_or_term(pc, pr, nc, nr):
    p_c, p_r = torch.exp(pc / nc), torch.exp(pr / nr)
    odds_ratio = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    return (-_log_sigmoid(torch.log(odds_ratio))).mean()


def ref_orpo(pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    nll = -pc.sum() / nc.sum()
    return nll + beta * ref_orpo_or_term(pc, pr, nc, nr)


def ref_simpo(pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    h = beta * pc / nc - beta * pr / nr - gamma
    return (-(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)).mean()


REFERENCES = {"dpo": ref_dpo, "ipo": ref_ipo, "orpo": ref_orpo, "simpo": ref_simpo}
SETTINGS = {
    "dpo": PreferenceSettings(beta=0.1),
    "dpo_smoothed": PreferenceSettings(beta=0.3, label_smoothing=0.2),
    "ipo": PreferenceSettings(beta=0.5),
    "orpo": PreferenceSettings(beta=0.25),
    "simpo": PreferenceSettings(beta=2.0, gamma=0.8),
    "simpo_smoothed": PreferenceSettings(beta=2.5, gamma=1.0, label_smoothing=0.1),
}


def _objective(case: str) -> str:
    return case.split("_")[0]


def _run(case: str, x: dict[str, torch.Tensor], settings: PreferenceSettings):
    """Loss, metrics and the gradients w.r.t. the four log-prob inputs, from plait."""
    objective = _objective(case)
    leaves = {k: x[k].clone().requires_grad_() for k in ("pc", "pr", "rc", "rr")}
    uses_ref = objective in ("dpo", "ipo")
    loss, metrics = preference_loss(objective, leaves["pc"], leaves["pr"], leaves["rc"] if uses_ref else None,
                                    leaves["rr"] if uses_ref else None, x["nc"], x["nr"], settings)
    loss.backward()
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    return loss, metrics, grads


def _reference(case: str, x: dict[str, torch.Tensor], settings: PreferenceSettings):
    leaves = {k: x[k].double().clone().requires_grad_() for k in ("pc", "pr", "rc", "rr")}
    nc, nr = x["nc"].double(), x["nr"].double()
    loss = REFERENCES[_objective(case)](leaves["pc"], leaves["pr"], leaves["rc"], leaves["rr"], nc, nr,
                                        settings.beta, settings.label_smoothing, settings.gamma)
    sft = settings.sft_weight or 0.0
    if sft and _objective(case) != "orpo":
        loss = loss - sft * leaves["pc"].sum() / nc.sum()
    loss.backward()
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    return loss, grads


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("case", list(SETTINGS))
def test_loss_and_gradient_match_paper_formula(case, dtype, tol):
    x = _pairs(dtype, seed=len(case))
    loss, _, grads = _run(case, x, SETTINGS[case])
    ref_loss, ref_grads = _reference(case, x, SETTINGS[case])
    assert loss.dtype == dtype
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=tol, abs_tol=tol)
    for k in grads:
        scale = ref_grads[k].abs().max().item() + 1e-30
        err = (grads[k].double() - ref_grads[k]).abs().max().item()
        assert err <= tol * max(scale, 1.0), (case, k, err, scale)
    # the losses are not vacuous: the policy gets a gradient
    assert grads["pc"].abs().max() > 0 and grads["pr"].abs().max() > 0


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo"])
def test_sft_weight_adds_chosen_nll(objective):
    x = _pairs(torch.float64, seed=3)
    base = {"dpo": PreferenceSettings(beta=0.1), "ipo": PreferenceSettings(beta=0.5),
            "simpo": PreferenceSettings(beta=2.0, gamma=0.5)}[objective]
    with_sft = PreferenceSettings(beta=base.beta, gamma=base.gamma, sft_weight=0.7)
    loss, metrics, grads = _run(objective, x, with_sft)
    ref_loss, ref_grads = _reference(objective, x, with_sft)
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-12)
    torch.testing.assert_close(grads["pc"], ref_grads["pc"], rtol=1e-12, atol=1e-14)
    nll = -x["pc"].sum() / x["nc"].sum()
    torch.testing.assert_close(metrics["loss/nll"], nll)
    plain, _, _ = _run(objective, x, base)
    assert math.isclose(loss.item() - plain.item(), 0.7 * nll.item(), rel_tol=1e-10)


def test_orpo_sft_weight_and_near_zero_logprobs():
    x = _pairs(torch.float64, seed=5)
    loss0, _, _ = _run("orpo", x, PreferenceSettings(beta=0.25, sft_weight=0.0))
    ref = ref_orpo_or_term(x["pc"], x["pr"], x["nc"].double(), x["nr"].double())
    assert math.isclose(loss0.item(), 0.25 * ref.item(), rel_tol=1e-12)
    # a response the policy already predicts almost surely: log(1 - p) stays finite, gradient too
    x["pc"][0] = -1e-9 * x["nc"][0]
    loss, _, grads = _run("orpo", x, PreferenceSettings(beta=0.25))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())


def test_metrics_values():
    x = _pairs(torch.float64, seed=7)
    beta = 0.2
    _, m, _ = _run("dpo", x, PreferenceSettings(beta=beta))
    rc, rr = beta * (x["pc"] - x["rc"]), beta * (x["pr"] - x["rr"])
    expected = {"rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(), "rewards/margin": (rc - rr).mean(),
                "rewards/accuracy": (rc > rr).double().mean(), "logps/chosen": x["pc"].mean(),
                "logps/rejected": x["pr"].mean()}
    assert 0 < expected["rewards/accuracy"] < 1  # both outcomes occur: accuracy is not vacuous
    for k, v in expected.items():
        torch.testing.assert_close(m[k], v, rtol=1e-12, atol=1e-14, msg=k)
    for objective, settings in [("ipo", PreferenceSettings(beta=beta)), ("orpo", PreferenceSettings(beta=beta)),
                                ("simpo", PreferenceSettings(beta=beta, gamma=0.5))]:
        _, m, _ = _run(objective, x, settings)
        if objective == "ipo":
            rc = beta * (x["pc"] - x["rc"]) / x["nc"]
            rr = beta * (x["pr"] - x["rr"]) / x["nr"]
        else:
            rc, rr = beta * x["pc"] / x["nc"], beta * x["pr"] / x["nr"]
        torch.testing.assert_close(m["rewards/chosen"], rc.mean(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(m["rewards/accuracy"], (rc > rr).double().mean())
        assert all(not t.requires_grad and t.dim() == 0 for t in m.values()), objective


def test_settings_errors_name_field_and_value():
    with pytest.raises(PreferenceSettingsError) as e:
        PreferenceSettings(beta=0.0, label_smoothing=0.5, sft_weight=-1.0, gamma=-0.1)
    msg = str(e.value)
    for part in ("beta=0.0", "label_smoothing=0.5", "sft_weight=-1.0", "gamma=-0.1"):
        assert part in msg
    with pytest.raises(PreferenceSettingsError, match="beta=nan is not a finite number"):
        PreferenceSettings(beta=float("nan"))
    with pytest.raises(PreferenceSettingsError, match="beta=True is not a finite number"):
        PreferenceSettings(beta=True)
    x = _pairs(torch.float32)
    with pytest.raises(PreferenceSettingsError, match="label_smoothing=0.1 has no meaning for objective 'ipo'"):
        preference_loss("ipo", x["pc"], x["pr"], x["rc"], x["rr"], x["nc"], x["nr"],
                        PreferenceSettings(label_smoothing=0.1))
    with pytest.raises(PreferenceSettingsError, match="gamma=0.5 has no meaning for objective 'dpo'"):
        preference_loss("dpo", x["pc"], x["pr"], x["rc"], x["rr"], x["nc"], x["nr"], PreferenceSettings(gamma=0.5))
    with pytest.raises(PreferenceSettingsError, match="objective='kto' is not known"):
        preference_loss("kto", x["pc"], x["pr"], None, None, x["nc"], x["nr"], PreferenceSettings())
    with pytest.raises(ValueError, match="ref_chosen is None"):
        preference_loss("dpo", x["pc"], x["pr"], None, x["rr"], x["nc"], x["nr"], PreferenceSettings())
    with pytest.raises(ValueError, match="uses no reference model, but ref_chosen was given"):
        preference_loss("simpo", x["pc"], x["pr"], x["rc"], None, x["nc"], x["nr"], PreferenceSettings())
    with pytest.raises(ValueError, match="one value per pair"):
        preference_loss("orpo", x["pc"], x["pr"][:-1], None, None, x["nc"], x["nr"], PreferenceSettings())


# ------------------------------------------------------------------ log-probabilities
def _packed_batch(seed: int):
    """Two packed rows of length S: samples back to back (prompt masked), then padding.

    Returns labels, per-position sample ids and each sample's (row, start, end) span.
    """
    g = _gen(seed)
    labels = torch.full((B, S), -100, dtype=torch.long)
    sample_ids = torch.full((B, S), -1, dtype=torch.long)
    layout = [[(4, 7), (3, 5)], [(2, 6), (5, 3), (1, 2)]]  # (prompt, response) lengths per sample
    spans, k = [], 0
    for row, samples in enumerate(layout):
        pos = 0
        for prompt, response in samples:
            n = prompt + response
            labels[row, pos:pos + n] = torch.randint(0, V, (n,), generator=g)
            labels[row, pos:pos + prompt] = -100
            sample_ids[row, pos:pos + n] = k
            spans.append((row, pos, pos + n))
            pos, k = pos + n, k + 1
    return labels, sample_ids, spans


def _local_block(full: torch.Tensor, tp: GroupInfo) -> torch.Tensor:
    """This rank's vocabulary block of ``full [..., V]``, the last block padded with big logits."""
    per = -(-V // tp.size)
    pad = torch.full((*full.shape[:-1], per * tp.size - V), 9.0, dtype=full.dtype)
    return torch.cat([full, pad], dim=-1)[..., tp.rank * per:(tp.rank + 1) * per]


def _logprob_case(tp: GroupInfo) -> dict[str, float]:
    """token_logprobs (values and logit gradient) vs log_softmax of the full logits."""
    logits_full = (torch.randn(B, S, V, generator=_gen(1)) * 3).requires_grad_()
    labels, _, _ = _packed_batch(2)
    targets = shift_labels(labels)
    mask = targets != -100
    ref = torch.log_softmax(logits_full, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    g = torch.randn(B, S, generator=_gen(3))
    ref.backward(g)
    local = _local_block(logits_full.detach(), tp).clone().requires_grad_()
    lp = token_logprobs(local, labels, V, tp)
    lp.backward(g)
    per = local.shape[-1]
    real = min(per, V - tp.rank * per)
    grad_ref = logits_full.grad[..., tp.rank * per:tp.rank * per + real]
    return {"lp": (lp - ref).abs().max().item(),
            "ignored_exact_zero": lp[~mask].abs().max().item(),
            "dlogits": (local.grad[..., :real] - grad_ref).abs().max().item(),
            "pad_grad": local.grad[..., real:].abs().max().item() if real < per else 0.0,
            "nonvacuous": float(mask.sum().item() > 10 and grad_ref.abs().max().item() > 1e-3)}


def _segment_case(tp: GroupInfo) -> dict[str, float]:
    """Per-sample sums of a packed batch vs each sample scored alone in its own row."""
    logits_full = torch.randn(B, S, V, generator=_gen(4)) * 3
    local = _local_block(logits_full, tp).clone().requires_grad_()
    labels, sample_ids, spans = _packed_batch(5)
    seg = target_segment_ids(sample_ids, labels)
    sums, counts = segment_logprob_sums(token_logprobs(local, labels, V, tp), seg, len(spans))
    gs = torch.randn(len(spans), generator=_gen(6))
    (sums * gs).sum().backward()
    packed_grad = local.grad.clone()
    local.grad = None
    errs = {"sums": 0.0, "counts": 0.0}
    for k, (row, start, end) in enumerate(spans):
        lab = labels[row:row + 1, start:end]
        lp = token_logprobs(local[row:row + 1, start:end], lab, V, tp)
        (lp.sum() * gs[k]).backward()
        # relative: a sum of a dozen log-probs of ~ -5 each, added in a different order
        errs["sums"] = max(errs["sums"], (lp.sum() - sums[k]).abs().item() / max(1.0, abs(sums[k].item())))
        errs["counts"] = max(errs["counts"], abs((shift_labels(lab) != -100).sum().item() - counts[k].item()))
    errs["dlogits"] = (packed_grad - local.grad).abs().max().item()
    errs["nonvacuous"] = float(bool((counts > 0).all()) and len(spans) == 5)
    return errs


def _sequence_parallel_head_case(tp: GroupInfo) -> dict[str, float]:
    """Under SP the column-parallel head gathers the sequence: its logits are full-sequence, and the
    log-probs and hidden-state gradients (of this rank's sequence shard) match one process's."""
    from plait.tensor_parallel import ColumnParallelLinear
    from plait.tensor_parallel.linear import even_rows

    hidden = 8
    weight = torch.randn(V, hidden, generator=_gen(7))
    head = ColumnParallelLinear(hidden, V, tp, sequence_parallel=tp.size > 1,
                                rows=even_rows(V, tp, pad_to_multiple=True))
    with torch.no_grad():
        head.weight.copy_(head.weight_spec.shard(weight))
    x_full = torch.randn(B, S, hidden, generator=_gen(8)).requires_grad_()
    labels, _, _ = _packed_batch(9)
    targets = shift_labels(labels)
    ref = torch.log_softmax(x_full @ weight.T, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ref = ref * (targets != -100)
    ref.sum().backward()
    x = x_full.detach().chunk(tp.size, dim=1)[tp.rank].clone().requires_grad_()
    logits = head(x)
    lp = token_logprobs(logits, labels, V, tp)
    lp.sum().backward()
    return {"full_sequence": float(logits.shape[1] != S), "lp": (lp - ref).abs().max().item(),
            "dx": (x.grad - x_full.grad.chunk(tp.size, dim=1)[tp.rank]).abs().max().item()}


def _tp_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    from plait.mesh import ParallelMesh

    tp = ParallelMesh(world, rank, tp=world).info("tp")
    return {"logprobs": _logprob_case(tp), "segments": _segment_case(tp), "sp_head": _sequence_parallel_head_case(tp)}


def _assert_close(results: dict[str, dict[str, float]], tol: float) -> None:
    for case, errs in results.items():
        for name, err in errs.items():
            if name == "nonvacuous":
                assert err == 1.0, (case, "the check would pass vacuously")
            else:
                assert err <= tol, (case, name, err)


def test_token_logprobs_and_segments_single_process():
    tp = GroupInfo.single()
    _assert_close({"logprobs": _logprob_case(tp), "segments": _segment_case(tp),
                   "sp_head": _sequence_parallel_head_case(tp)}, 1e-6)


def test_token_logprobs_and_segments_tp2():
    for rank_results in run_distributed(_tp_worker, 2):
        _assert_close(rank_results, 1e-6)


def test_segment_conventions():
    labels = torch.tensor([[-100, 5, 6, -100, 7, 8, 9, -100]])
    sample_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    # target t is labels[t + 1]; scored only inside one sample and when not ignored
    assert target_segment_ids(sample_ids, labels).tolist() == [[0, 0, -1, 1, 1, 1, -1, -1]]
    token_lp = torch.arange(1.0, 9.0).unsqueeze(0)
    seg = torch.tensor([[0, 0, -1, 1, 1, 1, -1, -1]])
    sums, counts = segment_logprob_sums(token_lp, seg, 3)
    assert sums.tolist() == [3.0, 15.0, 0.0] and counts.tolist() == [2, 3, 0]
    chosen, rejected = split_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="same shape"):
        segment_logprob_sums(token_lp, seg[:, :-1], 3)
    with pytest.raises(ValueError, match="labels \\[b, s\\]"):
        token_logprobs(torch.zeros(1, 8, 4), labels[:, :-1], 4, GroupInfo.single())
