"""Token-level policy-gradient losses, KL estimators, loss aggregation and logit utilities.

Variants are looked up by name in :data:`KL_ESTIMATORS`, :data:`POLICY_LOSSES` and
:data:`AGGREGATIONS`. All per-token functions take and return ``(B, T)`` tensors; padding is
described by a ``(B, T)`` bool mask that is True on valid response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

# The names live in the torch-free `names` module so the config schema can import them.
from rftpipe.algos.names import AggregationName, KLEstimatorName, PolicyLossName

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AggregationName",
    "Aggregator",
    "KLEstimatorName",
    "PolicyLoss",
    "PolicyLossName",
    "PolicyLossOutputs",
    "aggregate",
    "entropy_from_logits",
    "gather_logprobs",
    "kl_estimate",
    "ppo_clip_loss",
]

# Rows of (B*T, V) logits processed at once, bounding the temporaries of entropy/log-prob.
DEFAULT_CHUNK_ROWS = 1024


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL Divergence"), for samples drawn from the policy.
# ---------------------------------------------------------------------------------------------


def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return 0.5 * (logprobs - ref_logprobs).square()


def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_ratio = ref_logprobs - logprobs
    # expm1(x) - x equals exp(x) - 1 - x but keeps precision when the policies are close.
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[KLEstimatorName, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimatorName) -> Tensor:
    """Per-token estimate of KL(policy || reference) for tokens sampled from the policy.

    Args:
        logprobs: ``(B, T)`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``(B, T)`` log-probabilities of the same tokens under the reference.
        kind: ``"k1"`` (unbiased, can be negative), ``"k2"`` (low variance, biased) or
            ``"k3"`` (unbiased and non-negative).

    Returns:
        ``(B, T)`` per-token estimates; masking is left to the caller.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PolicyLossOutputs:
    """Per-token policy loss and clipping diagnostics.

    Attributes:
        loss: ``(B, T)`` per-token loss, not aggregated; 0 where the mask is False.
        clipped: ``(B, T)`` bool; valid tokens where the ratio clip was active.
        dual_clipped: ``(B, T)`` bool; valid tokens where the dual-clip bound was active.
        ratio: ``(B, T)`` importance ratio ``pi / pi_old``; 1 where the mask is False.
    """

    loss: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    ratio: Tensor


class PolicyLoss(Protocol):
    """Signature shared by all entries of :data:`POLICY_LOSSES`."""

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None,
    ) -> PolicyLossOutputs: ...


def _check_clip_args(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must lie in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be non-negative, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> PolicyLossOutputs:
    """PPO clipped surrogate with an asymmetric clip range and optional dual clip.

    ``loss = max(-A * r, -A * clamp(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c``
    tokens with ``A < 0`` are further bounded by ``-A * c`` (Ye et al., 2020), so that a huge
    ratio on a bad action cannot dominate the update.

    Args:
        logprobs: ``(B, T)`` current-policy log-probabilities (carry the gradient).
        old_logprobs: ``(B, T)`` behaviour-policy log-probabilities.
        advantages: ``(B, T)`` per-token advantages.
        mask: ``(B, T)`` bool, True on valid tokens.
        clip_low: lower clip offset, ratio floor ``1 - clip_low``.
        clip_high: upper clip offset, ratio ceiling ``1 + clip_high``.
        dual_clip: constant ``c > 1`` or None to disable.

    Returns:
        :class:`PolicyLossOutputs` with ``(B, T)`` fields. Mixed input dtypes follow torch
        type promotion (e.g. float64 advantages give a float64 loss).
    """
    _check_clip_args(clip_low, clip_high, dual_clip)
    # Padding may hold arbitrary log-probs; exp() of them can overflow, and inf * 0 would
    # leak NaN into the gradient even after masking, so neutralise them before exp().
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    clipped = (pg_clipped > pg_unclipped) & mask
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > bound) & mask
        loss = torch.where(dual_clipped, bound, loss)
    loss = torch.where(mask, loss, 0.0)
    return PolicyLossOutputs(loss=loss, clipped=clipped, dual_clipped=dual_clipped, ratio=ratio)


POLICY_LOSSES: dict[PolicyLossName, PolicyLoss] = {
    "ppo_clip": ppo_clip_loss,
}


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


class Aggregator(Protocol):
    """Signature shared by all entries of :data:`AGGREGATIONS`."""

    def __call__(
        self, loss: Tensor, mask: Tensor, *, num_tokens: float | None, num_seqs: float | None
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
    loss: Tensor, mask: Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> Tensor:
    denom = mask.sum() if num_tokens is None else num_tokens
    return _row_sums(loss, mask).sum() / _nonzero(denom)


def _seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> Tensor:
    lengths = mask.sum(dim=-1).clamp(min=1)
    denom = _num_rows(mask) if num_seqs is None else num_seqs
    return (_row_sums(loss, mask) / lengths).sum() / _nonzero(denom)


def _seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, num_tokens: float | None, num_seqs: float | None
) -> Tensor:
    denom = _num_rows(mask) if num_seqs is None else num_seqs
    return _row_sums(loss, mask).sum() / _nonzero(denom)


AGGREGATIONS: dict[AggregationName, Aggregator] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: AggregationName,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean``: ``sum(loss * mask) / num_tokens``
    - ``seq-mean-token-mean``: ``sum_i(sum_t(loss * mask)_i / len_i) / num_seqs``
    - ``seq-mean-token-sum``: ``sum(loss * mask) / num_seqs``

    The result is a *share* of a global mean: pass the GLOBAL ``num_tokens`` / ``num_seqs``
    (over all micro-batches of the mini-batch and all ranks) and the summed gradients of all
    micro-batches and ranks equal those of the whole mini-batch in one piece.

    Args:
        loss: ``(B, T)`` per-token loss; values at padding are ignored (even NaN).
        mask: ``(B, T)`` bool, True on valid tokens.
        mode: key of :data:`AGGREGATIONS`.
        num_tokens: denominator for ``token-mean``; defaults to ``mask.sum()``.
        num_seqs: denominator for the ``seq-mean-*`` modes; defaults to the number of rows
            ``B``, empty rows included (count global sequences the same way).

    Returns:
        Scalar tensor. Rows without valid tokens contribute 0; an empty batch gives 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {list(AGGREGATIONS)}")
    return AGGREGATIONS[mode](loss, mask, num_tokens=num_tokens, num_seqs=num_seqs)


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
