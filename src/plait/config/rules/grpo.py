"""The ``grpo`` section: set only with ``train.objective: grpo``, and what GRPO needs of the rest of
the recipe: whole groups in a micro-batch, whole sequences on a rank, room for each completion,
a reward that loads, a KL reference that can be built and held-out prompts that exist.

(``data.format: prompts`` with ``train.objective: grpo`` and the tokenizer file are checked with
the other formats: :func:`plait.config.rules.data.check_fine_tuning`.)
"""

from __future__ import annotations

from plait.config.problems import divisors
from plait.config.rules.checker import Checker
from plait.config.schema import DataSection, TrainSection
from plait.data.dataset_files import check_row_source
from plait.data.errors import DataError
from plait.post_training.rewards import load_reward


def check_grpo(c: Checker) -> None:
    """The ``grpo`` section (see the module doc); every problem names its field."""
    if not c.ok("train.objective"):
        return
    if c.r.train.objective != "grpo":
        _refuse_set_fields(c)
        return
    _check_groups(c)
    _check_sequences(c)
    _check_reward(c)
    _check_reference(c)
    _check_eval_source(c)
    _check_unused(c)


def _check_unused(c: Checker) -> None:
    """Keys of other objectives that GRPO would silently ignore: its evaluation decodes
    ``grpo.eval_rows`` prompts (not ``train.eval_batches`` batches) and its batches are sampled by
    the policy at each step (nothing is prefetched)."""
    t, d = c.r.train, c.r.data
    if c.ok("train.eval_batches") and t.eval_batches != TrainSection().eval_batches:
        c.add("train.eval_batches", t.eval_batches, "has no effect with train.objective grpo (its evaluation "
                                                    "scores the first grpo.eval_rows evaluation prompts); set "
                                                    "grpo.eval_rows instead")
    if c.ok("data.prefetch") and d.prefetch != DataSection().prefetch:
        c.add("data.prefetch", d.prefetch, "has no effect with train.objective grpo (each step's batch is sampled "
                                           "from the policy of that step, so nothing can be built ahead); remove it")


def _refuse_set_fields(c: Checker) -> None:
    g, objective = c.r.grpo, c.r.train.objective
    defaults = type(g)()  # a written recipe holds every field: only a changed value is a mistake
    for name in sorted(n for n in g.model_fields_set if getattr(g, n) != getattr(defaults, n)):
        if c.ok(f"grpo.{name}"):
            c.add(f"grpo.{name}", getattr(g, name), f"applies to train.objective grpo only; remove it "
                                                    f"(train.objective is {objective!r})")


def _check_groups(c: Checker) -> None:
    """A group (the completions of one prompt) lies in one micro-batch: its advantages need every
    reward of the group, and a micro-batch never spans two ranks."""
    g, d = c.r.grpo, c.r.data
    if not c.ok("grpo.group_size", "data.micro_batch_size") or d.micro_batch_size % g.group_size == 0:
        return
    mbs, size = d.micro_batch_size, g.group_size
    smaller = [n for n in divisors(mbs) if n >= 2]
    other = f" or grpo.group_size to one of {smaller}" if smaller else ""
    c.add("grpo.group_size", size, f"must divide data.micro_batch_size={mbs}: each micro-batch holds whole groups "
                                   f"(a prompt's completions are never split over micro-batches or data-parallel "
                                   f"ranks); set data.micro_batch_size to a multiple of {size} "
                                   f"(e.g. {size * -(-mbs // size)}){other}")


def _check_sequences(c: Checker) -> None:
    """A prompt and its completion are one sequence, decoded whole on one rank."""
    g, d, p = c.r.grpo, c.r.data, c.r.parallel
    if c.ok("parallel.cp") and p.cp > 1:
        c.add("parallel.cp", p.cp, "must be 1 with train.objective grpo: the rollouts are decoded whole, each "
                                   "sequence on one rank; set parallel.cp: 1")
    if c.ok("parallel.ep") and p.ep > 1:
        c.add("parallel.ep", p.ep, "must be 1 with train.objective grpo: each data-parallel rank decodes its own "
                                   "prompts and stops when they end, while expert parallelism's all-to-all needs "
                                   "every rank of the group in every decoding step; set parallel.ep: 1")
    if c.ok("grpo.max_new_tokens", "data.seq_len") and g.max_new_tokens >= d.seq_len:
        c.add("grpo.max_new_tokens", g.max_new_tokens, f"must be less than data.seq_len={d.seq_len} (a prompt and "
                                                       f"its completion share one sequence); lower it or raise "
                                                       f"data.seq_len")


def _reward_problem(spec: str, pattern: str | None) -> str | None:
    """Why the reward cannot be used (its loader's one line), else None."""
    try:
        load_reward(spec, pattern=pattern)
    except (ValueError, OSError) as e:  # RewardError; or a path the file system refuses outright
        text = " ".join(str(e).split())
        prefix = f"reward {spec!r}: "
        return text[len(prefix):] if text.startswith(prefix) else text
    return None


def _check_reward(c: Checker) -> None:
    """The reward loads now, as training would load it (a user's file is imported here, before
    launch, so that a typo fails in seconds rather than after start-up and the first rollout)."""
    g = c.r.grpo
    if not c.ok("grpo.reward", "grpo.reward_pattern"):
        return
    if g.reward_pattern is not None and g.reward != "regex":
        c.add("grpo.reward_pattern", g.reward_pattern, f"applies only to reward regex (grpo.reward is "
                                                       f"{g.reward!r}); remove it, or set grpo.reward: regex")
        return
    if g.reward == "regex":
        problem = _reward_problem(g.reward, g.reward_pattern)
        if problem is not None:
            c.add("grpo.reward_pattern", g.reward_pattern, problem.replace("give one", "set grpo.reward_pattern"))
        return
    if ":" in g.reward and not c.check_paths:  # a file on another machine
        return
    problem = _reward_problem(g.reward, None)
    if problem is not None:
        c.add("grpo.reward", g.reward, problem)


def _check_reference(c: Checker) -> None:
    g, lora = c.r.grpo, c.r.lora
    if g.reference is None or not c.ok("grpo.reference", "grpo.kl_coef"):
        return
    if g.kl_coef == 0:
        c.add("grpo.reference", g.reference, "has no effect with grpo.kl_coef 0 (no KL term, so no reference model); "
                                             "remove it, or set grpo.kl_coef > 0")
    elif g.reference == "adapters_off" and c.ok("lora.rank") and lora.rank is None:
        c.add("grpo.reference", g.reference, "the policy without its adapters is the reference only with LoRA; set "
                                             "lora.rank, or use reference frozen")


def _check_eval_source(c: Checker) -> None:
    g, d = c.r.grpo, c.r.data
    if g.eval_source is None or not c.ok("grpo.eval_source"):
        return
    if c.ok("data.val_fraction") and d.val_fraction != DataSection().val_fraction:
        c.add("data.val_fraction", d.val_fraction, "has no effect with grpo.eval_source (its rows are the "
                                                   "validation split, and every row of data.source trains); remove "
                                                   "one of them")
    if not c.check_paths:
        return
    try:
        check_row_source(g.eval_source, "prompts", {str(k): v for k, v in d.fields.items()}, "grpo.eval_source")
    except DataError as e:
        c.add("grpo.eval_source", g.eval_source, f"{' '.join(str(e).split())}; give held-out prompt rows (e.g. "
                                                 f"prompts_heldout.jsonl from `plait data task`), or null to hold "
                                                 f"out data.val_fraction of data.source")
