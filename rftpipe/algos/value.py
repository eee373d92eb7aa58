"""Value-function pieces of actor-critic PPO: GAE, masked whitening and the clipped value loss.

Pure functions on ``(B, T)`` tensors of response tokens, right-padded, with a bool mask
that is True on valid tokens (a multi-turn episode's model tokens: its environment tokens
are masked like padding); every output is exactly 0 where the mask is False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["GAEOutput", "ValueLossOutput", "clipped_value_loss", "gae", "masked_whiten"]

#: Added to the variance before the inverse square root, as verl's `masked_whiten`.
WHITEN_EPS = 1e-8


class GAEOutput(NamedTuple):
    """Generalised advantage estimates and the critic's regression targets."""

    advantages: Tensor
    """``(B, T)`` float64 GAE(gamma, lambda) advantages, not whitened."""
    returns: Tensor
    """``(B, T)`` float64 ``advantages + values``: the lambda-returns the critic regresses on."""


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam: float,
    turn_starts: Tensor | None = None,
    turn_gamma: float = 1.0,
) -> GAEOutput:
    """GAE of Schulman et al. (2016) along each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` past a row's last valid token 0
    (the episode ends there), and ``A_t = delta_t + gamma * lam * A_{t+1}``.

    Args:
        token_rewards: ``(B, T)`` per-token reward (the outcome on the last token, minus a
            per-token KL penalty where one is in the reward).
        values: ``(B, T)`` the critic's ``V(s_t)``: the value of the state before token t.
        mask: ``(B, T)`` bool, True on the tokens that are actions. They need not be
            contiguous: a multi-turn episode's environment tokens (False between turns) are
            not steps, so the scan carries its running advantage and next value across them
            and the last model token of a turn bootstraps from the first of the next.
        gamma: discount, per action token.
        lam: GAE's lambda (1: Monte-Carlo returns minus V; 0: one-step TD errors).
        turn_starts: ``(B, T)`` bool, True on each turn's first model token, or None.
        turn_gamma: the step into a token where ``turn_starts`` is True is discounted by
            ``gamma * turn_gamma`` (a per-turn discount of a multi-turn episode).
    """
    values = torch.where(mask, values.to(torch.float64), 0.0)
    rewards = torch.where(mask, token_rewards.to(torch.float64), 0.0)
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(running)
    # The discount of the step from t to the next model token: gamma, times turn_gamma
    # where that token starts a turn.
    discount = torch.full_like(running, gamma)
    # A backward scan: a closed form through (gamma*lam)^-t overflows for long responses.
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + discount * next_value - values[:, t]
        step = delta + discount * lam * running
        adv[:, t] = torch.where(mask[:, t], step, 0.0)
        # Masked positions are skipped: right padding carries the zeros it started from,
        # an environment turn carries the next turn's running advantage and value.
        running = torch.where(mask[:, t], step, running)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        if turn_starts is not None:
            here = gamma * torch.where(turn_starts[:, t], turn_gamma, 1.0)
            discount = torch.where(mask[:, t], here, discount)
    return GAEOutput(advantages=adv, returns=torch.where(mask, adv + values, 0.0))


def masked_whiten(
    values: Tensor, mask: Tensor, reduce_sum: Callable[[Tensor], Tensor] = lambda x: x
) -> Tensor:
    """``(B, T)`` standardised over the valid tokens of the global batch (verl's
    `masked_whiten` with shift_mean=True: unbiased variance, ``rsqrt(var + 1e-8)``).

    Two passes (mean, then squared deviations), each one all-reduced sum, so every rank
    must call this, even with no valid tokens.
    """
    values = values.to(torch.float64)
    stats = reduce_sum(torch.stack([torch.where(mask, values, 0.0).sum(), mask.sum().double()]))
    n = stats[1].clamp(min=1)
    mean = stats[0] / n
    sq = reduce_sum(torch.where(mask, (values - mean).square(), 0.0).sum().reshape(1))[0]
    var = sq / (n - 1).clamp(min=1)
    return torch.where(mask, (values - mean) * torch.rsqrt(var + WHITEN_EPS), 0.0)


class ValueLossOutput(NamedTuple):
    """Per-token clipped value loss."""

    loss: Tensor
    """``(B, T)`` ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``."""
    clipped: Tensor
    """``(B, T)`` bool: the clipped term was the larger one (it decided the gradient)."""


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, cliprange: float
) -> ValueLossOutput:
    """PPO's clipped value loss (as verl and OpenAI baselines): the new prediction may not
    profit from moving more than `cliprange` away from the one the targets were built with.

    Args:
        values: ``(B, T)`` the critic's current predictions (with gradient).
        old_values: ``(B, T)`` its predictions when the step's advantages were computed.
        returns: ``(B, T)`` regression targets.
        cliprange: the epsilon of the clip; ``inf`` turns clipping off.
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange, cliprange)
    plain = (values - returns).square()
    clipped = (clipped_values - returns).square()
    return ValueLossOutput(loss=0.5 * torch.maximum(plain, clipped), clipped=clipped > plain)
