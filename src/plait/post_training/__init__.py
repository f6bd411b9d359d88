"""Post-training: preference objectives (DPO, IPO, ORPO, SimPO) and distributed sequence log-probabilities."""

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

__all__ = [
    "NO_SEGMENT", "OBJECTIVES", "REFERENCE_OBJECTIVES", "Objective", "PreferenceSettings", "PreferenceSettingsError",
    "VocabParallelTokenLogprobs", "dpo_loss", "ipo_loss", "orpo_loss", "preference_loss", "segment_logprob_sums",
    "shift_labels", "simpo_loss", "split_pairs", "target_segment_ids", "token_logprobs",
]
