"""Rollout-training mismatch corrections: per-token weights on the policy loss.

A serving engine (vLLM, SGLang) samples with kernels, precision and batching of its own, so
the logprobs it records (``pi_rollout``) differ from the trainer's forward over the same
weights (``pi_old``, recomputed by the actor before the step's first update). PPO's ratio
then uses ``pi_old`` and these corrections reweight each token's policy loss by a function
of ``pi_old / pi_rollout``, treating the rollout engine as a behaviour policy.

Each variant is an entry of :data:`~rftpipe.algos.variants.ROLLOUT_CORRECTIONS` (its name
and settings class there) whose function is attached here; :func:`correction_weights` runs
the one a settings instance selects. Inputs and outputs are
``(B, T)`` tensors with a bool mask that is True on valid response tokens; the weights are
computed under no gradient (they are constants of the loss, like the advantages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from rftpipe.algos.variants import (
    ROLLOUT_CORRECTIONS,
    BandSettings,
    IcePopSettings,
    NoCorrectionSettings,
    RolloutCorrectionSettings,
    SeqTISSettings,
    TISSettings,
    TokenMaskSettings,
)

__all__ = [
    "CorrectionOutputs",
    "RolloutCorrection",
    "correction_weights",
    "icepop_weights",
    "no_correction",
    "seq_tis_weights",
    "tis_weights",
    "token_mask_weights",
]


@dataclass(frozen=True, kw_only=True)
class CorrectionOutputs:
    """Per-token loss weights and which tokens they cut.

    Attributes:
        weight: ``(B, T)`` detached weights multiplying the per-token policy loss; 1 where
            the mask is False.
        masked: ``(B, T)`` bool; valid tokens whose weight was truncated (TIS) or zeroed
            (IcePop, token mask).
    """

    weight: Tensor
    masked: Tensor


class RolloutCorrection(Protocol):
    """Signature shared by all functions of :data:`ROLLOUT_CORRECTIONS`."""

    def __call__(
        self,
        old_logprobs: Tensor,
        rollout_logprobs: Tensor,
        mask: Tensor,
        settings: Any,
    ) -> CorrectionOutputs: ...


def _log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log(pi_old / pi_rollout)``, detached, 0 at padding (which may hold garbage)."""
    return torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)


@ROLLOUT_CORRECTIONS.implements("none")
def no_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, settings: NoCorrectionSettings
) -> CorrectionOutputs:
    """Weight 1 everywhere: the rollout logprobs are taken as the actor's own."""
    ones = torch.ones_like(old_logprobs.detach())
    return CorrectionOutputs(weight=ones, masked=torch.zeros_like(mask))


@ROLLOUT_CORRECTIONS.implements("tis")
@torch.no_grad()
def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, settings: TISSettings
) -> CorrectionOutputs:
    """Truncated importance sampling: ``w = min(pi_old / pi_rollout, cap)`` per token.

    Yao, Liu, et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (fengyao.notion.site/off-policy-rl): the engine's samples are off-policy for the
    trainer; an importance weight truncated at ``C`` (``cap``, 2 there) corrects the
    gradient's expectation while bounding its variance. Computed in log space, so an extreme
    ratio never overflows. ``masked``: tokens where the cap was active.
    """
    log_ratio = _log_ratio(old_logprobs, rollout_logprobs, mask)
    weight = torch.where(mask, torch.exp(log_ratio.clamp(max=math.log(settings.cap))), 1.0)
    return CorrectionOutputs(weight=weight, masked=(log_ratio > math.log(settings.cap)) & mask)


def _band(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, band: BandSettings
) -> tuple[Tensor, Tensor]:
    """The per-token ratio ``pi_old / pi_rollout`` (1 at padding) and the valid tokens
    outside ``[low, high]``."""
    ratio = torch.exp(_log_ratio(old_logprobs, rollout_logprobs, mask))
    return ratio, ((ratio < band.low) | (ratio > band.high)) & mask


@ROLLOUT_CORRECTIONS.implements("icepop")
@torch.no_grad()
def icepop_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, settings: IcePopSettings
) -> CorrectionOutputs:
    """IcePop: ``w = pi_old / pi_rollout`` where that ratio lies in ``[low, high]``, else 0.

    Ling Team (inclusionAI) 2025, IcePop, introduced with Ring-1T in "Every Step Evolves:
    Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (arXiv:2510.18855; see
    also "Every Attention Matters" 2025 on training-inference alignment): the masking
    function ``M(k) = k if k in [alpha, beta] else 0`` of the training/inference ratio.
    Tokens where the two engines disagree by more than the band are dropped from the
    gradient instead of reweighted, so the mismatch cannot compound over long rollouts;
    inside it the token keeps its importance weight. ``masked``: the dropped tokens.
    """
    ratio, outside = _band(old_logprobs, rollout_logprobs, mask, settings)
    weight = torch.where(outside, torch.zeros_like(ratio), ratio)
    return CorrectionOutputs(weight=weight, masked=outside)


@ROLLOUT_CORRECTIONS.implements("token_mask")
@torch.no_grad()
def token_mask_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, settings: TokenMaskSettings
) -> CorrectionOutputs:
    """Token-level rejection: weight 1 where ``low <= pi_old / pi_rollout <= high``, else 0.

    IcePop's band (see :func:`icepop_weights`) without its importance weight inside: the
    token-level rejection sampling of Liu, Li, et al. 2025, "When Speed Kills Stability:
    Demystifying RL Collapse from the Training-Inference Mismatch" (verl's
    ``rollout_rs=token``). Kept tokens enter the loss unweighted; ``masked``: the rejected
    ones.
    """
    ratio, outside = _band(old_logprobs, rollout_logprobs, mask, settings)
    weight = torch.where(outside, torch.zeros_like(ratio), torch.ones_like(ratio))
    return CorrectionOutputs(weight=weight, masked=outside)


@ROLLOUT_CORRECTIONS.implements("seq_tis")
@torch.no_grad()
def seq_tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, settings: SeqTISSettings
) -> CorrectionOutputs:
    """Sequence-level truncated IS: every token of a response gets
    ``min(prod_t pi_old / pi_rollout, cap)`` over that response's tokens.

    The sequence-level variant of Yao et al. 2025 (see :func:`tis_weights`): the importance
    weight of the whole sampled trajectory, unbiased at the sequence level where per-token
    TIS is not, truncated at ``cap``. Its variance grows with the response length.
    ``masked``: all valid tokens of responses whose product was truncated.
    """
    seq = _log_ratio(old_logprobs, rollout_logprobs, mask).sum(dim=-1, keepdim=True)
    weight = torch.exp(seq.clamp(max=math.log(settings.cap))).expand_as(old_logprobs)
    weight = torch.where(mask, weight, 1.0)
    return CorrectionOutputs(weight=weight, masked=(seq > math.log(settings.cap)) & mask)


def correction_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    settings: RolloutCorrectionSettings,
) -> CorrectionOutputs:
    """The per-token weights of the correction ``settings`` selects (`train.rollout_correction`)."""
    fn: RolloutCorrection = ROLLOUT_CORRECTIONS.function(settings)
    return fn(old_logprobs, rollout_logprobs, mask, settings)
