"""Reference numbers for every registered algorithm variant, derived by hand from the papers.

Each expected value below is written as the published formula evaluated in plain Python
float64 (``math``), never by calling rftpipe: the arithmetic is in the expressions and the
comments. Every registry has a table here, and `test_every_registered_name_has_reference_numbers`
fails when a name is registered without reference numbers. Edge cases: equal rewards in a
group, empty responses (zero tokens), and log ratios of +-50 (clamped to +-20).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from rftpipe.algos.advantage import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from rftpipe.algos.correction import correction_weights
from rftpipe.algos.kl_controller import make_kl_controller
from rftpipe.algos.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    entropy_top_mask,
    kl_estimate,
    policy_loss,
)
from rftpipe.algos.variants import (
    KL_CONTROLLERS,
    ROLLOUT_CORRECTIONS,
    AdvantageSettings,
    GPGAdvantageSettings,
    GRPOSettings,
    PolicyLossSettings,
    ReMaxSettings,
)
from rftpipe.config.schema import RewardConfig
from rftpipe.rewards import resolve_all
from rftpipe.rewards.types import RewardSample

F64 = torch.float64
EPS = 1e-6  # compute_advantages' default eps, as the formulas below use it
E20 = math.exp(20.0)  # a log ratio of +-50 is clamped to +-20 before exp()


def _mask(lengths: Sequence[int]) -> Tensor:
    width = max(1, *lengths) if lengths else 1
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


def _pad(rows: Sequence[Sequence[float]], lengths: Sequence[int]) -> Tensor:
    width = max(1, *lengths)
    return torch.tensor([list(r) + [0.0] * (width - len(r)) for r in rows], dtype=F64)


def _bcast(values: Sequence[float], lengths: Sequence[int]) -> list[list[float]]:
    """A sequence-level advantage on each of the response's tokens."""
    return [[v] * n for v, n in zip(values, lengths, strict=True)]


def _with(cls: type[Any], shared: dict[str, Any], own: dict[str, Any] | None = None) -> Any:
    """``cls`` built from the ``shared`` settings it has, and its ``own`` (all of which it
    must have): the tables below give every variant of a family the same shared settings,
    as the flat config did, and each reads only its own."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in shared.items() if k in names}, **(own or {})})


def _assert_ragged(actual: Tensor, mask: Tensor, expected: Sequence[Sequence[float]]) -> None:
    for row, m, want in zip(actual.tolist(), mask.tolist(), expected, strict=True):
        got = [v for v, ok in zip(row, m, strict=True) if ok]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12), (got, want)
        # Padding is exactly zero.
        assert all(v == 0.0 for v, ok in zip(row, m, strict=True) if not ok)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvCase:
    rewards: list[float]
    groups: list[int]
    lengths: list[int]
    expected: list[list[float]]
    logprobs: list[list[float]] | None = None
    sum_pi_squared: list[list[float]] | None = None
    gamma: float = 1.0
    is_baseline: list[bool] | None = None
    values: list[list[float]] | None = None
    lam: float = 1.0
    kl: list[list[float]] | None = None
    """Per-token KL penalty in the reward (`kl.mode=reward`), coefficient included."""


# Shared batch: group 0 rewards (1, 0, 0.5) with lengths (2, 1, 3); group 1 has equal rewards.
R3, G3, L3 = [1.0, 0.0, 0.5, 2.0, 2.0], [0, 0, 0, 1, 1], [2, 1, 3, 2, 1]
# group 0: mean 0.5; unbiased std sqrt(((0.5)^2 + (-0.5)^2 + 0^2) / 2) = 0.5
S3 = 0.5
# An empty response next to a 2-token one: rewards (1, 0), mean 0.5, std sqrt(0.5).
RE, GE, LE = [1.0, 0.0], [0, 0], [0, 2]
SE = math.sqrt(0.5)

# Optimal token baseline: pi = (0.5, 0.25) for sample 0 and (0.5,) for sample 1.
OTB_LP = [[math.log(0.5), math.log(0.25)], [math.log(0.5)]]
# Without sum_pi^2 the proxy is w = (1 - pi)^2: W0 = (0.25, 0.25 + 0.5625), W1 = (0.25,)
# t=0: B = (G0 W0 + G1 W1) / (W0 + W1 + eps) = (1 * 0.25 + 0 * 0.25) / (0.5 + eps)
# t=1: only sample 0 is still running, so its baseline is 0 (it would be its own return).
OTB_B0 = 0.25 / (0.5 + EPS)
# With sum_pi^2 = (0.5, 0.25) / (0.3,): w = 1 - 2 pi + sum_pi^2 = (0.5, 0.75) / (0.3,)
OTB_B0_SQ = (1 * 0.5 + 0 * 0.3) / (0.8 + EPS)
# Equal rewards: B = (1 W + 1 W) / (2 W + eps) with W = 0.25 for pi = 0.5.
OTB_EQ = 1.0 - 0.5 / (0.5 + EPS)

# REINFORCE++ (token returns, then whitened over all tokens as verl's masked_whiten: unbiased
# variance, (x - mean) / sqrt(var + 1e-8)):
# rewards (1, 0), lengths (2, 1): token returns {1, 1, 0}, mean 2/3,
# var ((1/3)^2 + (1/3)^2 + (2/3)^2) / (3 - 1) = 1/3.
RPP_STD = math.sqrt(1 / 3 + 1e-8)
# gamma 0.5: returns (0.5, 1) and (0,), mean 0.5, var (0 + 0.25 + 0.25) / 2 = 1/4.
RPP_STD_G = math.sqrt(1 / 4 + 1e-8)
# REINFORCE++-baseline with the KL penalty in the reward (verl): per response the score
# r - sum_t kl_t = (1 - 0.4, 0 - 0.2) = (0.6, -0.2), group mean 0.2, centred (0.4, -0.4) on
# every token (no reward-to-go, gamma unused): {0.4, 0.4, -0.4}, mean 2/15,
# deviations (4/15, 4/15, -8/15), var (16 + 16 + 64) / 225 / 2 = 96/450.
RPPB_KL = [[0.1, 0.3], [0.2]]
RPPB_STD_KL = math.sqrt(96 / 450 + 1e-8)

# GAE, gamma = lam = 0.5: sample 0 (reward 1, values 0.2, 0.4), sample 1 (reward 0, value 0.1).
# t=1: delta = 1 - 0.4 = 0.6 = A; t=0: delta = 0.5 * 0.4 - 0.2 = 0, A = 0.25 * 0.6 = 0.15;
# sample 1: A = 0 - 0.1 = -0.1. Then whitened over the 3 tokens (unbiased variance).
GAE_RAW = [0.15, 0.6, -0.1]
GAE_MEAN = sum(GAE_RAW) / 3
GAE_STD = math.sqrt(sum((x - GAE_MEAN) ** 2 for x in GAE_RAW) / 2 + 1e-8)
GAE_W = [(x - GAE_MEAN) / GAE_STD for x in GAE_RAW]

ADVANTAGE_CASES: dict[str, dict[str, AdvCase]] = {
    "grpo": {
        "groups": AdvCase(
            R3, G3, L3, _bcast([0.5 / (S3 + EPS), -0.5 / (S3 + EPS), 0.0, 0.0, 0.0], L3)
        ),
        "empty_response": AdvCase(RE, GE, LE, [[], [-0.5 / (SE + EPS)] * 2]),
    },
    "dr_grpo": {
        "groups": AdvCase(R3, G3, L3, _bcast([0.5, -0.5, 0.0, 0.0, 0.0], L3)),
        "empty_response": AdvCase(RE, GE, LE, [[], [-0.5, -0.5]]),
    },
    "rloo": {
        # s_i - mean(others): 1 - 0.25, 0 - 0.75, 0.5 - 0.5
        "groups": AdvCase(R3, G3, L3, _bcast([0.75, -0.75, 0.0, 0.0, 0.0], L3)),
        "empty_response": AdvCase(RE, GE, LE, [[], [-1.0, -1.0]]),
    },
    "reinforce_pp": {
        "whitened": AdvCase(
            [1.0, 0.0],
            [0, 1],
            [2, 1],
            [[(1 / 3) / RPP_STD] * 2, [(-2 / 3) / RPP_STD]],
        ),
        "discounted": AdvCase(
            [1.0, 0.0],
            [0, 1],
            [2, 1],
            [[0.0, 0.5 / RPP_STD_G], [-0.5 / RPP_STD_G]],
            gamma=0.5,
        ),
        "equal_rewards": AdvCase([1.0, 1.0], [0, 0], [1, 1], [[0.0], [0.0]]),
    },
    "reinforce_pp_baseline": {
        # centred (0.5, -0.5) on every token: {0.5, 0.5, -0.5}, mean 1/6, var 1/3
        "whitened": AdvCase(
            [1.0, 0.0],
            [0, 0],
            [2, 1],
            [[(1 / 3) / RPP_STD] * 2, [(-2 / 3) / RPP_STD]],
        ),
        "kl_in_reward": AdvCase(
            [1.0, 0.0],
            [0, 0],
            [2, 1],
            [[(4 / 15) / RPPB_STD_KL] * 2, [(-8 / 15) / RPPB_STD_KL]],
            gamma=0.5,
            kl=RPPB_KL,
        ),
        "equal_rewards": AdvCase([1.0, 1.0], [0, 0], [1, 1], [[0.0], [0.0]]),
    },
    "opo": {
        # b = (2 * 1 + 1 * 0 + 3 * 0.5) / (2 + 1 + 3) = 3.5 / 6
        "groups": AdvCase(
            R3, G3, L3, _bcast([1 - 3.5 / 6, 0 - 3.5 / 6, 0.5 - 3.5 / 6, 0.0, 0.0], L3)
        ),
        # b = (0 * 1 + 2 * 0) / 2 = 0: the empty response has no weight in the baseline
        "empty_response": AdvCase(RE, GE, LE, [[], [0.0, 0.0]]),
    },
    "gpg": {
        # B = 5 samples, M = 2 in the equal-reward group: alpha = 5 / 3, F_norm = 1
        "groups": AdvCase(R3, G3, L3, _bcast([5 / 3 * 0.5, 5 / 3 * -0.5, 0.0, 0.0, 0.0], L3)),
        # every sample informative: alpha = 1
        "empty_response": AdvCase(RE, GE, LE, [[], [-0.5, -0.5]]),
    },
    "grpo_passk": {
        # best 1, runner-up 0.5: (1 - 0.5) / (std 0.5 + eps) for the best only
        "groups": AdvCase(R3, G3, L3, _bcast([0.5 / (S3 + EPS), 0.0, 0.0, 0.0, 0.0], L3)),
        # a tie for the best: zero margin, nobody is credited
        "tied_best": AdvCase([1.0, 1.0, 0.0], [0, 0, 0], [1, 1, 1], [[0.0], [0.0], [0.0]]),
        # the best response is empty: its credit lands on no token
        "empty_response": AdvCase(RE, GE, LE, [[], [0.0, 0.0]]),
    },
    "optimal_token_baseline": {
        "proxy": AdvCase(
            [1.0, 0.0], [0, 0], [2, 1], [[1 - OTB_B0, 1.0], [0 - OTB_B0]], logprobs=OTB_LP
        ),
        "sum_pi_squared": AdvCase(
            [1.0, 0.0],
            [0, 0],
            [2, 1],
            [[1 - OTB_B0_SQ, 1.0], [0 - OTB_B0_SQ]],
            logprobs=OTB_LP,
            sum_pi_squared=[[0.5, 0.25], [0.3]],
        ),
        "equal_rewards": AdvCase(
            [1.0, 1.0],
            [0, 0],
            [1, 1],
            [[OTB_EQ], [OTB_EQ]],
            logprobs=[[math.log(0.5)], [math.log(0.5)]],
        ),
        # the empty response adds no weight; the other is alone at t=0: baseline 0
        "empty_response": AdvCase(RE, GE, LE, [[], [0.0, 0.0]], logprobs=[[], [-1.0, -1.0]]),
    },
    "gae": {
        "gamma_lam_half": AdvCase(
            [1.0, 0.0],
            [0, 1],
            [2, 1],
            [GAE_W[:2], GAE_W[2:]],
            values=[[0.2, 0.4], [0.1]],
            gamma=0.5,
            lam=0.5,
        ),
        # An empty response has no tokens; gamma = lam = 1 leaves R - V, then whitened:
        # (1 - 0.25, 1 - 0.75) -> mean 0.5, unbiased std sqrt(0.125).
        "empty_response": AdvCase(
            [0.0, 1.0],
            [0, 1],
            [0, 2],
            [[], [0.25 / math.sqrt(0.125 + 1e-8), -0.25 / math.sqrt(0.125 + 1e-8)]],
            values=[[], [0.25, 0.75]],
        ),
    },
    "remax": {
        # r - r(greedy) on every token; the greedy rows themselves get 0.
        # group 0: samples 1 and 0, greedy 0.5; group 1: 0.3 (2 tokens) and an empty
        # response, greedy 0.7; group 2: a sample equal to its greedy baseline.
        "greedy_baseline": AdvCase(
            [1.0, 0.0, 0.5, 0.3, 0.3, 0.7, 0.3, 0.3],
            [0, 0, 0, 1, 1, 1, 2, 2],
            [2, 1, 1, 2, 0, 1, 1, 1],
            [[0.5, 0.5], [-0.5], [0.0], [0.3 - 0.7] * 2, [], [0.0], [0.0], [0.0]],
            is_baseline=[False, False, True, False, False, True, False, True],
        ),
    },
}


def _adv_cases() -> list[tuple[str, str]]:
    return [(name, case) for name, cases in ADVANTAGE_CASES.items() for case in cases]


@pytest.mark.parametrize(("name", "case"), _adv_cases())
def test_advantage_reference(name: str, case: str) -> None:
    c = ADVANTAGE_CASES[name][case]
    mask = _mask(c.lengths)
    inputs = AdvantageInputs(
        rewards=torch.tensor(c.rewards, dtype=F64),
        group_index=torch.tensor(c.groups),
        response_mask=mask,
        logprobs=None if c.logprobs is None else _pad(c.logprobs, c.lengths),
        sum_pi_squared=None if c.sum_pi_squared is None else _pad(c.sum_pi_squared, c.lengths),
        is_baseline=None if c.is_baseline is None else torch.tensor(c.is_baseline),
        values=None if c.values is None else _pad(c.values, c.lengths),
        token_kl_penalty=None if c.kl is None else _pad(c.kl, c.lengths),
    )
    settings: AdvantageSettings = _with(
        ADVANTAGE_ESTIMATORS[name].settings, {"eps": EPS, "gamma": c.gamma, "lam": c.lam}
    )
    adv = compute_advantages(settings, inputs)
    _assert_ragged(adv, mask, c.expected)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantage_of_an_empty_batch(name: str) -> None:
    """A rank may hold no rows: every estimator returns an empty (0, T) tensor, and joins the
    cross-rank sum all the same (GPG, REINFORCE++), since the others wait in it."""
    calls: list[Tensor] = []

    def reduce_sum(x: Tensor) -> Tensor:
        calls.append(x)
        return x

    inputs = AdvantageInputs(
        rewards=torch.zeros(0, dtype=F64),
        group_index=torch.zeros(0, dtype=torch.int64),
        response_mask=torch.zeros(0, 1, dtype=torch.bool),
        logprobs=torch.zeros(0, 1, dtype=F64),
        is_baseline=torch.zeros(0, dtype=torch.bool),
        values=torch.zeros(0, 1, dtype=F64),
    )
    adv = compute_advantages(ADVANTAGE_ESTIMATORS[name].settings(), inputs, reduce_sum=reduce_sum)
    assert adv.shape == (0, 1)
    if name == "gpg":
        assert len(calls) == 1
    if name in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
        assert len(calls) == 2  # masked whitening: the mean, then the variance


def test_gpg_alpha_counts_samples_of_all_ranks() -> None:
    """alpha = B / (B - M) over the global batch: rank 0 holds the informative group
    (rewards 1, 0), rank 1 an uninformative one (2, 2), so alpha = 4 / 2 = 2 on rank 0,
    where alone it would be 1."""
    ranks = [([1.0, 0.0], [0, 0]), ([2.0, 2.0], [1, 1])]
    parts = [
        AdvantageInputs(
            rewards=torch.tensor(r, dtype=F64),
            group_index=torch.tensor(g),
            response_mask=torch.ones(2, 1, dtype=torch.bool),
        )
        for r, g in ranks
    ]
    # (samples, informative samples) of each rank: (2, 2) and (2, 0)
    local = [torch.tensor([2.0, 2.0], dtype=F64), torch.tensor([2.0, 0.0], dtype=F64)]
    adv = compute_advantages(GPGAdvantageSettings(), parts[0], reduce_sum=lambda x: x + local[1])
    _assert_ragged(adv, parts[0].response_mask, [[2 * 0.5], [2 * -0.5]])
    alone = compute_advantages(GPGAdvantageSettings(), parts[0])
    _assert_ragged(alone, parts[0].response_mask, [[0.5], [-0.5]])


def test_estimators_refuse_baseline_rows_they_do_not_use() -> None:
    """Only ReMax reads `is_baseline` rows; any other estimator would fold them into its
    group statistics as samples."""
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        group_index=torch.tensor([0, 0]),
        response_mask=torch.ones(2, 1, dtype=torch.bool),
        is_baseline=torch.tensor([False, True]),
    )
    with pytest.raises(ValueError, match="baseline rows"):
        compute_advantages(GRPOSettings(), inputs)
    with pytest.raises(ValueError, match="exactly one baseline row"):
        compute_advantages(
            ReMaxSettings(), dataclasses.replace(inputs, is_baseline=torch.tensor([False, False]))
        )


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


# The clip range of every case whose variant has one (0.28: clip-higher shows).
CLIP = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}


@dataclass(frozen=True)
class LossCase:
    """One batch: ``log_ratio`` = log pi - log pi_old per token; logprobs = old + log_ratio."""

    old: list[list[float]]
    log_ratio: list[list[float]]
    adv: list[list[float]]
    expected: list[list[float]]
    settings: dict[str, Any] = field(default_factory=dict)
    """The variant's own settings besides `CLIP` (defaults: its settings class's)."""
    grad: list[list[float]] | None = None
    """d(sum of the per-token loss)/d logprobs, where it is derived below."""


def _lengths(rows: Sequence[Sequence[float]]) -> list[int]:
    return [len(r) for r in rows]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


LN15, LN05 = math.log(1.5), math.log(0.5)
# Four tokens: ratio 1.5 with A = 1, ratio 0.5 with A = -1, log ratio +50 with A = -1,
# log ratio -50 with A = 1; plus an empty response (no tokens).
OLD4 = [[-1.0, -2.0, -1.5, -0.5], []]
LR4 = [[LN15, LN05, 50.0, -50.0], []]
ADV4 = [[1.0, -1.0, -1.0, 1.0], []]
# Clip-Cov / KL-Cov tokens: A = (3, -3, 0, 0), log pi = (-0.5, -2, -1.5, -2); means 0 and -1.5,
# so cov = (A - 0)(log pi + 1.5) = (3 * 1, -3 * -0.5, 0, 0) = (3, 1.5, 0, 0).
COV_LP = [-0.5, -2.0, -1.5, -2.0]
COV_ADV = [[3.0, -3.0, 0.0, 0.0]]

LOSS_CASES: dict[str, dict[str, LossCase]] = {
    "ppo_clip": {
        # max(-A r, -A clip(r, 0.8, 1.28)); A < 0 further bounded by -A * 3 (dual clip)
        "extremes": LossCase(
            OLD4,
            LR4,
            ADV4,
            [[-1.28, 0.8, 3.0, -math.exp(-20.0)], []],
            grad=[[0.0, 0.0, 0.0, 0.0], []],  # clipped, clipped, dual-clipped, clamped
        ),
        "no_dual_clip": LossCase(
            [[-1.5]], [[50.0]], [[-1.0]], [[E20]], settings={"dual_clip": None}, grad=[[0.0]]
        ),
    },
    "gspo": {
        # s = exp(mean(0.1, 0.3)) = e^0.2 < 1.28: unclipped, -A s on both tokens; the token
        # gradient is s * grad log pi_t (the sequence factor is a stop-gradient).
        "sequence_ratio": LossCase(
            [[-1.0, -2.0], [-1.0, -1.0], []],
            [[0.1, 0.3], [50.0, 50.0], []],
            [[1.0, 1.0], [-1.0, -1.0], []],
            # row 2: mean log ratio 50, clamped to 20: max(e^20, 1.28) = e^20 (no dual clip),
            # and like any clamped value it carries no gradient
            [[-math.exp(0.2)] * 2, [E20, E20], []],
            grad=[[-math.exp(0.2)] * 2, [0.0, 0.0], []],
        ),
        # s = exp(mean(0.5, 0.5)) = e^0.5 > 1.28 with A = 1: clipped, no gradient
        "clipped": LossCase(
            [[-1.0, -1.0]], [[0.5, 0.5]], [[1.0, 1.0]], [[-1.28, -1.28]], grad=[[0.0, 0.0]]
        ),
    },
    "cispo": {
        # w = sg(clip(r, 0.8, 1.28)); loss = -w A log pi; gradient -w A
        "weights": LossCase(
            [[math.log(0.25), math.log(0.2)], []],
            [[math.log(2.0), 0.0], []],
            [[1.0, -1.0], []],
            [[-1.28 * math.log(0.5), math.log(0.2)], []],
            grad=[[-1.28, 1.0], []],
        ),
        # log ratio +50 -> w = 1.28; -50 -> w = 0.8 (the gradient is kept, only bounded)
        "extremes": LossCase(
            [[-60.0, -0.5]],
            [[50.0, -50.0]],
            [[1.0, -1.0]],
            [[-1.28 * -10.0, 0.8 * -50.5]],
            grad=[[-1.28, 0.8]],
        ),
    },
    "sapo": {
        # f(r) = sigmoid(tau (r - 1)) * 4 / tau; tau 1 for A > 0, 1.05 otherwise; loss -f A
        "gate": LossCase(
            OLD4,
            LR4,
            ADV4,
            [
                [
                    -_sigmoid(0.5) * 4.0,
                    _sigmoid(1.05 * -0.5) * 4 / 1.05,
                    _sigmoid(1.05 * (E20 - 1)) * 4 / 1.05,  # = 4 / 1.05
                    -_sigmoid(math.exp(-20.0) - 1) * 4.0,
                ],
                [],
            ],
        ),
        # on policy f(1) = sigmoid(0) * 4 / tau = 2 / tau, and f'(1) = sigmoid'(0) * 4 = 1:
        # the loss is -2 A / tau but the gradient is plain -A
        "on_policy_gradient": LossCase(
            [[-1.0, -2.0]],
            [[0.0, 0.0]],
            [[2.0, -0.5]],
            [[-2.0 * 2.0, 2.0 / 1.05 * 0.5]],
            grad=[[-2.0, 0.5]],
        ),
    },
    "gpg": {
        # -A log pi, whatever the ratio
        "plain": LossCase(
            OLD4,
            LR4,
            ADV4,
            [[-(-1.0 + LN15), -2.0 + LN05, -1.5 + 50.0, -(-0.5 - 50.0)], []],
            grad=[[-1.0, 1.0, 1.0, -1.0], []],
        ),
    },
    "clip_cov": {
        # r = 1, so PPO gives -A; one token (max(1, int(2e-4 * 4))) in (1, 5) is cut: the
        # highest covariance, token 0 (cov 3)
        "cut_top": LossCase(
            [COV_LP], [[0.0] * 4], COV_ADV, [[0.0, 3.0, 0.0, 0.0]], grad=[[0.0, 3.0, 0.0, 0.0]]
        ),
        # with ub 2.5 token 0 is outside the band: token 1 (cov 1.5) is cut
        "band": LossCase(
            [COV_LP],
            [[0.0] * 4],
            COV_ADV,
            [[-3.0, 0.0, 0.0, 0.0]],
            settings={"ub": 2.5},
            grad=[[-3.0, 0.0, 0.0, 0.0]],
        ),
        "empty_response": LossCase([[]], [[]], [[]], [[]]),
    },
    "kl_cov": {
        # -A r everywhere; + 1.0 * |log r| on the top-1 covariance token (token 0, cov 3);
        # the covariance uses log pi = old + log r = (-0.4, -2.2, -1.5, -2.0): means 0 and
        # -1.525, cov = (3 * 1.125, -3 * -0.675, 0, 0) = (3.375, 2.025, 0, 0)
        "penalise_top": LossCase(
            [[-0.5, -2.0, -1.5, -2.0]],
            [[0.1, -0.2, 0.0, 0.0]],
            COV_ADV,
            [[-3 * math.exp(0.1) + 0.1, 3 * math.exp(-0.2), 0.0, 0.0]],
            grad=[[-3 * math.exp(0.1) + 1.0, 3 * math.exp(-0.2), 0.0, 0.0]],
        ),
        "extremes": LossCase(
            [[-1.0, -1.0]],
            [[50.0, -50.0]],
            [[-1.0, 1.0]],
            # log pi = (49, -51): cov = (-1 - 0)(49 - (-1)) = -50 and (1)(-51 + 1) = -50,
            # a tie broken by position: token 0 gets + |log r| = 20 (clamped)
            [[E20 + 20.0, -math.exp(-20.0)]],
        ),
    },
    "geo_mean": {
        # A > 0: log ratios (0.1, 0.5) -> min(l, clip(l, -0.2, 0.28)) = (0.1, 0.28), mean 0.19
        # A < 0: (-0.1, -0.5) -> max(l, clip(l)) = (-0.1, -0.2), mean -0.15
        # +50 with A > 0: clamped to 20, then min(20, 0.28) = 0.28
        "geometric_mean": LossCase(
            [[-1.0, -1.0], [-1.0, -1.0], [-1.0], []],
            [[0.1, 0.5], [-0.1, -0.5], [50.0], []],
            [[1.0, 1.0], [-1.0, -1.0], [1.0], []],
            [[-math.exp(0.19)] * 2, [math.exp(-0.15)] * 2, [-math.exp(0.28)], []],
            # the sequence loss sits on each of its |y| tokens, so the summed per-token loss is
            # |y| (-A exp(mean l)): d/dl_t = -A ratio on tokens whose clip is not active
            grad=[[-math.exp(0.19), 0.0], [math.exp(-0.15), 0.0], [0.0], []],
        ),
    },
}


def _loss_cases() -> list[tuple[str, str]]:
    return [(name, case) for name, cases in LOSS_CASES.items() for case in cases]


def _loss_settings(name: str, own: dict[str, Any] | None = None) -> PolicyLossSettings:
    settings: PolicyLossSettings = _with(POLICY_LOSSES[name].settings, CLIP, own)
    return settings


def _loss_inputs(c: LossCase) -> tuple[Tensor, Tensor, Tensor, Tensor, list[int]]:
    lengths = _lengths(c.old)
    old = _pad(c.old, lengths)
    logprobs = (old + _pad(c.log_ratio, lengths)).requires_grad_(True)
    return logprobs, old, _pad(c.adv, lengths), _mask(lengths), lengths


@pytest.mark.parametrize(("name", "case"), _loss_cases())
def test_policy_loss_reference(name: str, case: str) -> None:
    c = LOSS_CASES[name][case]
    logprobs, old, adv, mask, _ = _loss_inputs(c)
    out = policy_loss(logprobs, old, adv, mask, _loss_settings(name, c.settings))
    _assert_ragged(out.loss.detach(), mask, c.expected)
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.ratio).all()
    out.loss.sum().backward()
    assert logprobs.grad is not None and torch.isfinite(logprobs.grad).all()
    if c.grad is not None:
        _assert_ragged(logprobs.grad, mask, c.grad)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_on_padding_only(name: str) -> None:
    """A micro-batch of empty responses (padding that holds garbage, even -1000 logprobs):
    zero loss, and finite zero gradients."""
    logprobs = torch.tensor([[0.0, -1000.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]], dtype=F64)
    adv = torch.tensor([[5.0, -5.0]], dtype=F64)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    out = policy_loss(logprobs, old, adv, mask, _loss_settings(name))
    assert out.loss.tolist() == [[0.0, 0.0]]
    assert not out.clipped.any() and not out.dual_clipped.any()
    out.loss.sum().backward()
    assert logprobs.grad is not None and logprobs.grad.tolist() == [[0.0, 0.0]]


def test_gspo_token_gradient_stops_at_the_sequence_ratio() -> None:
    """Back-propagating token 0's loss alone reaches token 0 only: s_it = sg[s_i] pi_t / sg[pi_t].

    Without the stop-gradient token 1 would get -A s / |y| from the mean inside s_i."""
    c = LOSS_CASES["gspo"]["sequence_ratio"]
    logprobs, old, adv, mask, _ = _loss_inputs(c)
    out = policy_loss(logprobs, old, adv, mask, _loss_settings("gspo"))
    out.loss[0, 0].backward()
    assert logprobs.grad is not None
    assert math.isclose(logprobs.grad[0, 0].item(), -math.exp(0.2), rel_tol=1e-12)
    assert logprobs.grad[0, 1].item() == 0.0


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

AGG_LOSS = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
AGG_LENGTHS = [3, 1, 0]  # the third response is empty

AGGREGATION_CASES: dict[str, dict[str, tuple[dict[str, Any], float]]] = {
    # (kwargs, expected); rows sum to 6, 4 and 0
    "token-mean": {
        "default": ({}, 10 / 4),
        "global_count": ({"num_tokens": 8.0}, 10 / 8),
    },
    "seq-mean-token-mean": {
        "default": ({}, (6 / 3 + 4 / 1 + 0) / 3),
        "global_count": ({"num_seqs": 6.0}, (6 / 3 + 4 / 1) / 6),
    },
    "seq-mean-token-sum": {
        "default": ({}, 10 / 3),
        "global_count": ({"num_seqs": 5.0}, 10 / 5),
    },
    "seq-mean-token-sum-norm": {
        # Dr. GRPO as verl's agg_loss: the token sums of all responses over a constant
        # length (loss_scale_factor), no division by the number of responses; without a
        # constant, the padded width 3. num_seqs does not enter.
        "default": ({}, 10 / 3),
        "budget": ({"norm_len": 8.0}, 10 / 8),
        "global": ({"norm_len": 8.0, "num_seqs": 4.0}, 10 / 8),
    },
}


@pytest.mark.parametrize(
    ("mode", "case"), [(m, c) for m, cases in AGGREGATION_CASES.items() for c in cases]
)
def test_aggregation_reference(mode: str, case: str) -> None:
    kwargs, expected = AGGREGATION_CASES[mode][case]
    mask = torch.tensor([[t < n for t in range(3)] for n in AGG_LENGTHS])
    # NaN on padding must not leak: aggregation selects, never multiplies, by the mask.
    loss = torch.where(mask, torch.tensor(AGG_LOSS, dtype=F64), math.nan)
    out = aggregate(loss, mask, mode, **kwargs)  # type: ignore[arg-type]
    assert math.isclose(out.item(), expected, rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------

# (log pi, log ref) pairs: close, and +-50 apart.
KL_PAIRS = [(-1.0, -2.0), (0.0, -50.0), (-50.0, 0.0)]


def _k3(lp: float, ref: float) -> float:
    x = max(-20.0, min(20.0, ref - lp))  # log ratio clamped to +-20
    return min(math.exp(x) - x - 1.0, 10.0)  # value capped at 10


KL_CASES: dict[str, tuple[list[float], list[float]]] = {
    # name: (values at KL_PAIRS, d value / d log pi at KL_PAIRS)
    "k1": ([1.0, 50.0, -50.0], [1.0, 1.0, 1.0]),
    "k2": ([0.5, 1250.0, 1250.0], [1.0, 50.0, -50.0]),
    # (-1, -2): e^-1 - (-1) - 1 = e^-1, gradient 1 - e^(ref - lp) = 1 - e^-1; both extremes
    # hit the cap of 10 (e^-20 + 20 - 1 = 19 and e^20 - 21), where the gradient is 0
    "k3": ([_k3(*p) for p in KL_PAIRS], [1.0 - math.exp(-1.0), 0.0, 0.0]),
    "abs": ([1.0, 50.0, 50.0], [1.0, 1.0, -1.0]),
    # straight-through: the named estimate's value, k2's gradient (log pi - log ref)
    "k1_st": ([1.0, 50.0, -50.0], [1.0, 50.0, -50.0]),
    "k3_st": ([_k3(*p) for p in KL_PAIRS], [1.0, 50.0, -50.0]),
    "abs_st": ([1.0, 50.0, 50.0], [1.0, 50.0, -50.0]),
}


@pytest.mark.parametrize("kind", sorted(KL_CASES))
def test_kl_estimator_reference(kind: str) -> None:
    values, grads = KL_CASES[kind]
    lp = torch.tensor([[p[0] for p in KL_PAIRS]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[p[1] for p in KL_PAIRS]], dtype=F64)
    out = kl_estimate(lp, ref, KL_ESTIMATORS[kind].settings())
    for got, want in zip(out[0].tolist(), values, strict=True):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12)
    out.sum().backward()
    assert lp.grad is not None
    for got, want in zip(lp.grad[0].tolist(), grads, strict=True):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# Rollout corrections (cap 2, band [0.5, 2])
# ---------------------------------------------------------------------------------------------

# log(pi_old / pi_rollout) per token: 1.5, 3, 0.25, +50 and -50; a second row 1.5 x 1.2.
CORR_LR = [[LN15, math.log(3.0), math.log(0.25), 50.0, -50.0], [LN15, math.log(1.2), 0, 0, 0]]
CORR_LEN = [5, 2]

CORRECTION_CASES: dict[str, list[list[float]]] = {
    "none": [[1.0] * 5, [1.0, 1.0]],
    # min(r, 2)
    "tis": [[1.5, 2.0, 0.25, 2.0, math.exp(-50.0)], [1.5, 1.2]],
    # r inside [0.5, 2], else 0
    "icepop": [[1.5, 0.0, 0.0, 0.0, 0.0], [1.5, 1.2]],
    "token_mask": [[1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0]],
    # min(prod r, 2): row 0's product is e^(log 1.5 + log 3 + log 0.25 + 50 - 50) = 1.125
    "seq_tis": [[1.5 * 3.0 * 0.25] * 5, [1.5 * 1.2] * 2],
}


@pytest.mark.parametrize("name", sorted(CORRECTION_CASES))
def test_rollout_correction_reference(name: str) -> None:
    mask = _mask(CORR_LEN)
    rollout = torch.full((2, 5), -3.0, dtype=F64)
    old = rollout + torch.tensor(CORR_LR, dtype=F64)
    entry = ROLLOUT_CORRECTIONS[name]
    band = {"cap": 2.0, "low": 0.5, "high": 2.0}
    settings = entry.settings(**{k: v for k, v in band.items() if k in entry.setting_names()})
    out = correction_weights(old, rollout, mask, settings)
    for row, m, want in zip(
        out.weight.tolist(), mask.tolist(), CORRECTION_CASES[name], strict=True
    ):
        got = [v for v, ok in zip(row, m, strict=True) if ok]
        for g, w in zip(got, want, strict=True):
            assert math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-300)


# ---------------------------------------------------------------------------------------------
# KL controllers (Ziegler et al. 2019): coef *= 1 + clip(kl / target - 1, +-0.2) * n / horizon
# ---------------------------------------------------------------------------------------------

# (init 0.1, target 6, horizon 10000); updates (kl, n_steps) and the coefficient after them.
CONTROLLER_CASES: dict[str, tuple[list[tuple[float, int]], float]] = {
    "fixed": ([(12.0, 100), (3.0, 500)], 0.1),
    # 12/6 - 1 = 1 -> 0.2: x(1 + 0.2 * 0.01); 3/6 - 1 = -0.5 -> -0.2: x(1 - 0.2 * 0.05)
    "adaptive": ([(12.0, 100), (3.0, 500)], 0.1 * 1.002 * 0.99),
}


@pytest.mark.parametrize("name", sorted(CONTROLLER_CASES))
def test_kl_controller_reference(name: str) -> None:
    updates, expected = CONTROLLER_CASES[name]
    entry = KL_CONTROLLERS[name]
    horizon = {"target": 6.0, "horizon": 10_000}
    settings = entry.settings(**{k: v for k, v in horizon.items() if k in entry.setting_names()})
    ctl = make_kl_controller(settings, init_coef=0.1)
    for kl, n in updates:
        ctl.update(kl, n)
    assert math.isclose(ctl.coef, expected, rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# Every registered name has reference numbers
# ---------------------------------------------------------------------------------------------

REFERENCE_TABLES: dict[str, tuple[Iterable[str], dict[str, Any]]] = {
    # registry kind: (registry, fixture table)
    "advantage estimators": (ADVANTAGE_ESTIMATORS, ADVANTAGE_CASES),
    "policy losses": (POLICY_LOSSES, LOSS_CASES),
    "aggregations": (AGGREGATIONS, AGGREGATION_CASES),
    "KL estimators": (KL_ESTIMATORS, KL_CASES),
    "rollout corrections": (ROLLOUT_CORRECTIONS, CORRECTION_CASES),
    "KL controllers": (KL_CONTROLLERS, CONTROLLER_CASES),
}


@pytest.mark.parametrize("kind", sorted(REFERENCE_TABLES))
def test_every_registered_name_has_reference_numbers(kind: str) -> None:
    registry, table = REFERENCE_TABLES[kind]
    missing = sorted(set(registry) - set(table))
    assert not missing, f"{kind} registered without reference numbers: {missing}"
    stale = sorted(set(table) - set(registry))
    assert not stale, f"{kind} reference numbers for unregistered names: {stale}"
    assert all(table[name] for name in registry), f"{kind}: an entry with no cases"


# ---------------------------------------------------------------------------------------------
# High-entropy token mask and the overlong reward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top", "kept"),
    [
        (1.0, [0, 1, 2, 3, 4]),  # off
        (0.4, [1, 4]),  # ceil(0.4 * 5) = 2 highest: 0.9 and 0.7
        (0.3, [1, 4]),  # ceil(1.5) = 2
        (0.2, [1]),  # ceil(1.0) = 1
    ],
)
def test_entropy_top_mask_reference(top: float, kept: list[int]) -> None:
    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7, 5.0]])
    mask = torch.tensor([[True] * 5 + [False]])  # the padding's huge entropy is never kept
    out = entropy_top_mask(entropy, mask, top)
    assert [i for i, v in enumerate(out[0].tolist()) if v] == kept


def _length_sample(n_tokens: int) -> RewardSample:
    return RewardSample(
        step=0,
        prompt_id=0,
        sample_idx=0,
        prompt="",
        response="",
        answer=None,
        data_source="",
        metadata={},
        response_token_ids=[0] * n_tokens,
        finish_reason="length",
    )


@pytest.mark.parametrize(
    ("length", "penalty", "expected"),
    [
        # DAPO Eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, then ((10 - 4) - |y|) / 4
        (0, 1.0, 0.0),
        (6, 1.0, 0.0),
        (7, 1.0, (6 - 7) / 4),
        (9, 1.0, (6 - 9) / 4),
        (10, 1.0, -1.0),
        (10, 0.5, -0.5),
    ],
)
def test_overlong_reward_reference(length: int, penalty: float, expected: float) -> None:
    cfg = RewardConfig(functions=("overlong",), overlong_buffer=4, overlong_penalty=penalty)
    component = resolve_all(cfg, None, response_budget=10)["reward_overlong"]
    (outcome,) = component.score([_length_sample(length)], fail_fast=True)
    assert outcome is not None and outcome.status == "ok"
    assert math.isclose(outcome.value, expected, rel_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# Defaults against verl's
# ---------------------------------------------------------------------------------------------
# verl's values, read in volcengine/verl at b178a3c (2026-01-29): verl/trainer/ppo/core_algos.py
# (compute_policy_loss_clip_cov, compute_policy_loss_kl_cov,
# compute_optimal_token_baseline_advantage, compute_policy_loss_vanilla) and
# verl/workers/config/actor.py (PolicyLossConfig, ActorConfig). Each case below runs our
# variant with the settings a verl run has (our defaults unless stated) and expects the
# number verl's code gives, evaluated here by hand.

# (family, variant, setting) -> verl's default for it. A default of ours that differs must
# have its row, with both values and the reason, in docs/algorithms.md's "Defaults against
# verl's" table.
VERL_DEFAULTS: dict[tuple[str, str, str], float | None] = {
    # ActorConfig.clip_ratio_low / clip_ratio_high / clip_ratio_c (the dual clip)
    ("policy_loss", "ppo_clip", "clip_low"): 0.2,
    ("policy_loss", "ppo_clip", "clip_high"): 0.2,
    ("policy_loss", "ppo_clip", "dual_clip"): 3.0,
    # compute_policy_loss_clip_cov reads clip_ratio_low / _high but has no dual clip
    ("policy_loss", "clip_cov", "clip_low"): 0.2,
    ("policy_loss", "clip_cov", "clip_high"): 0.2,
    ("policy_loss", "clip_cov", "dual_clip"): None,
    ("policy_loss", "clip_cov", "ratio"): 2e-4,  # PolicyLossConfig.clip_cov_ratio
    ("policy_loss", "clip_cov", "lb"): 1.0,
    ("policy_loss", "clip_cov", "ub"): 5.0,
    ("policy_loss", "kl_cov", "ratio"): 2e-4,  # PolicyLossConfig.kl_cov_ratio
    ("policy_loss", "kl_cov", "coef"): 0.1,  # PolicyLossConfig.ppo_kl_coef
    ("policy_loss", "sapo", "tau_pos"): 1.0,  # ActorConfig.tau_pos / tau_neg
    ("policy_loss", "sapo", "tau_neg"): 1.05,
    ("advantage", "grpo", "eps"): 1e-6,  # compute_grpo_outcome_advantage's epsilon
    ("advantage", "grpo_passk", "eps"): 1e-6,
    ("advantage", "optimal_token_baseline", "eps"): 1e-8,
}


def _our_default(family: str, name: str, key: str) -> Any:
    registry = POLICY_LOSSES if family == "policy_loss" else ADVANTAGE_ESTIMATORS
    return getattr(registry[name].settings(), key)


def _verl_table_rows() -> dict[str, str]:
    """``name.key`` -> its row of docs/algorithms.md's "Defaults against verl's" table."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = text.split("### Defaults against verl's", 1)
    assert len(section) == 2, "docs/algorithms.md has no '### Defaults against verl's' section"
    body = section[1].split("\n#", 1)[0]
    rows = {}
    for line in body.splitlines():
        if m := re.match(r"\| `([\w.]+)` \|", line):
            rows[m.group(1)] = line
    return rows


@pytest.mark.parametrize(("family", "name", "key"), sorted(VERL_DEFAULTS))
def test_defaults_that_differ_from_verl_are_documented(family: str, name: str, key: str) -> None:
    ours, verl = _our_default(family, name, key), VERL_DEFAULTS[family, name, key]
    row = _verl_table_rows().get(f"{name}.{key}")
    if ours == verl:
        assert row is None or "equal" in row, f"{name}.{key}: documented as different"
        return
    assert row is not None, f"{name}.{key}: {ours} here, {verl} in verl, and no docs row"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"`{ours}`" and cells[2].startswith(f"`{verl}`"), row
    assert len(cells) == 5 and cells[4], f"{name}.{key}: the row gives no reason"


def test_clip_cov_defaults_give_verls_loss() -> None:
    """verl's clip_cov has no dual clip: a token with ratio e^2 and A = -1 keeps its loss
    -A r = e^2 (PPO's max picks the unclipped side), where a dual clip of 3 would cap it
    at 3. Old log-probs (0, 0), new (2, 0), A = (-1, -1): both tokens have covariance 0
    (A is constant), outside (lb, ub) = (1, 5), so no token is cut. Token-mean: verl gives
    (e^2 + 1) / 2 = 4.19."""
    logprobs = torch.tensor([[2.0, 0.0]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.full((1, 2), -1.0, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logprobs, old, adv, mask, POLICY_LOSSES["clip_cov"].settings())
    _assert_ragged(out.loss.detach(), mask, [[math.exp(2.0), 1.0]])
    mean = aggregate(out.loss, mask, "token-mean").item()
    assert math.isclose(mean, (math.exp(2.0) + 1.0) / 2, rel_tol=1e-12)
    assert not out.dual_clipped.any()


@pytest.mark.parametrize(
    ("coef", "verl_source"),
    [
        (0.1, "PolicyLossConfig.ppo_kl_coef (verl's config default)"),
        (None, "recipe/entropy/7b_kl_cov.sh ppo_kl_coef=1 (our default)"),
    ],
)
def test_kl_cov_gives_verls_loss(coef: float | None, verl_source: str) -> None:
    """verl's compute_policy_loss_kl_cov: -A r on every token, + ppo_kl_coef |log r| on the
    top max(1, int(2e-4 n)) = 1 token by covariance of A and the new log pi. Batch of
    `penalise_top`: log pi = (-0.4, -2.2, -1.5, -2.0), A = (3, -3, 0, 0), covariances
    (3.375, 2.025, 0, 0): token 0 (log r = 0.1) is penalised. Token-mean over 4 tokens."""
    c = LOSS_CASES["kl_cov"]["penalise_top"]
    logprobs, old, adv, mask, _ = _loss_inputs(c)
    own = {} if coef is None else {"coef": coef}
    out = policy_loss(logprobs, old, adv, mask, POLICY_LOSSES["kl_cov"].settings(**own))
    beta = 1.0 if coef is None else coef
    per_token = [-3 * math.exp(0.1) + beta * 0.1, 3 * math.exp(-0.2), 0.0, 0.0]
    _assert_ragged(out.loss.detach(), mask, [per_token])
    mean = aggregate(out.loss, mask, "token-mean").item()
    assert math.isclose(mean, sum(per_token) / 4, rel_tol=1e-12), verl_source


# Two samples of one group, rewards (1, 0), both 2 tokens long (so verl's handle_zero_tail
# does not matter): pi = (0.5, 0.25) and (0.5, 0.5), sum pi^2 = (0.5, 0.25) and (0.3, 0.5).
# w = 1 - 2 pi + sum pi^2 = (0.5, 0.75) and (0.3, 0.5); W (cumulative) = (0.5, 1.25) and
# (0.3, 0.8). verl: B_t = sum_i G_it W_it / (sum_i W_it + epsilon), epsilon 1e-8.
OTB_VERL_B = [(1 * 0.5 + 0 * 0.3) / (0.8 + 1e-8), (1 * 1.25 + 0 * 0.8) / (2.05 + 1e-8)]


def test_optimal_token_baseline_defaults_give_verls_advantages() -> None:
    lengths = [2, 2]
    mask = _mask(lengths)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        group_index=torch.tensor([0, 0]),
        response_mask=mask,
        logprobs=_pad([[math.log(0.5), math.log(0.25)], [math.log(0.5)] * 2], lengths),
        sum_pi_squared=_pad([[0.5, 0.25], [0.3, 0.5]], lengths),
    )
    adv = compute_advantages(ADVANTAGE_ESTIMATORS["optimal_token_baseline"].settings(), inputs)
    b0, b1 = OTB_VERL_B
    _assert_ragged(adv, mask, [[1 - b0, 1 - b1], [-b0, -b1]])


def test_optimal_token_baseline_tail_is_verls_handle_zero_tail() -> None:
    """Where one sample runs alone our baseline is 0: verl's handle_zero_tail=True (the
    default of its multi-turn variant; its single-turn one defaults to False, whose baseline
    there is G W / (W + epsilon), about G). The `proxy` case: lengths (2, 1), rewards (1, 0),
    no sum pi^2 (our lower bound pi^2 for it). Sample 0's token 1 runs alone."""
    lengths = [2, 1]
    mask = _mask(lengths)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        group_index=torch.tensor([0, 0]),
        response_mask=mask,
        logprobs=_pad(OTB_LP, lengths),
    )
    adv = compute_advantages(ADVANTAGE_ESTIMATORS["optimal_token_baseline"].settings(), inputs)
    b0 = 0.25 / (0.5 + 1e-8)  # W = 0.25 for both samples at t = 0
    _assert_ragged(adv, mask, [[1 - b0, 1.0], [-b0]])
