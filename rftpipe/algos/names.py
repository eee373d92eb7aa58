"""Typed registry keys of the algorithm variants, and the traits the config checks need.

Kept free of torch so the config schema (and the launch layer) can import them on a
login node. The registries that map these names to code live beside them; tests assert
that every registry, every trait table and every Literal name the same set of keys.
"""

from dataclasses import dataclass
from typing import Literal

AdvantageName = Literal[
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "opo",
    "gpg",
    "grpo_passk",
    "optimal_token_baseline",
    "remax",
    "gae",
]
KLEstimatorName = Literal["k1", "k2", "k3", "abs", "k1_st", "k3_st", "abs_st"]
PolicyLossName = Literal[
    "ppo_clip", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"
]
AggregationName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLControllerName = Literal["fixed", "adaptive"]
RolloutCorrectionName = Literal["none", "tis", "icepop", "token_mask", "seq_tis"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatorTraits:
    """What an advantage estimator needs from the rollout, checked at config load."""

    needs_groups: bool
    """The baseline comes from the other samples of the prompt's group, so a group of one
    (`rollout.n == 1`) gives every sample a zero advantage: refused at load."""

    needs_baseline_rollout: bool = False
    """The rollout stage adds one greedy response per prompt (`is_baseline` rows): scored
    like any row, read by the estimator as the baseline, never trained on."""


ESTIMATOR_TRAITS: dict[AdvantageName, EstimatorTraits] = {
    "grpo": EstimatorTraits(needs_groups=True),
    "dr_grpo": EstimatorTraits(needs_groups=True),
    "rloo": EstimatorTraits(needs_groups=True),
    # Global whitening is the baseline: a group of one still gets a signal.
    "reinforce_pp": EstimatorTraits(needs_groups=False),
    "reinforce_pp_baseline": EstimatorTraits(needs_groups=True),
    "opo": EstimatorTraits(needs_groups=True),
    "gpg": EstimatorTraits(needs_groups=True),
    "grpo_passk": EstimatorTraits(needs_groups=True),
    "optimal_token_baseline": EstimatorTraits(needs_groups=True),
    # The greedy response is the baseline, so one sample per prompt is enough.
    "remax": EstimatorTraits(needs_groups=False, needs_baseline_rollout=True),
    "gae": EstimatorTraits(needs_groups=False),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossTraits:
    """What a policy loss needs from the rest of the train config, checked at load."""

    sequence_level: bool
    """The loss is one value per response, written on each of its tokens: only
    `seq-mean-token-mean` turns that back into the paper's per-sequence mean."""


POLICY_LOSS_TRAITS: dict[PolicyLossName, PolicyLossTraits] = {
    "ppo_clip": PolicyLossTraits(sequence_level=False),
    "gspo": PolicyLossTraits(sequence_level=False),
    "cispo": PolicyLossTraits(sequence_level=False),
    "sapo": PolicyLossTraits(sequence_level=False),
    "gpg": PolicyLossTraits(sequence_level=False),
    "clip_cov": PolicyLossTraits(sequence_level=False),
    "kl_cov": PolicyLossTraits(sequence_level=False),
    "geo_mean": PolicyLossTraits(sequence_level=True),
}
