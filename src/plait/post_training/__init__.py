"""Post-training: preference objectives (DPO, IPO, ORPO, SimPO), distributed sequence log-probabilities, and GRPO's
policy loss and verifiable rewards."""

from plait.post_training.grpo_loss import (
    VARIANTS,
    Variant,
    entropy_from_logits,
    group_advantages,
    policy_loss,
    token_means,
    token_weights,
)
from plait.post_training.logprobs import (
    NO_SEGMENT,
    VocabParallelTokenLogprobs,
    segment_logprob_sums,
    shift_labels,
    split_pairs,
    target_segment_ids,
    token_logprobs,
)
from plait.post_training.objectives import (
    OBJECTIVES,
    REFERENCE_OBJECTIVES,
    Objective,
    PreferenceSettings,
    PreferenceSettingsError,
    dpo_loss,
    ipo_loss,
    orpo_loss,
    preference_loss,
    simpo_loss,
)
from plait.post_training.rewards import (
    Reward,
    RewardError,
    exact_match,
    load_reward,
    regex_reward,
    score_completions,
)

__all__ = [
    "NO_SEGMENT", "OBJECTIVES", "REFERENCE_OBJECTIVES", "VARIANTS", "Objective", "PreferenceSettings",
    "PreferenceSettingsError", "Reward", "RewardError", "Variant", "VocabParallelTokenLogprobs", "dpo_loss",
    "entropy_from_logits", "exact_match", "group_advantages", "ipo_loss", "load_reward", "orpo_loss", "policy_loss",
    "preference_loss", "regex_reward", "score_completions", "segment_logprob_sums", "shift_labels", "simpo_loss",
    "split_pairs", "target_segment_ids", "token_logprobs", "token_means", "token_weights",
]
