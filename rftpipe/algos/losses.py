"""Token-level policy-gradient losses, KL estimators, loss aggregation and logit utilities.

Policy losses and KL estimators are entries of the registries :data:`POLICY_LOSSES` and
:data:`KL_ESTIMATORS`, declared with their settings classes and traits in the torch-free
:mod:`rftpipe.algos.variants`; this module attaches their functions
(``@POLICY_LOSSES.implements(name)``). Aggregations are looked up by name in
:data:`AGGREGATIONS`. All per-token functions take and return ``(B, T)`` tensors; padding is
described by a ``(B, T)`` bool mask that is True on valid response tokens.

Conventions shared by every variant: a log ratio is clamped to ``+-LOG_RATIO_CLAMP`` before
``exp`` (a clamped token has no gradient); padding never reaches ``exp`` or the gradient; a
variant's settings arrive as the instance of its settings class that the config holds (its
checks ran when it was built); which aggregation a loss needs is a trait of its entry
(checked at config load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

# The entries live in the torch-free `variants` module so the config schema can import them.
from rftpipe.algos.variants import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AggregationName,
    CISPOSettings,
    ClipCovSettings,
    ClipRangeSettings,
    GeoMeanSettings,
    GPGLossSettings,
    GSPOSettings,
    KLCovSettings,
    KLEstimatorSettings,
    PolicyLossSettings,
    PPOClipSettings,
    SAPOSettings,
)

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AggregationName",
    "Aggregator",
    "KLEstimator",
    "PolicyLoss",
    "PolicyLossOutputs",
    "aggregate",
    "entropy_from_logits",
    "entropy_top_mask",
    "gather_logprobs",
    "kl_estimate",
    "policy_loss",
    "ppo_clip_loss",
]

# Rows of (B*T, V) logits processed at once, bounding the temporaries of entropy/log-prob.
DEFAULT_CHUNK_ROWS = 1024


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL Divergence"), for samples drawn from the policy.
# ---------------------------------------------------------------------------------------------


# exp() of a log ratio beyond this overflows float32 (e^88) long before it means anything;
# verl clamps at the same bound. Gradients through a clamped value are zero, which is the
# point: a token whose policies disagree by e^20 carries no usable signal.
LOG_RATIO_CLAMP = 20.0

# k3 grows like e^x; verl caps the estimate at 10 so one outlier token cannot dominate the
# KL term (and its gradient is cut there, like any clamp).
K3_CAP = 10.0


class KLEstimator(Protocol):
    """Signature shared by the functions of :data:`KL_ESTIMATORS`."""

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings
    ) -> Tensor: ...


@KL_ESTIMATORS.implements("k1")
def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
    return logprobs - ref_logprobs


@KL_ESTIMATORS.implements("k2")
def _kl_k2(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.implements("k3")
def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # expm1(x) - x equals exp(x) - 1 - x but keeps precision when the policies are close.
    return (torch.expm1(log_ratio) - log_ratio).clamp(max=K3_CAP)


@KL_ESTIMATORS.implements("abs")
def _kl_abs(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
    return (logprobs - ref_logprobs).abs()


def _straight_through(value: KLEstimator) -> KLEstimator:
    """The value of ``value``'s estimate with the gradient of k2.

    verl's ``kl_penalty="k3+"`` (and ``k1+``, ``abs+``): k1 and k3 are unbiased estimates of
    the KL's *value*, but their gradients are not the KL's gradient; k2's gradient,
    ``(log pi - log ref) * grad log pi``, is the unbiased one for samples from pi (Tang and
    Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL"). The sum
    ``k2 - sg(k2) + sg(value)`` reports the one and backpropagates the other.
    """

    def estimate(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
        grad_part = _kl_k2(logprobs, ref_logprobs, settings)
        return grad_part - grad_part.detach() + value(logprobs, ref_logprobs, settings).detach()

    return estimate


KL_ESTIMATORS.implements("k1_st")(_straight_through(_kl_k1))
KL_ESTIMATORS.implements("k3_st")(_straight_through(_kl_k3))
KL_ESTIMATORS.implements("abs_st")(_straight_through(_kl_abs))


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, settings: KLEstimatorSettings) -> Tensor:
    """Per-token estimate of KL(policy || reference) for tokens sampled from the policy.

    Args:
        logprobs: ``(B, T)`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``(B, T)`` log-probabilities of the same tokens under the reference.
        settings: the estimator's settings (its class selects it): k1 (unbiased, can be
            negative), k2 (low variance, biased), k3 (unbiased and non-negative; log ratio
            clamped to +-20, value capped at 10), abs (``|log pi - log ref|``), or
            ``<name>_st``: that estimate's value with k2's gradient (straight-through).

    Returns:
        ``(B, T)`` per-token estimates; masking is left to the caller.
    """
    return KL_ESTIMATORS.function(settings)(logprobs, ref_logprobs, settings)


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PolicyLossOutputs:
    """Per-token policy loss and clipping diagnostics.

    Attributes:
        loss: ``(B, T)`` per-token loss, not aggregated; 0 where the mask is False.
        clipped: ``(B, T)`` bool; valid tokens where the variant's clip (or, for Clip-Cov,
            its covariance clip) was active.
        dual_clipped: ``(B, T)`` bool; valid tokens where the dual-clip bound was active.
        ratio: ``(B, T)`` importance ratio ``pi / pi_old`` the loss used (per token, or the
            response's sequence ratio on each of its tokens); 1 where the mask is False.
    """

    loss: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    ratio: Tensor


class PolicyLoss(Protocol):
    """Signature shared by the functions of :data:`POLICY_LOSSES`."""

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        settings: PolicyLossSettings,
    ) -> PolicyLossOutputs: ...


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: PolicyLossSettings,
) -> PolicyLossOutputs:
    """The per-token loss of the policy loss ``settings`` selects (its class), with them."""
    return POLICY_LOSSES.function(settings)(logprobs, old_logprobs, advantages, mask, settings)


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log(pi / pi_old)`` clamped to ``+-LOG_RATIO_CLAMP``, 0 at padding.

    Padding may hold arbitrary log-probs; exp() of them can overflow, and inf * 0 would
    leak NaN into the gradient even after masking, so they are neutralised first.
    """
    return torch.where(mask, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _no_flags(mask: Tensor) -> Tensor:
    return torch.zeros_like(mask)


def _clamp(ratio: Tensor, clip: ClipRangeSettings) -> Tensor:
    """``ratio`` clipped to ``[1 - clip_low, 1 + clip_high]``."""
    return ratio.clamp(1.0 - clip.clip_low, 1.0 + clip.clip_high)


@POLICY_LOSSES.implements("ppo_clip")
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: PPOClipSettings,
) -> PolicyLossOutputs:
    """PPO clipped surrogate with an asymmetric clip range and optional dual clip.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; clip-higher from DAPO
    (Yu et al. 2025). ``loss = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))``;
    with ``dual_clip = c`` tokens with ``A < 0`` are further bounded by ``-A * c`` (Ye et
    al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"), so that a huge ratio
    on a bad action cannot dominate the update. The log ratio is clamped to +-20 first.

    Args:
        logprobs: ``(B, T)`` current-policy log-probabilities (carry the gradient).
        old_logprobs: ``(B, T)`` behaviour-policy log-probabilities.
        advantages: ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` bool, True on valid tokens.
        settings: ``clip_low`` (ratio floor ``1 - clip_low``), ``clip_high`` (ratio ceiling
            ``1 + clip_high``) and ``dual_clip`` (``c > 1``, or None to disable).

    Returns:
        :class:`PolicyLossOutputs` with ``(B, T)`` fields. Mixed input dtypes follow torch
        type promotion (e.g. float64 advantages give a float64 loss).
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask))
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * _clamp(ratio, settings)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    clipped = (pg_clipped > pg_unclipped) & mask
    dual_clipped = _no_flags(mask)
    if settings.dual_clip is not None:
        bound = -advantages * settings.dual_clip
        dual_clipped = (advantages < 0) & (loss > bound) & mask
        loss = torch.where(dual_clipped, bound, loss)
    loss = torch.where(mask, loss, 0.0)
    return PolicyLossOutputs(loss=loss, clipped=clipped, dual_clipped=dual_clipped, ratio=ratio)


def _lengths(mask: Tensor) -> Tensor:
    """``(B, 1)`` valid tokens per row, at least 1 so an empty row divides to 0, not NaN."""
    return mask.sum(dim=-1, keepdim=True).clamp(min=1)


@POLICY_LOSSES.implements("gspo")
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: GSPOSettings,
) -> PolicyLossOutputs:
    """GSPO: PPO's clip on the sequence's geometric-mean ratio.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), token form
    (GSPO-token, Eq. 13): ``s_it = sg[s_i] * pi_t / sg[pi_t]`` with
    ``s_i = exp(mean_t log(pi_t / pi_old_t))``, so every token of a response has the value
    ``s_i`` and the gradient ``s_i * grad log pi_t``; then
    ``loss = max(-A s_it, -A clamp(s_it, 1 - clip_low, 1 + clip_high))``. The paper's ranges
    are far narrower than PPO's (3e-4 / 4e-4). No dual clip; ``seq-mean-token-mean``
    aggregation is the paper's. The log ratio is clamped to +-20 (verl: at 10).
    """
    token_log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    seq = token_log_ratio.sum(dim=-1, keepdim=True) / _lengths(mask)
    live = torch.where(mask, logprobs, 0.0)
    # The order keeps precision: (lp - sg(lp)) is exactly 0 in value, then the sequence term.
    # Clamped like every log ratio here: beyond +-20 the token carries no gradient.
    log_ratio = (live - live.detach() + seq.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * _clamp(ratio, settings)
    loss = torch.where(mask, torch.maximum(pg_unclipped, pg_clipped), 0.0)
    clipped = (pg_clipped > pg_unclipped) & mask
    ratio = torch.where(mask, ratio, 1.0)
    return PolicyLossOutputs(loss=loss, clipped=clipped, dual_clipped=_no_flags(mask), ratio=ratio)


@POLICY_LOSSES.implements("cispo")
def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: CISPOSettings,
) -> PolicyLossOutputs:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance weight.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585), Eq. 4-5: ``loss = -sg(clamp(r, 1 - clip_low,
    1 + clip_high)) * A * log pi``. Unlike PPO no token loses its gradient: the clip bounds
    the weight, not the surrogate. (The paper sets no lower bound, i.e. ``clip_low``
    near 1; verl, like us, applies both.) The loss value is not a surrogate of the
    objective (it carries ``log pi``); only its gradient ``-w A grad log pi`` matters.
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask))
    weight = _clamp(ratio, settings).detach()
    loss = torch.where(mask, -weight * advantages * logprobs, 0.0)
    clipped = (ratio != weight) & mask
    return PolicyLossOutputs(loss=loss, clipped=clipped, dual_clipped=_no_flags(mask), ratio=ratio)


@POLICY_LOSSES.implements("sapo")
def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: SAPOSettings,
) -> PolicyLossOutputs:
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of a hard clip.

    Gao et al. (Qwen) 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347):
    ``loss = -f(r) * A`` with ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``, ``tau`` =
    ``tau_pos`` for ``A > 0`` else ``tau_neg`` (a larger negative temperature
    damps negative updates faster, which the paper finds stabilising). ``f'(1) = 1``, so on
    policy the gradient is plain policy gradient; far from ``r = 1`` it decays smoothly to 0
    instead of being cut.
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask))
    # Scalars in where() would give the default dtype (float32); keep the advantages' own.
    tau_pos, tau_neg = (advantages.new_tensor(t) for t in (settings.tau_pos, settings.tau_neg))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = torch.where(mask, -gate * advantages, 0.0)
    return PolicyLossOutputs(
        loss=loss, clipped=_no_flags(mask), dual_clipped=_no_flags(mask), ratio=ratio
    )


@POLICY_LOSSES.implements("gpg")
def gpg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: GPGLossSettings,
) -> PolicyLossOutputs:
    """GPG: the plain policy gradient ``-A * log pi``, no ratio and no clip.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv:2504.02546). On policy (one PPO epoch, one mini-batch) its gradient
    equals PPO's; off policy it is biased, as the paper accepts for simplicity.
    """
    ratio = torch.exp(_log_ratio(logprobs, old_logprobs, mask))
    loss = torch.where(mask, -advantages * logprobs, 0.0)
    return PolicyLossOutputs(
        loss=loss, clipped=_no_flags(mask), dual_clipped=_no_flags(mask), ratio=ratio
    )


def _covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``(B, T)`` detached ``(A - mean A)(log pi - mean log pi)`` over the valid tokens.

    Cui et al. 2025 show the entropy change of a softmax policy follows the covariance of a
    token's log-probability and its advantage; the means are over this call's valid tokens
    (the micro-batch, as in verl), so these variants depend on the micro-batch split.
    """
    lp = torch.where(mask, logprobs.detach(), 0.0).to(torch.float64)
    adv = torch.where(mask, advantages.detach(), 0.0).to(torch.float64)
    n = mask.sum().clamp(min=1)
    return torch.where(mask, (adv - adv.sum() / n) * (lp - lp.sum() / n), -torch.inf)


def _top_tokens(
    score: Tensor, eligible: Tensor, ratio: float, n_valid: int, *, round_up: bool = False
) -> Tensor:
    """``(B, T)`` bool: the ``max(1, int(ratio * n_valid))`` eligible tokens of highest score
    (``ceil`` with ``round_up``; fewer if fewer are eligible; none without valid tokens)."""
    # The small slack keeps e.g. ceil(0.3 * 10) at 3 despite 0.3 * 10 == 3.0000000000000004.
    wanted = math.ceil(ratio * n_valid - 1e-9) if round_up else int(ratio * n_valid)
    k = min(max(1, wanted), int(eligible.sum())) if n_valid else 0
    picked = torch.zeros_like(eligible)
    if k:
        flat = torch.where(eligible, score, -torch.inf).reshape(-1)
        # stable=True: ties are broken by position, so the choice is reproducible.
        order = torch.sort(flat, descending=True, stable=True).indices[:k]
        picked.view(-1)[order] = True
    return picked


@POLICY_LOSSES.implements("clip_cov")
def clip_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: ClipCovSettings,
) -> PolicyLossOutputs:
    """Clip-Cov: PPO, plus the gradient cut on a few high-covariance tokens.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv:2505.22617), Eq. 11: among valid tokens PPO did not already clip whose
    covariance lies in ``(lb, ub)``, a share ``ratio`` of the valid
    tokens get no gradient; this stops the covariance-driven entropy collapse. The paper
    picks them at random; we take the highest-covariance ones so the step is deterministic
    (resumes are bitwise). The PPO part is :func:`ppo_clip_loss`, whose dual clip is off
    here unless set (verl's clip_cov has none).
    """
    # ClipCovSettings derives from PPOClipSettings: its clip range and dual clip are PPO's.
    out = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, settings)
    cov = _covariance(logprobs, advantages, mask)
    eligible = mask & ~out.clipped & (cov > settings.lb) & (cov < settings.ub)
    cut = _top_tokens(cov, eligible, settings.ratio, int(mask.sum()))
    # Multiplying by a constant 0 keeps the token's value out of the loss and its gradient.
    loss = torch.where(cut, torch.zeros_like(out.loss), out.loss)
    return PolicyLossOutputs(
        loss=loss, clipped=out.clipped | cut, dual_clipped=out.dual_clipped, ratio=out.ratio
    )


@POLICY_LOSSES.implements("kl_cov")
def kl_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: KLCovSettings,
) -> PolicyLossOutputs:
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the highest-covariance tokens.

    Cui et al. 2025 (arXiv:2505.22617), Eq. 12: ``loss = -A r`` on every token, and
    ``-A r + coef * |log pi - log pi_old|`` on the top share ``ratio`` of valid tokens
    by covariance. No clip: the penalty is the trust region. ``clipped`` marks the
    penalised tokens.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    cov = _covariance(logprobs, advantages, mask)
    penalised = _top_tokens(cov, mask, settings.ratio, int(mask.sum()))
    loss = -advantages * ratio + torch.where(penalised, settings.coef * log_ratio.abs(), 0.0)
    loss = torch.where(mask, loss, 0.0)
    return PolicyLossOutputs(
        loss=loss, clipped=penalised, dual_clipped=_no_flags(mask), ratio=ratio
    )


@POLICY_LOSSES.implements("geo_mean")
def geo_mean_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: GeoMeanSettings,
) -> PolicyLossOutputs:
    """GMPO: maximise the geometric mean of the token ratios times the sequence advantage.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673), Eq. 4: per
    token, the log ratio is clipped in log space to ``[-clip_low, clip_high]`` on the
    pessimistic side (``sgn(A) * min(sgn(A) l, sgn(A) clip(l))``), the response's ratio is
    ``exp(mean_t clipped l_t)``, and ``loss_i = -mean_t(A) * ratio_i``. The sequence loss is
    written on each of the response's tokens, so ``seq-mean-token-mean`` (enforced by the
    config) gives the paper's mean over responses. Note the clip range is in log space
    (the paper uses 0.4, i.e. ratios in ``[e^-0.4, e^0.4]``).
    """
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-settings.clip_low, settings.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = _lengths(mask)
    seq_ratio = torch.exp(torch.where(mask, pessimistic, 0.0).sum(dim=-1, keepdim=True) / lengths)
    seq_adv = torch.where(mask, advantages, 0.0).sum(dim=-1, keepdim=True) / lengths
    loss = torch.where(mask, (-seq_adv * seq_ratio).expand_as(log_ratio), 0.0)
    ratio = torch.where(mask, seq_ratio.expand_as(log_ratio), 1.0)
    clipped = (log_ratio != clamped) & (pessimistic == clamped) & mask
    return PolicyLossOutputs(loss=loss, clipped=clipped, dual_clipped=_no_flags(mask), ratio=ratio)


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


class Aggregator(Protocol):
    """Signature shared by all entries of :data:`AGGREGATIONS`."""

    def __call__(
        self,
        loss: Tensor,
        mask: Tensor,
        *,
        num_tokens: float | None,
        num_seqs: float | None,
        norm_len: float | None = None,
    ) -> Tensor: ...


def _nonzero(count: float | Tensor) -> float | Tensor:
    """Denominator guard: an empty batch yields a 0 loss rather than NaN."""
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return count if count > 0 else 1.0


def _row_sums(loss: Tensor, mask: Tensor) -> Tensor:
    """``(B, T)`` -> ``(B,)`` sum over valid tokens; ``where`` (not ``*``) drops NaN padding."""
    return torch.where(mask, loss, 0.0).sum(dim=-1)


def _num_rows(mask: Tensor) -> int:
    """Every row is a sequence, an empty response included (it adds 0 to the numerator)."""
    return mask.shape[0]


def _token_mean(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None,
    num_seqs: float | None,
    norm_len: float | None = None,
) -> Tensor:
    denom = mask.sum() if num_tokens is None else num_tokens
    return _row_sums(loss, mask).sum() / _nonzero(denom)


def _seq_mean_token_mean(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None,
    num_seqs: float | None,
    norm_len: float | None = None,
) -> Tensor:
    lengths = mask.sum(dim=-1).clamp(min=1)
    denom = _num_rows(mask) if num_seqs is None else num_seqs
    return (_row_sums(loss, mask) / lengths).sum() / _nonzero(denom)


def _seq_mean_token_sum(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None,
    num_seqs: float | None,
    norm_len: float | None = None,
) -> Tensor:
    denom = _num_rows(mask) if num_seqs is None else num_seqs
    return _row_sums(loss, mask).sum() / _nonzero(denom)


def _seq_mean_token_sum_norm(
    loss: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None,
    num_seqs: float | None,
    norm_len: float | None = None,
) -> Tensor:
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
    # dividing each response by a constant instead of its own length removes the bias that
    # favours long wrong answers. The constant is the response budget (train stage:
    # rollout.max_new_tokens); without one, the padded width, as verl falls back to.
    # As verl's agg_loss (sum / loss_scale_factor), the sums are not divided by the number of
    # responses as well: that would make the loss B times smaller than verl's, a silent
    # learning-rate change for settings ported from it. No count is needed, so the shares of
    # all micro-batches and ranks add up to the whole mini-batch's value by themselves.
    width = float(mask.shape[-1]) if norm_len is None else norm_len
    return _row_sums(loss, mask).sum() / _nonzero(width)


AGGREGATIONS: dict[AggregationName, Aggregator] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: AggregationName,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean``: ``sum(loss * mask) / num_tokens``
    - ``seq-mean-token-mean``: ``sum_i(sum_t(loss * mask)_i / len_i) / num_seqs``
    - ``seq-mean-token-sum``: ``sum(loss * mask) / num_seqs``
    - ``seq-mean-token-sum-norm``: ``sum(loss * mask) / norm_len`` (Dr. GRPO; verl's
      ``agg_loss`` with ``loss_scale_factor = norm_len``: not divided by the number of
      sequences, despite the name)

    The result is a *share* of a global mean: pass the GLOBAL ``num_tokens`` / ``num_seqs``
    (over all micro-batches of the mini-batch and all ranks) and the summed gradients of all
    micro-batches and ranks equal those of the whole mini-batch in one piece, i.e. verl's
    ``agg_loss`` on the whole mini-batch.

    Args:
        loss: ``(B, T)`` per-token loss; values at padding are ignored (even NaN).
        mask: ``(B, T)`` bool, True on valid tokens.
        mode: key of :data:`AGGREGATIONS`.
        num_tokens: denominator for ``token-mean``; defaults to ``mask.sum()``.
        num_seqs: denominator for ``seq-mean-token-mean`` and ``seq-mean-token-sum``;
            defaults to the number of rows ``B``, empty rows included (count global
            sequences the same way).
        norm_len: the constant length of ``seq-mean-token-sum-norm``; defaults to the padded
            width ``T`` (pass the response budget so the scale does not move per batch).

    Returns:
        Scalar tensor. Rows without valid tokens contribute 0; an empty batch gives 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {list(AGGREGATIONS)}")
    return AGGREGATIONS[mode](
        loss, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len
    )


def entropy_top_mask(entropy: Tensor, mask: Tensor, top: float) -> Tensor:
    """``(B, T)`` bool: the valid tokens among the top ``top`` share by entropy.

    Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
    RL for LLM Reasoning" (arXiv:2506.01939): training only on the ~20% highest-entropy
    ("forking") tokens matches or beats full-token training. ``ceil(top * n_valid)`` tokens
    are kept (ties broken by position); ``top = 1`` returns ``mask`` itself. The ranking is
    over this call's tokens (the micro-batch), since the entropies exist only there.
    """
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top must lie in (0, 1], got {top}")
    if top == 1.0:
        return mask
    n_valid = int(mask.sum())
    return _top_tokens(entropy.detach(), mask, top, n_valid, round_up=True)


# ---------------------------------------------------------------------------------------------
# Logit utilities
# ---------------------------------------------------------------------------------------------


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """Half-precision softmax statistics lose too much; upcast (per chunk) to float32."""
    return torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype


def _entropy_rows(logits: Tensor) -> Tensor:
    """``(N, V)`` -> ``(N,)``: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``."""
    z = logits.to(_compute_dtype(logits))
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, *, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Tensor:
    """Entropy of the categorical distribution at every position.

    Processed in chunks of ``chunk_rows`` positions so the softmax temporaries (and the
    float32 upcast of half-precision logits) never span the whole ``(B, T, V)`` tensor.

    Args:
        logits: ``(B, T, V)`` unnormalised logits.
        chunk_rows: positions per chunk.

    Returns:
        ``(B, T)`` entropies (float32 for half-precision inputs, else the input dtype).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(logits.shape[:-1], dtype=_compute_dtype(logits))
    parts = [_entropy_rows(chunk) for chunk in flat.split(chunk_rows)]
    return torch.cat(parts).reshape(logits.shape[:-1])


def _logprob_rows(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """``(N, V), (N,)`` -> ``(N,)`` log-softmax of ``logits / temperature`` at ``tokens``."""
    z = logits.to(_compute_dtype(logits)) / temperature
    picked = z.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def gather_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    Computed as ``z[token] - logsumexp(z)`` chunk by chunk, so no full ``(B, T, V)``
    log-softmax (or temperature-scaled copy) is materialised.

    Args:
        logits: ``(B, T, V)`` unnormalised logits.
        tokens: ``(B, T)`` int64 token ids.
        temperature: sampling temperature the tokens were drawn with; must be > 0.
        chunk_rows: positions per chunk.

    Returns:
        ``(B, T)`` log-probabilities (float32 for half-precision inputs).
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits {tuple(logits.shape)}")
    flat = logits.reshape(-1, logits.shape[-1])
    flat_tokens = tokens.reshape(-1)
    if flat.shape[0] == 0:
        return flat.new_zeros(tokens.shape, dtype=_compute_dtype(logits))
    parts = [
        _logprob_rows(chunk, chunk_tokens, temperature)
        for chunk, chunk_tokens in zip(
            flat.split(chunk_rows), flat_tokens.split(chunk_rows), strict=True
        )
    ]
    return torch.cat(parts).reshape(tokens.shape)
