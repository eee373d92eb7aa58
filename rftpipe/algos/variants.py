"""The built-in algorithm variants: registry entries, settings classes and traits.

Advantage estimators (`advantage.estimator`), policy losses (`train.policy_loss`), KL
estimators (`kl.estimator`), KL controllers (`kl.controller`) and rollout corrections
(`train.rollout_correction`) are each a :class:`~rftpipe.algos.registry.Registry`. A variant
is one entry here (its name, its settings class, its traits) plus its function, attached in
the torch module of its family (:mod:`rftpipe.algos.advantage`, :mod:`rftpipe.algos.losses`,
:mod:`rftpipe.algos.kl_controller`, :mod:`rftpipe.algos.correction`) with
``@REGISTRY.implements(name)``. The config holds an instance of the chosen variant's
settings class and the function receives that instance unchanged; the defaults are the
settings class's own. Kept free of torch so the config schema (and the launch layer) can
import them on a login node.

Aggregations (`train.loss_agg`) have no settings of their own: they are a table keyed by the
typed name below, in :mod:`rftpipe.algos.losses`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rftpipe.algos.registry import Registry

AggregationName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_share(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


# ---------------------------------------------------------------------------------------------
# Advantage estimators (functions: rftpipe/algos/advantage.py)
# ---------------------------------------------------------------------------------------------


class AdvantageSettings:
    """Base of the settings class of every advantage estimator (`advantage.estimator`)."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class EstimatorTraits:
    """What an advantage estimator needs from the rest of the config, checked at load."""

    needs_groups: bool = False
    """The baseline comes from the other samples of the prompt's group, so a group of one
    (`rollout.n == 1`) gives every sample a zero advantage: refused at load."""

    needs_baseline_rollout: bool = False
    """The rollout stage adds one greedy response per prompt (`is_baseline` rows): scored
    like any row, read by the estimator as the baseline, never trained on."""

    needs_critic: bool = False
    """The estimator reads the critic's values: it needs `critic`, and a `critic` is only
    trained for such an estimator (its settings give the critic's GAE returns)."""

    per_sequence: bool = False
    """Every token of a row gets one advantage (without `kl.mode=reward`'s per-token
    penalty), so an agent episode's earlier sequences can take its last one's
    (`rollout.agent.branches=split`)."""

    alike_groups_zero: bool = False
    """A group whose scores are all equal carries no signal: its rows' advantages are
    exactly 0 on every token (`compute_advantages` sets them so; the estimator's own
    arithmetic would leave the float residue of the group's mean), so their policy-loss
    gradient is exactly 0 and the train stage may skip them (`train.skip_zero_advantage`).
    Not REINFORCE++-baseline's (its batch whitening moves a zero) nor the token baselines'."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageSettings, EstimatorTraits, Callable[..., Any]] = Registry(
    "advantage estimator", base=AdvantageSettings, traits=EstimatorTraits
)
"""`advantage.estimator`: every estimator maps an `AdvantageInputs` batch and its settings to
``(B, T)`` float64 advantages (see :mod:`rftpipe.algos.advantage`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupStdSettings(AdvantageSettings):
    """Shared by the estimators that divide by a group's standard deviation."""

    eps: float = 1e-6
    """Added to the group's standard deviation before dividing by it."""

    def __post_init__(self) -> None:
        _check_non_negative("eps", self.eps)


@dataclass(frozen=True, kw_only=True, slots=True)
class DiscountSettings(AdvantageSettings):
    """Shared by the estimators with discounted token returns."""

    gamma: float = 1.0
    """Discount of the token returns: G_t = r_t + gamma G_(t+1)."""

    turn_gamma: float = 1.0
    """Multi-turn episodes' per-turn discount, on top of gamma: a reward paid j turns after
    a token's turn reaches it times turn_gamma^j (environment tokens are never steps)."""

    def __post_init__(self) -> None:
        _check_unit("gamma", self.gamma)
        _check_unit("turn_gamma", self.turn_gamma)


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOSettings(GroupStdSettings):
    """GRPO: the group-standardised sequence score on every token."""


ADVANTAGE_ESTIMATORS.register(
    "grpo",
    settings=GRPOSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class DrGRPOSettings(AdvantageSettings):
    """Dr. GRPO: the group-centred sequence score, no std scaling. No settings."""


ADVANTAGE_ESTIMATORS.register(
    "dr_grpo",
    settings=DrGRPOSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RLOOSettings(AdvantageSettings):
    """RLOO: the score minus the mean of the group's other samples. No settings."""


ADVANTAGE_ESTIMATORS.register(
    "rloo",
    settings=RLOOSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReinforcePPSettings(DiscountSettings):
    """REINFORCE++: KL-shaped discounted token returns, whitened over the global batch."""


# Global whitening is the baseline: a group of one still gets a signal.
ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp", settings=ReinforcePPSettings, traits=EstimatorTraits(needs_groups=False)
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReinforcePPBaselineSettings(AdvantageSettings):
    """REINFORCE++-baseline: the group-centred score on every token, whitened over the
    global batch; sequence-level, so there is no discount (as verl). No settings."""


ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp_baseline",
    settings=ReinforcePPBaselineSettings,
    traits=EstimatorTraits(needs_groups=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class OPOSettings(AdvantageSettings):
    """OPO: the score minus the length-weighted group mean. No settings."""


ADVANTAGE_ESTIMATORS.register(
    "opo",
    settings=OPOSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPGAdvantageSettings(AdvantageSettings):
    """GPG: the group-centred score scaled by B / (B - M). No settings."""


ADVANTAGE_ESTIMATORS.register(
    "gpg",
    settings=GPGAdvantageSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOPassKSettings(GroupStdSettings):
    """Pass@k: only a group's best sample is credited, with (r_max - r_2nd) / std."""


ADVANTAGE_ESTIMATORS.register(
    "grpo_passk",
    settings=GRPOPassKSettings,
    traits=EstimatorTraits(needs_groups=True, per_sequence=True, alike_groups_zero=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimalTokenBaselineSettings(AdvantageSettings):
    """The optimal token baseline: a per-position baseline weighted by score energy."""

    eps: float = 1e-8
    """Added to the baseline's denominator (the summed weights of the group's samples);
    1e-8 as verl's `compute_optimal_token_baseline_advantage`."""

    def __post_init__(self) -> None:
        _check_non_negative("eps", self.eps)


ADVANTAGE_ESTIMATORS.register(
    "optimal_token_baseline",
    settings=OptimalTokenBaselineSettings,
    traits=EstimatorTraits(needs_groups=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReMaxSettings(AdvantageSettings):
    """ReMax: the reward-to-go minus the reward of the prompt's greedy response. No
    settings."""


# The greedy response is the baseline, so one sample per prompt is enough.
ADVANTAGE_ESTIMATORS.register(
    "remax",
    settings=ReMaxSettings,
    traits=EstimatorTraits(needs_groups=False, needs_baseline_rollout=True),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class GAESettings(DiscountSettings):
    """GAE from the critic's values, whitened over the global batch; the same gamma and
    lambda give the critic's returns."""

    lam: float = 1.0
    """GAE's lambda: 1 gives Monte-Carlo returns minus the critic's value, 0 one-step TD
    errors."""

    def __post_init__(self) -> None:
        DiscountSettings.__post_init__(self)  # super() fails in a slots dataclass
        _check_unit("lam", self.lam)


ADVANTAGE_ESTIMATORS.register(
    "gae", settings=GAESettings, traits=EstimatorTraits(needs_groups=False, needs_critic=True)
)


# ---------------------------------------------------------------------------------------------
# Policy losses (functions: rftpipe/algos/losses.py)
# ---------------------------------------------------------------------------------------------


class PolicyLossSettings:
    """Base of the settings class of every policy loss (`train.policy_loss`)."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossTraits:
    """What a policy loss needs from the rest of the train config, checked at load."""

    reads_zero_advantage_rows: bool = False
    """The loss of a token with advantage 0 can be nonzero, or depends on the other tokens
    of its micro-batch (KL-Cov penalises high-covariance tokens whatever their advantage;
    Clip-Cov ranks a micro-batch's tokens): rows with zero advantages are never skipped."""

    sequence_level: bool = False
    """The loss is one value per response, written on each of its tokens: only
    `seq-mean-token-mean` turns that back into the paper's per-sequence mean."""


POLICY_LOSSES: Registry[PolicyLossSettings, PolicyLossTraits, Callable[..., Any]] = Registry(
    "policy loss", base=PolicyLossSettings, traits=PolicyLossTraits
)
"""`train.policy_loss`: every loss maps ``(logprobs, old_logprobs, advantages, mask,
settings)`` to per-token `PolicyLossOutputs` (see :mod:`rftpipe.algos.losses`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipRangeSettings(PolicyLossSettings):
    """The clip range of the losses that clip the importance ratio."""

    clip_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - clip_low."""

    clip_high: float = 0.2
    """Upper clip range: the ratio is clipped at 1 + clip_high (raise it for DAPO's
    clip-higher)."""

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(
                "clip_low must be in [0, 1) and clip_high >= 0, "
                f"got {self.clip_low} and {self.clip_high}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PPOClipSettings(ClipRangeSettings):
    """PPO's clipped surrogate, with an asymmetric clip range and a dual clip."""

    dual_clip: float | None = 3.0
    """Dual-clip constant c > 1 bounding the loss of tokens with negative advantage at
    -A c (null: off). On by default at 3.0, as in verl: a token with a huge ratio and a
    negative advantage cannot dominate the update."""

    def __post_init__(self) -> None:
        ClipRangeSettings.__post_init__(self)  # super() fails in a slots dataclass
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")


POLICY_LOSSES.register("ppo_clip", settings=PPOClipSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class GSPOSettings(ClipRangeSettings):
    """GSPO: PPO's clip on the sequence's geometric-mean ratio (the paper's ranges are far
    narrower than PPO's: 3e-4 and 4e-4). No dual clip."""


POLICY_LOSSES.register("gspo", settings=GSPOSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class CISPOSettings(ClipRangeSettings):
    """CISPO: the clip range bounds the stop-gradient importance weight of -A log pi, not
    the surrogate."""


POLICY_LOSSES.register("cispo", settings=CISPOSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class SAPOSettings(PolicyLossSettings):
    """SAPO: a soft gate sigmoid(tau (r - 1)) 4 / tau on the ratio instead of a clip."""

    tau_pos: float = 1.0
    """Gate temperature for tokens with positive advantage (the paper's 1.0)."""

    tau_neg: float = 1.05
    """Gate temperature for tokens with negative (or zero) advantage (the paper's 1.05)."""

    def __post_init__(self) -> None:
        _check_positive("tau_pos", self.tau_pos)
        _check_positive("tau_neg", self.tau_neg)


POLICY_LOSSES.register("sapo", settings=SAPOSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPGLossSettings(PolicyLossSettings):
    """GPG: the plain policy gradient -A log pi, no ratio and no clip. No settings."""


POLICY_LOSSES.register("gpg", settings=GPGLossSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipCovSettings(PPOClipSettings):
    """Clip-Cov: PPO's clipped surrogate, plus the gradient cut on a few high-covariance
    tokens."""

    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of tokens with negative advantage at
    -A c (null: off). Off by default, as in verl (`compute_policy_loss_clip_cov` has no
    dual clip); set it to bound such tokens as `ppo_clip` does."""

    ratio: float = 2e-4
    """Share of the valid tokens whose gradient is cut (the paper's 2e-4)."""

    lb: float = 1.0
    """Lowest covariance of a token that may be cut."""

    ub: float = 5.0
    """Highest covariance of a token that may be cut."""

    def __post_init__(self) -> None:
        PPOClipSettings.__post_init__(self)  # super() fails in a slots dataclass
        _check_share("ratio", self.ratio)
        if not self.lb < self.ub:
            raise ValueError(f"lb must be < ub, got {self.lb} and {self.ub}")


POLICY_LOSSES.register(
    "clip_cov", settings=ClipCovSettings, traits=PolicyLossTraits(reads_zero_advantage_rows=True)
)


@dataclass(frozen=True, kw_only=True, slots=True)
class KLCovSettings(PolicyLossSettings):
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the highest-covariance
    tokens (the penalty is the trust region, so there is no clip)."""

    ratio: float = 2e-4
    """Share of the valid tokens (highest covariance first) given the KL penalty (the
    paper's 2e-4)."""

    coef: float = 1.0
    """Coefficient of the |log pi - log pi_old| penalty on those tokens: 1 as verl's KL-Cov
    recipes and its loss function's own fallback (verl's `PolicyLossConfig.ppo_kl_coef`
    default is 0.1; see docs/algorithms.md, "Defaults against verl's")."""

    def __post_init__(self) -> None:
        _check_share("ratio", self.ratio)
        _check_non_negative("coef", self.coef)


POLICY_LOSSES.register(
    "kl_cov", settings=KLCovSettings, traits=PolicyLossTraits(reads_zero_advantage_rows=True)
)


@dataclass(frozen=True, kw_only=True, slots=True)
class GeoMeanSettings(ClipRangeSettings):
    """GMPO: the geometric mean of the token ratios times the sequence advantage; the clip
    range is in log space."""

    clip_low: float = 0.2
    """Lower clip of each token's log ratio: -clip_low (log space; the paper uses 0.4,
    i.e. ratios down to e^-0.4)."""

    clip_high: float = 0.2
    """Upper clip of each token's log ratio: clip_high (log space)."""


POLICY_LOSSES.register(
    "geo_mean", settings=GeoMeanSettings, traits=PolicyLossTraits(sequence_level=True)
)


# ---------------------------------------------------------------------------------------------
# KL estimators (functions: rftpipe/algos/losses.py)
# ---------------------------------------------------------------------------------------------


class KLEstimatorSettings:
    """Base of the settings class of every KL estimator (`kl.estimator`)."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class KLEstimatorTraits:
    """What a KL estimator needs from the rest of the config (nothing so far)."""


KL_ESTIMATORS: Registry[KLEstimatorSettings, KLEstimatorTraits, Callable[..., Any]] = Registry(
    "KL estimator", base=KLEstimatorSettings, traits=KLEstimatorTraits
)
"""`kl.estimator`: every estimator maps ``(logprobs, ref_logprobs, settings)`` to per-token
estimates of KL(policy || reference) for tokens sampled from the policy."""


@dataclass(frozen=True, kw_only=True, slots=True)
class K1Settings(KLEstimatorSettings):
    """k1 = log pi - log ref: unbiased, can be negative. No settings."""


KL_ESTIMATORS.register("k1", settings=K1Settings)


@dataclass(frozen=True, kw_only=True, slots=True)
class K2Settings(KLEstimatorSettings):
    """k2 = (log pi - log ref)^2 / 2: low variance, biased. No settings."""


KL_ESTIMATORS.register("k2", settings=K2Settings)


@dataclass(frozen=True, kw_only=True, slots=True)
class K3Settings(KLEstimatorSettings):
    """k3 = e^x - 1 - x with x = log ref - log pi: unbiased and non-negative; the log
    ratio is clamped to +-20 and the value capped at 10, as verl. No settings."""


KL_ESTIMATORS.register("k3", settings=K3Settings)


@dataclass(frozen=True, kw_only=True, slots=True)
class AbsSettings(KLEstimatorSettings):
    """abs = |log pi - log ref|. No settings."""


KL_ESTIMATORS.register("abs", settings=AbsSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class K1STSettings(KLEstimatorSettings):
    """k1's value with k2's gradient (straight-through; verl's `k1+`). No settings."""


KL_ESTIMATORS.register("k1_st", settings=K1STSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class K3STSettings(KLEstimatorSettings):
    """k3's value with k2's gradient (straight-through; verl's `k3+`). No settings."""


KL_ESTIMATORS.register("k3_st", settings=K3STSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class AbsSTSettings(KLEstimatorSettings):
    """abs's value with k2's gradient (straight-through; verl's `abs+`). No settings."""


KL_ESTIMATORS.register("abs_st", settings=AbsSTSettings)


# ---------------------------------------------------------------------------------------------
# KL controllers (functions: rftpipe/algos/kl_controller.py)
# ---------------------------------------------------------------------------------------------


class KLControllerSettings:
    """Base of the settings class of every KL coefficient controller (`kl.controller`)."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class KLControllerTraits:
    """What a KL controller needs from the rest of the config, checked at load."""

    adapts: bool = True
    """The coefficient moves during the run, so `kl.coef` may start at 0; a controller that
    never moves it with `kl.coef` 0 and a KL `mode` is refused (the KL would weigh nothing)."""


KL_CONTROLLERS: Registry[KLControllerSettings, KLControllerTraits, Callable[..., Any]] = Registry(
    "KL controller", base=KLControllerSettings, traits=KLControllerTraits
)
"""`kl.controller`: every controller maps ``(init_coef, settings)`` to a
:class:`~rftpipe.algos.kl_controller.KLController` whose state is checkpointed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedKLSettings(KLControllerSettings):
    """The coefficient stays `kl.coef`. No settings."""


KL_CONTROLLERS.register("fixed", settings=FixedKLSettings, traits=KLControllerTraits(adapts=False))


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaptiveKLSettings(KLControllerSettings):
    """Ziegler et al. 2019: after each step, coef *= 1 + clip(kl / target - 1, +-0.2) *
    samples / horizon."""

    target: float = 0.1
    """The KL the coefficient steers towards: the step's `train/kl`, the estimator's per-token
    value averaged over the tokens the step trained on."""

    horizon: int = 10000
    """Samples over which a full proportional correction is applied."""

    def __post_init__(self) -> None:
        _check_positive("target", self.target)
        _check_positive("horizon", self.horizon)


KL_CONTROLLERS.register("adaptive", settings=AdaptiveKLSettings)


# ---------------------------------------------------------------------------------------------
# Rollout corrections (functions: rftpipe/algos/correction.py)
# ---------------------------------------------------------------------------------------------


class RolloutCorrectionSettings:
    """Base of the settings class of every rollout correction (`train.rollout_correction`)."""

    __slots__ = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionTraits:
    """What a rollout correction needs from the rest of the config, checked at load."""

    reads_ratio: bool = True
    """It weighs tokens by pi_old / pi_rollout, so the old logprobs must be the actor's own
    (`train.old_logprobs` resolving to `actor`): with the rollout's, the ratio is 1."""


ROLLOUT_CORRECTIONS: Registry[
    RolloutCorrectionSettings, RolloutCorrectionTraits, Callable[..., Any]
] = Registry("rollout correction", base=RolloutCorrectionSettings, traits=RolloutCorrectionTraits)
"""`train.rollout_correction`: every correction maps ``(old_logprobs, rollout_logprobs, mask,
settings)`` to detached per-token weights on the policy loss (see
:mod:`rftpipe.algos.correction`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NoCorrectionSettings(RolloutCorrectionSettings):
    """Weight 1 on every token. No settings."""


ROLLOUT_CORRECTIONS.register(
    "none", settings=NoCorrectionSettings, traits=RolloutCorrectionTraits(reads_ratio=False)
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CapSettings(RolloutCorrectionSettings):
    """Shared by the truncated importance-sampling corrections."""

    cap: float = 2.0
    """Truncation C: weights above it are cut to it."""

    def __post_init__(self) -> None:
        _check_positive("cap", self.cap)


@dataclass(frozen=True, kw_only=True, slots=True)
class TISSettings(CapSettings):
    """Truncated importance sampling: min(ratio, cap) per token."""


ROLLOUT_CORRECTIONS.register("tis", settings=TISSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqTISSettings(CapSettings):
    """Sequence-level truncated IS: min(product of a response's ratios, cap) on its tokens."""


ROLLOUT_CORRECTIONS.register("seq_tis", settings=SeqTISSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class BandSettings(RolloutCorrectionSettings):
    """Shared by the corrections that drop tokens whose ratio leaves a band."""

    low: float = 0.5
    """Lowest ratio whose token is kept."""

    high: float = 2.0
    """Highest ratio whose token is kept."""

    def __post_init__(self) -> None:
        if not (0 <= self.low <= 1 <= self.high < math.inf):
            raise ValueError(
                f"low and high must satisfy 0 <= low <= 1 <= high < inf, got {self.low} "
                f"and {self.high}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class IcePopSettings(BandSettings):
    """IcePop: the ratio inside [low, high], 0 outside."""


ROLLOUT_CORRECTIONS.register("icepop", settings=IcePopSettings)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenMaskSettings(BandSettings):
    """Token-level rejection: 1 inside [low, high], 0 outside."""


ROLLOUT_CORRECTIONS.register("token_mask", settings=TokenMaskSettings)
