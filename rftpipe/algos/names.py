"""Typed registry keys of the algorithm variants.

Kept free of torch so the config schema (and the launch layer) can import them on a
login node. The registries that map these names to code live beside them.
"""

from typing import Literal

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
KLEstimatorName = Literal["k1", "k2", "k3"]
PolicyLossName = Literal["ppo_clip"]
AggregationName = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLControllerName = Literal["fixed", "adaptive"]
RolloutCorrectionName = Literal["none", "tis", "icepop", "token_mask", "seq_tis"]
