"""Advantage estimators for outcome-reward RL fine-tuning (GRPO family, RLOO, REINFORCE++, OPO,
GPG, pass@k, the optimal token baseline).

Every estimator maps an :class:`AdvantageInputs` batch and its settings to per-token
advantages of shape ``(B, T)`` in float64 that are exactly zero on padding. Estimators are
entries of :data:`ADVANTAGE_ESTIMATORS`, declared with their settings classes and traits in
the torch-free :mod:`rftpipe.algos.variants`; this module attaches their functions
(``@ADVANTAGE_ESTIMATORS.implements(name)``). :func:`compute_advantages` is the single
entry point: the settings instance selects the estimator and is passed to it unchanged.

Group statistics (GRPO, Dr. GRPO, RLOO, OPO, pass@k, the REINFORCE++ and optimal token
baselines) are always computed within one rank, because the data loader never splits a
prompt's group across ranks. Only batch-wide quantities (the token whitening of REINFORCE++
and GAE, GPG's share of informative samples) need cross-rank sums, which go through
``reduce_sum``.

Whether an estimator needs groups of more than one sample (or baseline rows, or a critic) is
a trait of its entry (torch-free, read by the config check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rftpipe.algos.value import GAEOutput, gae, masked_whiten

# The entries live in the torch-free `variants` module so the config schema can import them.
from rftpipe.algos.variants import (
    ADVANTAGE_ESTIMATORS,
    AdvantageSettings,
    DrGRPOSettings,
    GAESettings,
    GPGAdvantageSettings,
    GRPOPassKSettings,
    GRPOSettings,
    OPOSettings,
    OptimalTokenBaselineSettings,
    ReinforcePPBaselineSettings,
    ReinforcePPSettings,
    ReMaxSettings,
    RLOOSettings,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageSettings",
    "Reducer",
    "compute_advantages",
    "gae_returns",
    "identity",
]

Reducer = Callable[[Tensor], Tensor]
"""Sums a tensor across data-parallel ranks (an all-reduce); the identity on a single rank."""


def identity(x: Tensor) -> Tensor:
    """Single-rank :data:`Reducer`: there is nothing to sum over."""
    return x


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """One rank's batch of scored rollouts.

    Attributes:
        rewards: ``(B,)`` outcome reward per sample; contains no KL term.
        group_index: ``(B,)`` int64; samples of the same prompt share an index. Groups need
            not be contiguous and indices need not be dense.
        response_mask: ``(B, T)`` bool; True on valid response tokens. Each row's valid
            tokens are expected to be contiguous (right padding), because discounting counts
            positions.
        token_kl_penalty: ``(B, T)`` per-token KL penalty already multiplied by its
            coefficient (KL-in-reward), or None when KL is not put in the reward.
        logprobs: ``(B, T)`` behaviour-policy log-probabilities of the sampled tokens; only
            the optimal token baseline reads them (its per-token variance proxy).
        sum_pi_squared: ``(B, T)`` ``sum_v pi(v)^2`` of the behaviour policy at each
            position, or None; the optimal token baseline then uses the lower bound
            ``pi(y_t)^2`` (see :func:`optimal_token_baseline_advantages`).
        is_baseline: ``(B,)`` bool; True on the greedy baseline rows of ReMax (one per
            group), or None when there are none. Only estimators whose trait
            ``needs_baseline_rollout`` is set accept them; they get a zero advantage.
    """

    rewards: Tensor
    group_index: Tensor
    response_mask: Tensor
    token_kl_penalty: Tensor | None = None
    logprobs: Tensor | None = None
    sum_pi_squared: Tensor | None = None
    is_baseline: Tensor | None = None
    values: Tensor | None = None
    """``(B, T)`` the critic's ``V(s_t)`` per response token, for estimators with a learned
    baseline (``gae``); None without a critic."""
    turn_rewards: Tensor | None = None
    """``(B, T)`` the part of ``rewards`` a multi-turn environment paid during the episode,
    each turn's reward on that turn's last model token; None for single-turn rows. The
    token-level estimators (``gae``, ``reinforce_pp`` and the reward-to-go of the optimal
    token baseline) credit it there and the rest of ``rewards`` on the last token, so a
    turn's tokens are not credited with rewards paid before them; the sequence-level
    estimators and ``remax`` (whose baseline is a whole greedy episode's return) read
    ``rewards`` alone."""
    turn_starts: Tensor | None = None
    """``(B, T)`` bool, True on each turn's first model token of a multi-turn row; None for
    single-turn rows. The discounting estimators' ``turn_gamma`` applies there."""


class AdvantageEstimator(Protocol):
    """Signature shared by the functions of :data:`ADVANTAGE_ESTIMATORS`."""

    def __call__(
        self, inputs: AdvantageInputs, settings: AdvantageSettings, *, reduce_sum: Reducer
    ) -> Tensor: ...


def _validate(inputs: AdvantageInputs) -> None:
    mask = inputs.response_mask
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(
            f"response_mask must be a (B, T) bool tensor, got {mask.dtype} {mask.shape}"
        )
    batch = mask.shape[0]
    if inputs.rewards.shape != (batch,):
        raise ValueError(f"rewards must have shape ({batch},), got {tuple(inputs.rewards.shape)}")
    if inputs.group_index.shape != (batch,):
        raise ValueError(
            f"group_index must have shape ({batch},), got {tuple(inputs.group_index.shape)}"
        )
    flags = inputs.is_baseline
    if flags is not None and (flags.shape != (batch,) or flags.dtype != torch.bool):
        raise ValueError(
            f"is_baseline must be a ({batch},) bool tensor, got {flags.dtype} {flags.shape}"
        )
    for name in ("token_kl_penalty", "logprobs", "sum_pi_squared", "turn_rewards", "turn_starts"):
        value = getattr(inputs, name)
        if value is not None and value.shape != mask.shape:
            raise ValueError(f"{name} must have shape {tuple(mask.shape)}, got {value.shape}")


def _masked_kl(inputs: AdvantageInputs) -> Tensor:
    """``(B, T)`` float64 KL penalty, zero on padding (padding may hold garbage values)."""
    mask = inputs.response_mask
    if inputs.token_kl_penalty is None:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    return torch.where(mask, inputs.token_kl_penalty.to(torch.float64), 0.0)


def _sequence_scores(inputs: AdvantageInputs) -> Tensor:
    """``(B,)`` float64 score per sample: outcome reward minus the summed token KL penalty."""
    return inputs.rewards.to(torch.float64) - _masked_kl(inputs).sum(dim=-1)


def _group_onehot(group_index: Tensor) -> Tensor:
    """``(G, B)`` float64 membership matrix of the G distinct groups.

    A one-hot matmul is used rather than ``index_add_`` because CUDA scatter-adds use atomics
    and are therefore not bit-reproducible; B is at most a few thousand, so G x B is small.
    """
    unique, inverse = torch.unique(group_index, return_inverse=True)
    groups = torch.arange(unique.numel(), device=group_index.device)
    return (groups[:, None] == inverse[None, :]).to(torch.float64)


def _group_stats(values: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample statistics of each sample's own group.

    Args:
        values: ``(B,)`` float64.
        group_index: ``(B,)`` int64.

    Returns:
        ``(count, mean, std)``, each ``(B,)`` float64. ``std`` is the unbiased (N-1) sample
        standard deviation and is 0 for groups of size 1.
    """
    onehot = _group_onehot(group_index)
    counts = onehot.sum(dim=-1)
    means = (onehot @ values) / counts
    sample_count = counts @ onehot
    sample_mean = means @ onehot
    # Two-pass variance: sum of squared deviations avoids E[x^2]-E[x]^2 cancellation.
    sq_dev = onehot @ (values - sample_mean).square()
    var = sq_dev / (counts - 1).clamp(min=1)
    sample_std = var.sqrt() @ onehot
    return sample_count, sample_mean, sample_std


def _group_max(values: Tensor, member: Tensor) -> Tensor:
    """``(G,)`` largest of each group's ``values`` ``(B,)``; ``member`` is the ``(G, B)`` bool
    one-hot. amax() refuses an empty dimension, and a rank may hold no rows."""
    if values.numel() == 0:
        return values.new_zeros(member.shape[0])
    return torch.where(member, values[None, :], -torch.inf).amax(dim=-1)


def _broadcast(per_sample: Tensor, mask: Tensor) -> Tensor:
    """``(B,)`` -> ``(B, T)``: the sample's value on its valid tokens, 0 on padding."""
    return torch.where(mask, per_sample[:, None], 0.0)


@ADVANTAGE_ESTIMATORS.implements("grpo")
def grpo_advantages(
    inputs: AdvantageInputs, settings: GRPOSettings, *, reduce_sum: Reducer
) -> Tensor:
    """GRPO: group-standardised sequence score, broadcast to all tokens. ``(B, T)``."""
    scores = _sequence_scores(inputs)
    count, mean, std = _group_stats(scores, inputs.group_index)
    adv = (scores - mean) / (std + settings.eps)
    # A lone sample has no baseline to compare against, so it carries no signal.
    adv = torch.where(count > 1, adv, 0.0)
    return _broadcast(adv, inputs.response_mask)


@ADVANTAGE_ESTIMATORS.implements("dr_grpo")
def dr_grpo_advantages(
    inputs: AdvantageInputs, settings: DrGRPOSettings, *, reduce_sum: Reducer
) -> Tensor:
    """Dr. GRPO: group-centred sequence score without std scaling. ``(B, T)``."""
    scores = _sequence_scores(inputs)
    _, mean, _ = _group_stats(scores, inputs.group_index)
    return _broadcast(scores - mean, inputs.response_mask)


@ADVANTAGE_ESTIMATORS.implements("rloo")
def rloo_advantages(
    inputs: AdvantageInputs, settings: RLOOSettings, *, reduce_sum: Reducer
) -> Tensor:
    """RLOO: score minus the mean of the other samples of the group. ``(B, T)``."""
    scores = _sequence_scores(inputs)
    count, mean, _ = _group_stats(scores, inputs.group_index)
    # s_i - mean(others) == n/(n-1) * (s_i - mean(all)); clamp keeps n=1 finite before masking.
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, adv, 0.0)
    return _broadcast(adv, inputs.response_mask)


def _discounted_returns(
    token_rewards: Tensor,
    gamma: float,
    mask: Tensor,
    turn_starts: Tensor | None = None,
    turn_gamma: float = 1.0,
) -> Tensor:
    """``(B, T)`` -> ``(B, T)``: ``G_t = sum_{k >= t} gamma^(k-t) r_k`` along the positions
    where ``mask`` is True (a multi-turn episode's environment tokens are not steps, so
    they are not discounted over), each step into a turn's first token (``turn_starts``)
    discounted by ``turn_gamma`` too; 0 elsewhere."""
    rewards = torch.where(mask, token_rewards, 0.0)
    if gamma == 1.0 and (turn_starts is None or turn_gamma == 1.0):
        return torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), 0.0)
    # A closed form via gamma^-t overflows float64 for long responses, so scan backwards.
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    discount = torch.full_like(running, gamma)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + discount * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
        if turn_starts is not None:
            here = gamma * torch.where(turn_starts[:, t], turn_gamma, 1.0)
            discount = torch.where(mask[:, t], here, discount)
    return returns


def _last_token(mask: Tensor) -> Tensor:
    """``(B, T)`` bool, True only at each row's last valid token (nowhere for empty rows)."""
    if mask.shape[1] == 0:
        # amax over an empty dimension raises, and there is no token to mark anyway.
        return mask.clone()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=-1, keepdim=True)
    return positions == last


def _token_outcome(inputs: AdvantageInputs, by_turn: bool = True) -> Tensor:
    """``(B, T)`` float64 reward per token before any KL term: the environment's turn rewards
    where they were paid and the rest of the outcome on the last valid token (``by_turn``
    False: the whole outcome on the last token)."""
    mask = inputs.response_mask
    outcome = inputs.rewards.to(torch.float64)[:, None]
    if inputs.turn_rewards is None or not by_turn:
        return torch.where(_last_token(mask), outcome, 0.0)
    paid = torch.where(mask, inputs.turn_rewards.to(torch.float64), 0.0)
    rest = outcome - paid.sum(dim=-1, keepdim=True)
    return paid + torch.where(_last_token(mask), rest, 0.0)


@ADVANTAGE_ESTIMATORS.implements("reinforce_pp")
def reinforce_pp_advantages(
    inputs: AdvantageInputs, settings: ReinforcePPSettings, *, reduce_sum: Reducer
) -> Tensor:
    """REINFORCE++: KL-shaped token returns, whitened over the global batch. ``(B, T)``.

    Hu 2025, "REINFORCE++" (arXiv:2501.03262), as verl's ``reinforce_plus_plus``: the
    outcome reward on each row's last valid token minus the per-token KL penalty, discounted
    returns ``G_t = r_t + gamma G_{t+1}``, then :func:`masked_whiten` over the valid tokens
    of all ranks (unbiased variance, ``(G - mean) * rsqrt(var + 1e-8)``), so advantages
    equal verl's for the same settings (``gamma``; the 1e-8 is verl's).
    """
    mask = inputs.response_mask
    token_rewards = -_masked_kl(inputs) + _token_outcome(inputs)
    returns = _discounted_returns(
        token_rewards, settings.gamma, mask, inputs.turn_starts, settings.turn_gamma
    )
    return masked_whiten(returns, mask, reduce_sum)


@ADVANTAGE_ESTIMATORS.implements("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    inputs: AdvantageInputs, settings: ReinforcePPBaselineSettings, *, reduce_sum: Reducer
) -> Tensor:
    """REINFORCE++-baseline: group-centred sequence score on every token, whitened over the
    global batch. ``(B, T)``.

    As verl's ``reinforce_plus_plus_baseline``: the score is the outcome reward minus the
    response's summed KL penalty (KL-in-reward), minus its group's mean score; every valid
    token gets that one value (no reward-to-go, so no discount), then
    :func:`masked_whiten` as REINFORCE++. (OpenRLHF instead centres the raw reward and keeps
    the per-token KL reward-to-go; we follow verl so settings port over.)
    Unlike verl, which keeps a lone sample's raw score, a group of one has a zero centred
    score, as in our GRPO; the config refuses ``rollout.n=1`` for this estimator anyway.
    """
    scores = _sequence_scores(inputs)
    _, mean, _ = _group_stats(scores, inputs.group_index)
    centred = _broadcast(scores - mean, inputs.response_mask)
    return masked_whiten(centred, inputs.response_mask, reduce_sum)


@ADVANTAGE_ESTIMATORS.implements("opo")
def opo_advantages(
    inputs: AdvantageInputs, settings: OPOSettings, *, reduce_sum: Reducer
) -> Tensor:
    """OPO: score minus the length-weighted group mean. ``(B, T)``.

    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv:2505.23585): for
    sequence-level rewards the variance-minimising baseline weights each sample by its
    gradient's squared norm, which they approximate by the response length:
    ``b = sum_j |y_j| s_j / sum_j |y_j|`` over the group. A group whose responses are all
    empty has no tokens to train, so its baseline is 0 rather than 0/0.
    """
    scores = _sequence_scores(inputs)
    lengths = inputs.response_mask.sum(dim=-1).to(torch.float64)
    onehot = _group_onehot(inputs.group_index)
    weighted = (onehot @ (lengths * scores)) / (onehot @ lengths).clamp(min=1)
    count = onehot.sum(dim=-1) @ onehot
    adv = torch.where(count > 1, scores - weighted @ onehot, 0.0)
    return _broadcast(adv, inputs.response_mask)


@ADVANTAGE_ESTIMATORS.implements("gpg")
def gpg_advantages(
    inputs: AdvantageInputs, settings: GPGAdvantageSettings, *, reduce_sum: Reducer
) -> Tensor:
    """GPG: group-centred score scaled by ``alpha = B / (B - M)``. ``(B, T)``.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv:2504.02546): samples of a group whose rewards are all equal
    (``M`` of the batch's ``B``) carry no gradient, which shrinks the batch-mean gradient;
    ``alpha`` restores its scale. ``B`` and ``M`` are batch-wide, so they are summed over
    ranks. The normaliser ``F_norm`` is 1 (the paper's default, as in verl); unlike verl,
    which counts non-zero raw rewards, ``M`` follows the paper's definition.
    """
    scores = _sequence_scores(inputs)
    _, mean, _ = _group_stats(scores, inputs.group_index)
    # Compare max and min rather than testing std > 0: the float mean of equal values may
    # differ from them in the last bit, which would also leave them a tiny advantage.
    informative = ~alike_groups(scores, inputs.group_index)
    centred = torch.where(informative, scores - mean, 0.0)
    # Every rank joins the sum, even one without rows.
    totals = reduce_sum(torch.stack([torch.ones_like(scores).sum(), informative.sum().double()]))
    alpha = totals[0] / totals[1].clamp(min=1)
    return _broadcast(alpha * centred, inputs.response_mask)


@ADVANTAGE_ESTIMATORS.implements("grpo_passk")
def grpo_passk_advantages(
    inputs: AdvantageInputs, settings: GRPOPassKSettings, *, reduce_sum: Reducer
) -> Tensor:
    """Pass@k: only the best sample of a group is credited, with ``(r_max - r_2nd) / std``.

    verl's ``grpo_passk``, after Tang et al. 2025 (arXiv:2503.19595, optimising inference-time
    objectives such as pass@k with RL): the group's objective is its best reward, and the
    leave-one-out advantage of that max statistic is ``max(all) - max(others)``, i.e. the
    margin over the runner-up for the arg-max and 0 for every other sample; it is then
    standardised by the group's (unbiased) std, as in GRPO. Ties for the maximum give a zero
    margin; the first sample in batch order is the arg-max.
    """
    scores = _sequence_scores(inputs)
    count, _, std = _group_stats(scores, inputs.group_index)
    onehot = _group_onehot(inputs.group_index)  # (G, B)
    member = onehot.to(torch.bool)
    best = _group_max(scores, member)  # (G,)
    at_best = member & (scores[None, :] == best[:, None])
    # The first sample of its group (in batch order) that reaches the maximum.
    winner = (at_best & (at_best.cumsum(dim=-1) == 1)).any(dim=0)  # (B,)
    runner_up = _group_max(torch.where(winner, -torch.inf, scores), member)
    # A group of one has no runner-up (-inf); its margin would be inf, and inf * 0 is NaN.
    margin = torch.where(torch.isfinite(runner_up), best - runner_up, 0.0) @ onehot  # (B,)
    adv = torch.where(winner & (count > 1), margin / (std + settings.eps), 0.0)
    return _broadcast(adv, inputs.response_mask)


def _token_returns(inputs: AdvantageInputs, by_turn: bool = True) -> Tensor:
    """``(B, T)`` undiscounted reward-to-go: the outcome reward on the last valid token (and
    an episode's turn rewards where paid, ``by_turn``) minus the KL penalty of every token
    from t on."""
    token_rewards = -_masked_kl(inputs) + _token_outcome(inputs, by_turn)
    return _discounted_returns(token_rewards, 1.0, inputs.response_mask)


@ADVANTAGE_ESTIMATORS.implements("optimal_token_baseline")
def optimal_token_baseline_advantages(
    inputs: AdvantageInputs, settings: OptimalTokenBaselineSettings, *, reduce_sum: Reducer
) -> Tensor:
    """Optimal token baseline: a per-position baseline weighted by each path's score energy.

    verl's ``optimal_token_baseline`` (the variance-optimal baseline of Greensmith et al.
    2004, "Variance Reduction Techniques for Gradient Estimates in RL", applied per token):
    ``B_t = sum_i G_it W_it / sum_i W_it`` over the group's samples still running at ``t``,
    with ``G_it`` the reward-to-go and ``W_it = sum_{j<=t} (1 - 2 pi_ij + sum_v pi_ij(v)^2)``
    the accumulated squared norm of the softmax score ``e_y - pi`` (its gradient w.r.t. the
    logits). ``A_it = G_it - B_t``. Where only one sample of the group is still running its
    baseline would be its own return, so it is 0 there (verl's ``handle_zero_tail``).

    We do not record ``sum_v pi(v)^2`` in rollout shards; without it the estimator uses the
    lower bound ``pi(y)^2`` (so ``w = (1 - pi)^2``), which is exact when the rest of the
    probability mass is spread thin and keeps ``w >= 0``. ``logprobs`` are required.
    """
    if inputs.logprobs is None:
        raise ValueError("optimal_token_baseline needs the behaviour logprobs (inputs.logprobs)")
    mask = inputs.response_mask
    pi = torch.exp(torch.where(mask, inputs.logprobs.to(torch.float64), 0.0))
    if inputs.sum_pi_squared is None:
        sum_sq = pi.square()
    else:
        sum_sq = inputs.sum_pi_squared.to(torch.float64)
    w = torch.where(mask, 1.0 - 2.0 * pi + sum_sq, 0.0)
    energy = w.cumsum(dim=-1)  # (B, T)
    returns = _token_returns(inputs)
    onehot = _group_onehot(inputs.group_index)  # (G, B)
    m = mask.to(torch.float64)
    num = onehot @ (returns * energy * m)  # (G, T)
    den = onehot @ (energy * m)
    running = onehot @ m  # samples of the group still running at t
    baseline = torch.where(running > 1, num / (den + settings.eps), 0.0)
    return torch.where(mask, returns - onehot.T @ baseline, 0.0)


@ADVANTAGE_ESTIMATORS.implements("remax")
def remax_advantages(
    inputs: AdvantageInputs, settings: ReMaxSettings, *, reduce_sum: Reducer
) -> Tensor:
    """ReMax: reward-to-go minus the reward of the prompt's greedy response. ``(B, T)``.

    Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models" (arXiv:2310.10505), Algorithm 1: REINFORCE with the
    greedy decoding's reward ``r(x, y_greedy)`` as the baseline. The return is the
    undiscounted reward-to-go (KL-in-reward penalties included, as in verl); the baseline
    is the greedy row's outcome reward. Every group must hold exactly one ``is_baseline``
    row; that row's advantage is 0 (it is never trained on).
    """
    flags = inputs.is_baseline
    if flags is None:
        raise ValueError("remax needs is_baseline rows (the rollout's greedy responses)")
    onehot = _group_onehot(inputs.group_index)  # (G, B)
    per_group = onehot @ flags.to(torch.float64)
    if bool((per_group != 1).any()):
        raise ValueError(
            f"remax needs exactly one baseline row per group, got {per_group.tolist()}"
        )
    baseline = (onehot @ torch.where(flags, inputs.rewards.to(torch.float64), 0.0)) @ onehot
    # The baseline is the greedy episode's whole return, so an episode's tokens are credited
    # with its whole return too (a later turn's reward-to-go would not match it).
    adv = _token_returns(inputs, by_turn=False) - baseline[:, None]
    keep = inputs.response_mask & ~flags[:, None]
    return torch.where(keep, adv, 0.0)


def _gae(inputs: AdvantageInputs, settings: GAESettings) -> GAEOutput:
    if inputs.values is None:
        raise ValueError("the gae estimator needs the critic's values (AdvantageInputs.values)")
    mask = inputs.response_mask
    if inputs.values.shape != mask.shape:
        raise ValueError(f"values must have shape {tuple(mask.shape)}, got {inputs.values.shape}")
    # The outcome on the last token and the KL penalty on every token, as REINFORCE++.
    token_rewards = -_masked_kl(inputs) + _token_outcome(inputs)
    return gae(
        token_rewards,
        inputs.values,
        mask,
        gamma=settings.gamma,
        lam=settings.lam,
        turn_starts=inputs.turn_starts,
        turn_gamma=settings.turn_gamma,
    )


@ADVANTAGE_ESTIMATORS.implements("gae")
def gae_advantages(
    inputs: AdvantageInputs, settings: GAESettings, *, reduce_sum: Reducer
) -> Tensor:
    """GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation") from the critic's per-token values and the outcome reward on the
    last token (minus the per-token KL penalty under KL-in-reward), then whitened over the
    valid tokens of the global batch (masked whitening, as verl). ``(B, T)``.

    With a 0/1 outcome and gamma = lam = 1 this is ``R - V_t`` before whitening.
    """
    adv = _gae(inputs, settings).advantages
    return masked_whiten(adv, inputs.response_mask, reduce_sum)


def gae_returns(inputs: AdvantageInputs, settings: AdvantageSettings) -> Tensor:
    """``(B, T)`` float64 targets of the critic: GAE advantages (before whitening) plus
    values, 0 on padding; the same quantities as `gae_advantages` uses with ``settings``
    (the run's estimator, whose trait ``needs_critic`` the config checked)."""
    if not isinstance(settings, GAESettings):
        raise ValueError(
            f"the critic's returns need the gae estimator's settings, got {type(settings).__name__}"
        )
    return _gae(inputs, settings).returns


def compute_advantages(
    settings: AdvantageSettings,
    inputs: AdvantageInputs,
    *,
    reduce_sum: Reducer = identity,
) -> Tensor:
    """Compute per-token advantages with the estimator ``settings`` selects (its class).

    Args:
        settings: the estimator's settings (e.g. ``GRPOSettings(eps=1e-6)``), passed to it
            unchanged; their checks ran when they were built.
        inputs: this rank's batch; ``response_mask`` is ``(B, T)``.
        reduce_sum: cross-rank sum, used by the batch-wide statistics only.

    Returns:
        ``(B, T)`` float64 advantages, exactly 0 where ``response_mask`` is False.
    """
    entry = ADVANTAGE_ESTIMATORS.of(settings)
    estimator = ADVANTAGE_ESTIMATORS.function(settings)
    _validate(inputs)
    flags = inputs.is_baseline
    if flags is not None and bool(flags.any()) and not entry.traits.needs_baseline_rollout:
        # Baseline rows would otherwise join their group's statistics as ordinary samples.
        raise ValueError(f"advantage estimator {entry.name!r} takes no baseline rows")
    adv = estimator(inputs, settings, reduce_sum=reduce_sum)
    if entry.traits.alike_groups_zero:
        adv = torch.where(
            alike_groups(_sequence_scores(inputs), inputs.group_index)[:, None], 0.0, adv
        )
    return adv


def alike_groups(scores: Tensor, group_index: Tensor) -> Tensor:
    """``(B,)`` bool: the sample's group has all its scores equal (compared as max and
    min, so it is exact: no float mean or standard deviation is tested)."""
    onehot = _group_onehot(group_index)
    member = onehot.to(torch.bool)
    spread = _group_max(scores, member) > -_group_max(-scores, member)
    return (spread.to(torch.float64) @ onehot) == 0


def compute_episode_advantages(
    settings: AdvantageSettings,
    inputs: AdvantageInputs,
    last_row: Tensor,
    *,
    reduce_sum: Reducer = identity,
) -> Tensor:
    """`compute_advantages` for a batch where an episode may be several rows (an agent's
    sequences, `rftpipe.storage.branch_rows`).

    The estimator sees one row per episode, its last (``last_row[i] == i``), so group
    statistics count episodes, not sequences; each earlier row gets the one advantage its
    episode's last row got, on its own valid tokens. Only estimators whose trait
    ``per_sequence`` is set give a row one advantage, and a per-token KL penalty would
    make it vary too: both are refused (the config refuses them at load).

    Args:
        last_row: ``(B,)`` int64, the batch index of each row's episode's last row.

    Returns:
        ``(B, T)`` float64 advantages, exactly 0 where ``response_mask`` is False.
    """
    entry = ADVANTAGE_ESTIMATORS.of(settings)
    if not entry.traits.per_sequence or inputs.token_kl_penalty is not None:
        raise ValueError(
            f"advantage estimator {entry.name!r} with a per-token KL penalty or per-token "
            "advantages cannot give an episode's earlier sequences its advantage"
        )
    rows = torch.arange(last_row.numel(), device=last_row.device)
    last = torch.nonzero(last_row == rows).flatten()
    fields: dict[str, Tensor | None] = {
        f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)
    }
    sub = dataclasses.replace(inputs, **{k: v[last] for k, v in fields.items() if v is not None})
    adv_last = compute_advantages(settings, sub, reduce_sum=reduce_sum)
    mask = sub.response_mask
    # The row's one advantage is on every valid token: read it at the first (0 for an
    # empty row).
    first = mask.to(torch.int64).argmax(dim=-1, keepdim=True)
    value = torch.where(mask.any(dim=-1), adv_last.gather(-1, first).squeeze(-1), 0.0)
    per_row = torch.zeros(rows.numel(), dtype=torch.float64, device=last_row.device)
    per_row[last] = value
    adv = _broadcast(per_row[last_row], inputs.response_mask)
    adv[last] = adv_last
    return adv
