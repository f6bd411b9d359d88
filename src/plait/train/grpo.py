"""GRPO in the one training path: the rollout loader feeds the loop, the objective reports.

``train.objective: grpo`` changes only what a step trains on and what is measured:

* :class:`RolloutLoader` is the run's loader. Every ``grpo.epochs`` steps it draws the next
  ``P`` prompts of the global batch (a seeded shuffle of the training prompts, epoch after epoch),
  gives each data-parallel rank its ``P / dp`` of them, and samples ``grpo.group_size``
  completions of each with the current policy: the decoding engine on this rank's own stages
  (:class:`~plait.pipeline.stages_lm.StagesCausalLM`), every TP and PP rank of the replica taking
  part, no separate server. Each completion's sampling seed depends on the run seed, the rollout
  and the completion's position in the *global* batch, so a layout never changes what is drawn.
  The rewards are scored (:func:`plait.post_training.rewards.score_completions`; an error stops
  the run naming the function and the row, before the step, so nothing of it is checkpointed),
  the advantages computed per group (groups never split over ranks), the global counts summed
  over the data-parallel group, and, with ``epochs > 1``, the sampling policy's log-probabilities
  stored (a forward-only pass). The batch it returns is an ordinary ``[microbatches, micro_batch,
  seq_len]`` token batch whose loss the :class:`~plait.post_training.grpo_head.GRPOHead` computes.
* :class:`GRPOObjective` reads the head's token metrics and the rollouts' own (reward mean/std,
  accuracy, completion length, dropped groups, rollout tokens/s, the share of the interval spent
  generating) each logging interval, and evaluates by held-out exact match of greedy answers.

Rewards are scored on every TP/PP rank of a replica and the first rank's are used by all, so a
reward that is not deterministic cannot split one model's shards. A resume in the middle of a
rollout's epochs samples that rollout again from the resumed policy (and takes its old
log-probabilities from it), so such a run differs from an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm.primitives import GroupInfo
from plait.config.resolve import ResolvedRecipe
from plait.data.batch import TokenBatch
from plait.data.prompt_prepare import PromptDataset
from plait.heldout import answer_stop_ids, scoring_template
from plait.inference import Sampling, StopRules, generate_tokens
from plait.mesh import ParallelMesh
from plait.pipeline.runtime import PipelineRuntime
from plait.pipeline.stages_lm import StagesCausalLM
from plait.post_training.grpo_head import GRPOHead, GRPOSettings
from plait.post_training.rewards import Reward, exact_match, load_reward, score_completions
from plait.post_training.rollout import completion_seed, rollout_batch
from plait.train.plugins import Objective
from plait.train.preference import eval_mode
from plait.train.run_state import RunState


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout needs from the recipe (``grpo.*``, the batch layout and the run seed)."""

    group_size: int
    prompts_per_step: int  # global: every data-parallel rank's together
    max_new_tokens: int
    sampling: Sampling
    epochs: int
    variant: str
    reward: Reward
    reward_name: str
    microbatches: int
    micro_batch_size: int
    seq_len: int
    seed: int


@dataclass
class RolloutStats:
    """Host-side sums over the interval's rollouts on this rank (summed over data parallelism when read)."""

    completions: float = 0.0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    correct: float = 0.0
    completion_tokens: float = 0.0
    groups: float = 0.0
    groups_dropped: float = 0.0
    seconds: float = 0.0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.completions, self.reward_sum, self.reward_sq_sum, self.correct,
                             self.completion_tokens, self.groups, self.groups_dropped, self.seconds],
                            dtype=torch.float64)


def prompt_indices(rollout: int, count: int, total: int, seed: int) -> list[int]:
    """The training prompts of rollout ``rollout``: positions ``rollout * count ...`` of an endless
    sequence of seeded shuffles of ``range(total)`` (one shuffle per pass over the prompts)."""
    out, cache = [], {}
    for position in range(rollout * count, (rollout + 1) * count):
        epoch = position // total
        if epoch not in cache:
            cache[epoch] = torch.randperm(total, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
        out.append(cache[epoch][position % total])
    return out


class RolloutLoader:
    """The run's batches for GRPO (see the module doc); the loop's ``loader`` interface."""

    wait_seconds = 0.0  # rollouts are timed on their own (RolloutStats.seconds), not as data wait

    def __init__(self, stages: list[nn.Module], mesh: ParallelMesh, runtime: PipelineRuntime, head: GRPOHead,
                 prompts: PromptDataset, settings: RolloutSettings, *, start_step: int = 0,
                 precision: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext) -> None:
        self.stages, self.mesh, self.runtime, self.head = stages, mesh, runtime, head
        self.precision = precision
        self.prompts, self.settings = prompts, settings
        self.step = start_step
        self.batch: TokenBatch | None = None
        self.stats = RolloutStats()
        tokenizer = prompts.tokenizer()
        self.tokenizer = tokenizer
        self.stop = frozenset(answer_stop_ids(tokenizer, scoring_template(prompts.directory, tokenizer)))
        dp = mesh.info("dp")
        if settings.prompts_per_step % dp.size:
            raise ValueError(f"{settings.prompts_per_step} prompts per step do not split over dp={dp.size} ranks")
        self.local_prompts = settings.prompts_per_step // dp.size
        self.dp = dp

    def __iter__(self) -> RolloutLoader:
        return self

    def __next__(self) -> TokenBatch:
        s = self.settings
        if self.batch is None or self.step % s.epochs == 0:
            self.batch = self.rollout(self.step // s.epochs)
        self.step += 1
        return self.batch

    def close(self) -> None:
        """Nothing runs in the background."""

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t not in self.stop], skip_special_tokens=True)

    def sample(self, prompts: list[list[int]], seeds: list[int], sampling: Sampling, chunk: int) -> list[list[int]]:
        """Completions of ``prompts``, decoded ``chunk`` rows at a time (a micro-batch: the KV cache
        never holds more rows than training does); under the run's precision, every TP/PP rank of
        the replica taking part. Seeds are per row, so the chunking changes nothing drawn."""
        policy = StagesCausalLM(self.stages, self.mesh)
        out: list[list[int]] = []
        with self.precision():
            for start in range(0, len(prompts), chunk):
                done = generate_tokens(policy, prompts[start:start + chunk], self.settings.max_new_tokens,
                                       sampling=sampling, seeds=seeds[start:start + chunk],
                                       stop=StopRules(eos_ids=self.stop))
                out.extend(c.tokens for c in done)
        return out

    def agreed(self, rewards: list[float]) -> list[float]:
        """The rewards of the replica's first rank on every TP/PP rank of the replica: each rank scored
        the same completions, and a reward that is not deterministic must not give the shards of one
        model different advantages."""
        values = torch.tensor(rewards, dtype=torch.float64)
        for axis in ("tp", "pp"):
            group = self.mesh.info(axis)
            if group.size > 1:
                buf = values.to(self.runtime.device)
                dist.broadcast(buf, src=self.mesh.my_group_ranks(axis)[0], group=group.group)
                values = buf.cpu()
        return values.tolist()

    def rollout(self, index: int) -> TokenBatch:
        """Sample, score and lay out rollout ``index`` (collective over the replica's TP/PP ranks
        and, for the global counts, the data-parallel group)."""
        s, head = self.settings, self.head
        start = time.perf_counter()
        chosen = prompt_indices(index, s.prompts_per_step, len(self.prompts), s.seed)
        first = self.dp.rank * self.local_prompts
        mine = chosen[first:first + self.local_prompts]
        prompts = [self.prompts.ids(i) for i in mine]
        rows = [self.prompts.row(i) for i in mine]
        g = s.group_size
        seeds = [completion_seed(s.seed, index, first + p, g, m) for p in range(len(prompts)) for m in range(g)]
        completions = self.sample([p for p in prompts for _ in range(g)], seeds, s.sampling, s.micro_batch_size)
        texts = [self.decode(c) for c in completions]
        expanded = [row for row in rows for _ in range(g)]
        rewards = self.agreed(score_completions(s.reward, s.reward_name, texts, expanded))
        batch = rollout_batch(prompts, completions, rewards, group_size=g, variant=s.variant,
                              microbatches=s.microbatches, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len)
        counts = dp_sum(self.dp, self.runtime.device)(
            torch.tensor([batch.kept_sequences, batch.kept_tokens], dtype=torch.float64))
        head.start_rollout(batch.targets, batch.advantages, num_sequences=int(counts[0]), num_tokens=int(counts[1]))
        tokens = TokenBatch(input_ids=batch.input_ids, labels=batch.labels)
        if s.epochs > 1:  # the sampling policy's log-probabilities, for the ratio of the later epochs
            with eval_mode(self.stages), head.collecting("old"):
                self.runtime.execute(tokens.to(self.runtime.device), train=False)
        st = self.stats
        st.completions += len(completions)
        st.reward_sum += sum(rewards)
        st.reward_sq_sum += sum(r * r for r in rewards)
        st.correct += sum(exact_match(t, row) for t, row in zip(texts, expanded, strict=True))
        st.completion_tokens += sum(len(c) for c in completions)
        st.groups += len(prompts)
        st.groups_dropped += int((~batch.kept_groups).sum())
        st.seconds += time.perf_counter() - start
        return tokens


#: evaluation prompts decoded together
EVAL_CHUNK = 32


class GRPOObjective(Objective):
    """``grpo``: the head's token metrics, the rollouts' metrics, held-out exact match."""

    name = "grpo"

    def __init__(self, head: GRPOHead, loader: RolloutLoader, eval_prompts: PromptDataset, *, eval_rows: int,
                 pp: GroupInfo, dp: GroupInfo, world_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.head, self.loader, self.eval_prompts = head, loader, eval_prompts
        self.eval_rows, self.pp, self.dp = eval_rows, pp, dp
        self._interval_start = time.perf_counter()
        self._sum_dp = world_sum

    def start_run(self) -> None:
        self._interval_start = time.perf_counter()

    def interval_metrics(self, step: int) -> dict[str, float]:  # noqa: ARG002 - the plug-in signature
        out = self.head.read(self.pp, self.dp)
        stats, self.loader.stats = self.loader.stats, RolloutStats()
        local_seconds = stats.seconds
        sums = self._sum_dp(stats.as_tensor()).tolist()
        n, r, r2, correct, tokens, groups, dropped, _ = sums
        now = time.perf_counter()
        if n > 0:
            mean = r / n
            out.update({"reward/mean": mean, "reward/std": max(r2 / n - mean * mean, 0.0) ** 0.5,
                        "accuracy": correct / n, "completion_tokens": tokens / n,
                        "groups_dropped": dropped, "groups": groups,
                        "rollout_tokens_per_s": tokens / max(local_seconds, 1e-9),
                        "rollout_share": local_seconds / max(now - self._interval_start, 1e-9)})
        self._interval_start = now
        return out

    def evaluate(self) -> dict[str, float]:
        """Held-out exact match: greedy answers to the first ``grpo.eval_rows`` evaluation prompts,
        shared out over the data-parallel ranks (collective)."""
        began = time.perf_counter()
        loader = self.loader
        rows = min(self.eval_rows, len(self.eval_prompts))
        mine = list(range(self.dp.rank, rows, self.dp.size))
        counts = torch.zeros(2, dtype=torch.float64)
        if mine:
            completions = loader.sample([self.eval_prompts.ids(i) for i in mine], [0] * len(mine),
                                        Sampling(greedy=True), EVAL_CHUNK)
            counts[0] = sum(exact_match(loader.decode(c), self.eval_prompts.row(i))
                            for c, i in zip(completions, mine, strict=True))
            counts[1] = len(mine)
        counts = self._sum_dp(counts)
        self._interval_start += time.perf_counter() - began  # the evaluation counts in no interval's share
        return {"val_exact_match": float(counts[0] / max(float(counts[1]), 1.0))}

    def summary_lines(self, final: dict[str, Any]) -> list[str]:
        lines = []
        if "reward/mean" in final:
            lines.append(f"rollout reward {final['reward/mean']:.4f} (mean of the last interval), rollout accuracy "
                         f"{final.get('accuracy', 0.0):.1%}, completion length {final.get('completion_tokens', 0):.1f} "
                         f"tokens (the loss is ~0 by construction: advantages are centred)")
        if "val_exact_match" in final:
            rows = min(self.eval_rows, len(self.eval_prompts))
            lines.append(f"held-out exact match {final['val_exact_match']:.1%} (greedy, first {rows} evaluation "
                         f"prompts)")
        return lines


def grpo_head(resolved: ResolvedRecipe, mesh: ParallelMesh, vocab_size: int, device: torch.device) -> GRPOHead | None:
    """The GRPO loss head of a ``train.objective: grpo`` run (``None`` for the other objectives)."""
    r = resolved.recipe
    if r.train.objective != "grpo":
        return None
    g = r.grpo
    settings = GRPOSettings(variant=g.loss, eps_low=g.epsilon_low, eps_high=g.epsilon_high, kl_coef=g.kl_coef,
                            max_completion_tokens=g.max_new_tokens)
    return GRPOHead(settings, vocab_size=vocab_size, tp=mesh.info("tp"), microbatches=r.parallel.microbatches,
                    dp_size=mesh.info("dp").size, device=device)


def grpo_objective(resolved: ResolvedRecipe, state: RunState, head: GRPOHead, train_prompts: PromptDataset,
                   eval_prompts: PromptDataset) -> GRPOObjective:
    """The objective and its rollout loader, over the built run's stages and runtime (the reward
    was loaded and checked before launch; loading it here again gives every rank its own)."""
    r = resolved.recipe
    g = r.grpo
    settings = RolloutSettings(
        group_size=g.group_size, prompts_per_step=resolved.global_batch_size // g.group_size,
        max_new_tokens=g.max_new_tokens,
        sampling=Sampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p), epochs=g.epochs,
        variant=g.loss, reward=load_reward(g.reward, pattern=g.reward_pattern), reward_name=g.reward,
        microbatches=r.parallel.microbatches, micro_batch_size=r.data.micro_batch_size, seq_len=r.data.seq_len,
        seed=r.run.seed)
    loader = RolloutLoader(state.stages, state.mesh, state.runtime, head, train_prompts, settings,
                           start_step=state.start_step, precision=lambda: state.policy.compute_context(state.device))
    dp = state.mesh.info("dp")
    return GRPOObjective(head, loader, eval_prompts, eval_rows=g.eval_rows, pp=state.mesh.info("pp"), dp=dp,
                         world_sum=dp_sum(dp, state.device))


def dp_sum(dp: GroupInfo, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum a small CPU float64 tensor over the data-parallel group (on ``device`` for NCCL)."""

    def total(values: torch.Tensor) -> torch.Tensor:
        if dp.size == 1:
            return values
        buf = values.to(device)
        dist.all_reduce(buf, group=dp.group)
        return buf.cpu()

    return total


__all__ = ["GRPOObjective", "RolloutLoader", "RolloutSettings", "RolloutStats", "dp_sum", "grpo_head", "grpo_objective",
           "prompt_indices"]
