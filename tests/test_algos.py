"""Tests for rftpipe.algos: every algorithm against an independent plain-Python reference."""

from __future__ import annotations

import functools
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import pytest
import torch
from torch import Tensor

from rftpipe.algos.advantage import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from rftpipe.algos.correction import (
    correction_weights,
    icepop_weights,
    seq_tis_weights,
    tis_weights,
    token_mask_weights,
)
from rftpipe.algos.kl_controller import (
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)
from rftpipe.algos.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    AggregationName,
    aggregate,
    entropy_from_logits,
    gather_logprobs,
    kl_estimate,
    ppo_clip_loss,
)
from rftpipe.algos.registry import UnknownVariantError
from rftpipe.algos.variants import (
    KL_CONTROLLERS,
    ROLLOUT_CORRECTIONS,
    AdaptiveKLSettings,
    DrGRPOSettings,
    FixedKLSettings,
    GRPOSettings,
    K1Settings,
    K3Settings,
    PPOClipSettings,
    RLOOSettings,
)

EPS = 1e-6
F64 = torch.float64


def _close(actual: Tensor, expected: list | float, tol: float = 1e-10) -> None:
    torch.testing.assert_close(
        actual.to(F64), torch.tensor(expected, dtype=F64), rtol=tol, atol=tol
    )


# ---------------------------------------------------------------------------------------------
# Random ragged batches, kept both as python lists (for the references) and as tensors.
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    ids: list[int]
    lengths: list[int]
    rewards: list[float]
    kl: list[list[float]] | None
    width: int

    def inputs(self) -> AdvantageInputs:
        mask = [[t < n for t in range(self.width)] for n in self.lengths]
        return AdvantageInputs(
            rewards=torch.tensor(self.rewards, dtype=F64),
            group_index=torch.tensor(self.ids, dtype=torch.int64),
            response_mask=torch.tensor(mask, dtype=torch.bool).reshape(-1, self.width),
            token_kl_penalty=None if self.kl is None else torch.tensor(self.kl, dtype=F64),
        )

    def subset(self, rows: list[int]) -> Batch:
        kl = None if self.kl is None else [self.kl[i] for i in rows]
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Batch(pick(self.ids), pick(self.lengths), pick(self.rewards), kl, self.width)


def make_batch(
    seed: int, *, with_kl: bool, group_sizes: tuple[int, ...] = (1, 2, 3, 4, 6)
) -> Batch:
    rng = random.Random(seed)
    # Sparse, non-contiguous group ids in shuffled order.
    ids = [100 - 7 * g for g, size in enumerate(group_sizes) for _ in range(size)]
    rng.shuffle(ids)
    width = 9
    lengths = [rng.randint(1, width) for _ in ids]
    lengths[rng.randrange(len(ids))] = 0  # an empty response must not break anything
    rewards = [rng.choice([0.0, 1.0]) + rng.gauss(0.0, 0.3) for _ in ids]
    kl = None
    if with_kl:
        # Padding holds garbage on purpose: it must be ignored.
        kl = [
            [rng.uniform(-0.05, 0.2) if t < n else rng.uniform(-50, 50) for t in range(width)]
            for n in lengths
        ]
    return Batch(ids, lengths, rewards, kl, width)


# ---------------------------------------------------------------------------------------------
# Plain-python references
# ---------------------------------------------------------------------------------------------


def ref_scores(b: Batch) -> list[float]:
    if b.kl is None:
        return list(b.rewards)
    return [r - sum(b.kl[i][: b.lengths[i]]) for i, r in enumerate(b.rewards)]


def ref_group(values: list[float], ids: list[int], i: int) -> list[float]:
    return [values[j] for j in range(len(ids)) if ids[j] == ids[i]]


def ref_mean(xs: list[float]) -> float:
    total = 0.0
    for x in xs:
        total += x
    return total / len(xs)


def ref_grpo(b: Batch) -> list[float]:
    s = ref_scores(b)
    out = []
    for i in range(len(s)):
        grp = ref_group(s, b.ids, i)
        if len(grp) == 1:
            out.append(0.0)
            continue
        m = ref_mean(grp)
        std = math.sqrt(sum((x - m) ** 2 for x in grp) / (len(grp) - 1))
        out.append((s[i] - m) / (std + EPS))
    return out


def ref_dr_grpo(b: Batch) -> list[float]:
    s = ref_scores(b)
    return [s[i] - ref_mean(ref_group(s, b.ids, i)) for i in range(len(s))]


def ref_rloo(b: Batch) -> list[float]:
    s = ref_scores(b)
    out = []
    for i in range(len(s)):
        others = [s[j] for j in range(len(s)) if b.ids[j] == b.ids[i] and j != i]
        out.append(0.0 if not others else s[i] - ref_mean(others))
    return out


def ref_broadcast(per_sample: list[float], b: Batch) -> list[list[float]]:
    return [
        [per_sample[i] if t < n else 0.0 for t in range(b.width)] for i, n in enumerate(b.lengths)
    ]


def ref_returns(outcome: list[float], b: Batch, gamma: float) -> list[list[float]]:
    rows = []
    for i, n in enumerate(b.lengths):
        r = [0.0 if b.kl is None else -b.kl[i][t] for t in range(n)]
        if n > 0:
            r[n - 1] += outcome[i]
        g = [0.0] * n
        running = 0.0
        for t in range(n - 1, -1, -1):
            running = r[t] + gamma * running
            g[t] = running
        rows.append(g)
    return rows


def ref_whiten(rows: list[list[float]], b: Batch) -> list[list[float]]:
    """verl's masked_whiten: unbiased variance over all valid tokens, rsqrt(var + 1e-8)."""
    flat = [x for row in rows for x in row]
    m = ref_mean(flat)
    var = sum((x - m) ** 2 for x in flat) / (len(flat) - 1)
    return [
        [(row[t] - m) / math.sqrt(var + 1e-8) if t < len(row) else 0.0 for t in range(b.width)]
        for row in rows
    ]


def ref_reinforce_pp(b: Batch, gamma: float) -> list[list[float]]:
    return ref_whiten(ref_returns(b.rewards, b, gamma), b)


def ref_reinforce_pp_baseline(b: Batch, gamma: float) -> list[list[float]]:
    """verl: the group-centred score r - sum(KL) on every token (gamma unused), whitened."""
    s = ref_scores(b)
    centred = [s[i] - ref_mean(ref_group(s, b.ids, i)) for i in range(len(b.ids))]
    return ref_whiten([[c] * n for c, n in zip(centred, b.lengths, strict=True)], b)


def ref_advantages(name: str, b: Batch, gamma: float) -> list[list[float]]:
    sequence_level = {"grpo": ref_grpo, "dr_grpo": ref_dr_grpo, "rloo": ref_rloo}
    if name in sequence_level:
        return ref_broadcast(sequence_level[name](b), b)
    token_level = {
        "reinforce_pp": ref_reinforce_pp,
        "reinforce_pp_baseline": ref_reinforce_pp_baseline,
    }
    return token_level[name](b, gamma)


# ---------------------------------------------------------------------------------------------
# Advantage tests
# ---------------------------------------------------------------------------------------------


def _settings(name: str, **settings: float) -> Any:
    """The advantage estimator ``name`` with the given settings (of those it has)."""
    entry = ADVANTAGE_ESTIMATORS[name]
    names = entry.setting_names()
    return entry.settings(**{k: v for k, v in settings.items() if k in names})


def test_aggregations_cover_their_literal_names() -> None:
    # The variant registries hold their own names (rftpipe.algos.variants); the aggregation
    # table, whose entries have no settings, is keyed by a Literal.
    assert set(AGGREGATIONS) == set(get_args(AggregationName))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_group_advantages_match_reference(name: str, with_kl: bool, seed: int) -> None:
    b = make_batch(seed, with_kl=with_kl)
    inputs = b.inputs()

    def no_cross_rank(x: Tensor) -> Tensor:
        raise AssertionError("group estimators must not reduce across ranks")

    adv = compute_advantages(_settings(name, eps=EPS), inputs, reduce_sum=no_cross_rank)
    assert adv.dtype == F64 and adv.shape == inputs.response_mask.shape
    _close(adv, ref_advantages(name, b, 1.0))
    assert torch.all(adv[~inputs.response_mask] == 0)
    # Guard against a vacuous comparison: there is real signal in the batch.
    assert adv.abs().max() > 0.1


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(name: str, with_kl: bool, gamma: float) -> None:
    b = make_batch(3, with_kl=with_kl)
    inputs = b.inputs()
    adv = compute_advantages(_settings(name, eps=EPS, gamma=gamma), inputs)
    _close(adv, ref_advantages(name, b, gamma))
    assert torch.all(adv[~inputs.response_mask] == 0)
    valid = adv[inputs.response_mask]
    # Whitened over all valid tokens: zero mean, unit (unbiased) std.
    assert abs(valid.mean().item()) < 1e-9
    assert abs(valid.std().item() - 1.0) < 1e-5


def test_group_of_one_has_zero_advantage() -> None:
    b = make_batch(5, with_kl=True, group_sizes=(1, 1, 3))
    inputs = b.inputs()
    singles = [i for i in range(len(b.ids)) if b.ids.count(b.ids[i]) == 1]
    for name in ("grpo", "rloo", "dr_grpo"):
        # eps=0 makes a lone sample's 0/0 visible if it were not special-cased.
        adv = compute_advantages(_settings(name, eps=0.0), inputs)
        assert torch.all(adv[singles] == 0), name
        assert torch.isfinite(adv).all()


@pytest.mark.kernels
def test_rloo_equals_scaled_dr_grpo() -> None:
    b = make_batch(7, with_kl=True, group_sizes=(4, 4, 4))
    inputs = b.inputs()
    rloo = compute_advantages(RLOOSettings(), inputs)
    dr = compute_advantages(DrGRPOSettings(), inputs)
    torch.testing.assert_close(rloo, dr * 4 / 3)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.kernels
def test_reinforce_pp_is_exact_across_ranks(name: str, gamma: float) -> None:
    b = make_batch(11, with_kl=True)
    settings = _settings(name, gamma=gamma)
    full = compute_advantages(settings, b.inputs())
    # Two "ranks", groups kept whole, rows interleaved in the original order.
    distinct = sorted(set(b.ids))
    rank_rows = [
        [i for i, g in enumerate(b.ids) if g in distinct[::2]],
        [i for i, g in enumerate(b.ids) if g in distinct[1::2]],
    ]
    parts = [b.subset(rows).inputs() for rows in rank_rows]
    local = [compute_advantages(settings, p) for p in parts]
    ranked = in_lockstep([functools.partial(compute_advantages, settings, p) for p in parts])
    for rank, adv in enumerate(ranked):
        torch.testing.assert_close(adv, full[rank_rows[rank]], rtol=1e-10, atol=1e-10)
        # Without the cross-rank sums the whitening differs, so the check above is meaningful.
        assert not torch.allclose(local[rank], full[rank_rows[rank]], atol=1e-4)


def in_lockstep(calls: list[Callable[..., Tensor]]) -> list[Tensor]:
    """``calls[r](reduce_sum=...)`` for every "rank" r, each in its own thread, with a
    ``reduce_sum`` that sums the ranks' tensors as an all-reduce would (a collective: every
    rank waits for the others), however many times the estimator calls it."""
    barrier = threading.Barrier(len(calls), timeout=30)
    slots: list[Tensor | None] = [None] * len(calls)
    out: list[Tensor | None] = [None] * len(calls)

    def run(rank: int) -> None:
        def reduce_sum(x: Tensor) -> Tensor:
            slots[rank] = x.clone()
            barrier.wait()
            total = torch.stack([s for s in slots if s is not None]).sum(dim=0)
            barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return total

        out[rank] = calls[rank](reduce_sum=reduce_sum)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), "a rank failed (see the thread's exception)"
    return [o for o in out if o is not None]


def test_compute_advantages_validates() -> None:
    inputs = make_batch(0, with_kl=False).inputs()
    with pytest.raises(ValueError):
        compute_advantages(PPOClipSettings(), inputs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        compute_advantages(_settings("reinforce_pp", gamma=1.5), inputs)
    bad = AdvantageInputs(
        rewards=inputs.rewards[:-1],
        group_index=inputs.group_index,
        response_mask=inputs.response_mask,
    )
    with pytest.raises(ValueError):
        compute_advantages(GRPOSettings(), bad)


# ---------------------------------------------------------------------------------------------
# PPO clip loss
# ---------------------------------------------------------------------------------------------


def ref_ppo(
    lp: float, old: float, a: float, clip_low: float, clip_high: float, c: float | None
) -> tuple[float, bool, bool]:
    ratio = math.exp(lp - old)
    pg1 = -a * ratio
    pg2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(pg1, pg2)
    dual = c is not None and a < 0 and loss > -a * c
    if dual:
        loss = -a * c
    return loss, pg2 > pg1, dual


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_matches_elementwise_reference(dual_clip: float | None) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (6, 8)
    old = torch.randn(shape, generator=gen, dtype=F64) - 2
    lp = old + 0.8 * torch.randn(shape, generator=gen, dtype=F64)
    adv = torch.randn(shape, generator=gen, dtype=F64)
    lengths = [8, 0, 3, 5, 1, 7]
    mask = torch.tensor([[t < n for t in range(8)] for n in lengths])
    out = ppo_clip_loss(
        lp, old, adv, mask, PPOClipSettings(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    )
    n_clip = n_dual = 0
    for i in range(shape[0]):
        for t in range(shape[1]):
            if not mask[i, t]:
                assert out.loss[i, t].item() == 0.0 and not out.clipped[i, t]
                continue
            args = (lp[i, t].item(), old[i, t].item(), adv[i, t].item())
            loss, clipped, dual = ref_ppo(*args, 0.2, 0.28, dual_clip)
            assert out.loss[i, t].item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
            assert bool(out.clipped[i, t]) == clipped
            assert bool(out.dual_clipped[i, t]) == dual
            n_clip += clipped
            n_dual += dual
    # The random data must actually exercise the clip branches.
    assert n_clip > 3
    assert (n_dual > 0) == (dual_clip is not None)


def test_ppo_dual_clip_bounds_negative_advantage() -> None:
    a, c = -1.5, 3.0
    lp = torch.tensor([[2.0, 2.0]], dtype=F64)  # ratio e^2 ~ 7.39 > c
    old = torch.zeros_like(lp)
    adv = torch.tensor([[a, -a]], dtype=F64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    dual = ppo_clip_loss(
        lp, old, adv, mask, PPOClipSettings(clip_low=0.2, clip_high=0.2, dual_clip=c)
    )
    plain = ppo_clip_loss(
        lp, old, adv, mask, PPOClipSettings(clip_low=0.2, clip_high=0.2, dual_clip=None)
    )
    assert dual.loss[0, 0].item() == -a * c
    assert plain.loss[0, 0].item() == pytest.approx(-a * math.exp(2.0))
    assert plain.loss[0, 0].item() > dual.loss[0, 0].item()
    assert dual.dual_clipped.tolist() == [[True, False]]
    # A >= 0 is untouched by the dual clip.
    assert dual.loss[0, 1].item() == plain.loss[0, 1].item() == pytest.approx(a * 1.2)


def test_ppo_asymmetric_clip() -> None:
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=F64)
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]], dtype=F64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    out = ppo_clip_loss(
        ratios.log(),
        torch.zeros_like(ratios),
        adv,
        mask,
        PPOClipSettings(clip_low=0.2, clip_high=0.28, dual_clip=None),
    )
    # A>0: ratio capped at 1+clip_high; A<0: ratio floored at 1-clip_low; else unclipped.
    _close(out.loss, [[-2.0 * 1.28, -2.0 * 0.5, 2.0 * 1.5, 2.0 * 0.8]], tol=1e-12)
    assert out.clipped.tolist() == [[True, False, False, True]]


def test_ppo_masked_garbage_gives_finite_gradients() -> None:
    lp = torch.tensor([[-1.0, 0.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.2, -1000.0]], dtype=F64)  # exp(1000) overflows if not masked
    adv = torch.tensor([[1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, False]])
    out = ppo_clip_loss(
        lp, old, adv, mask, PPOClipSettings(clip_low=0.2, clip_high=0.2, dual_clip=2.0)
    )
    aggregate(out.loss, mask, "token-mean").backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0


def test_ppo_rejects_bad_dual_clip() -> None:
    x = torch.zeros(1, 1)
    m = torch.ones(1, 1, dtype=torch.bool)
    for c in (1.0, 0.5):
        with pytest.raises(ValueError):
            ppo_clip_loss(x, x, x, m, PPOClipSettings(dual_clip=c))


# ---------------------------------------------------------------------------------------------
# Rollout corrections: weights from the ratio actor-old / rollout logprobs
# ---------------------------------------------------------------------------------------------

LN = math.log
# Per-token log-ratios log(pi_old / pi_rollout); row 0's last token is padding whose rollout
# logprob is garbage (-1000: its raw ratio exp(1000) overflows).
_LOG_RATIO = [
    [0.0, 1.0, -1.0, 1000.0],
    [LN(1.5), LN(0.6), 800.0, -800.0],
    [LN(0.55), LN(1.9), 0.25, -0.25],
]
_MASK = torch.tensor([[True, True, True, False], [True] * 4, [True] * 4])
CORR = {"cap": 2.0, "low": 0.5, "high": 2.0}


def _corr(name: str) -> Any:
    """The rollout correction ``name`` with those of CORR's settings it has."""
    entry = ROLLOUT_CORRECTIONS[name]
    return entry.settings(**{k: v for k, v in CORR.items() if k in entry.setting_names()})


def _corr_inputs(dtype: torch.dtype = F64) -> tuple[Tensor, Tensor]:
    """(old, rollout) with old - rollout = _LOG_RATIO and nontrivial rollout values."""
    rollout = -torch.arange(1, 13, dtype=dtype).reshape(3, 4) / 4
    rollout[0, 3] = -1000.0
    old = rollout + torch.tensor(_LOG_RATIO, dtype=dtype)
    old[0, 3] = 0.0
    return old, rollout


def test_tis_truncates_per_token() -> None:
    old, rollout = _corr_inputs()
    out = tis_weights(old, rollout, _MASK, _corr("tis"))
    e = math.e
    # min(ratio, 2); padding 1 whatever its garbage; exp(800) never formed, exp(-800) -> 0.
    _close(
        out.weight, [[1.0, 2.0, 1 / e, 1.0], [1.5, 0.6, 2.0, 0.0], [0.55, 1.9, e**0.25, e**-0.25]]
    )
    assert out.masked.tolist() == [
        [False, True, False, False],
        [False, False, True, False],
        [False, False, False, False],
    ]


def test_icepop_keeps_ratio_inside_band_and_drops_outside() -> None:
    old, rollout = _corr_inputs()
    out = icepop_weights(old, rollout, _MASK, _corr("icepop"))
    e = math.e
    _close(out.weight, [[1.0, 0.0, 0.0, 1.0], [1.5, 0.6, 0.0, 0.0], [0.55, 1.9, e**0.25, e**-0.25]])
    assert out.masked.tolist() == [
        [False, True, True, False],
        [False, False, True, True],
        [False, False, False, False],
    ]


def test_token_mask_is_one_inside_band_and_zero_outside() -> None:
    old, rollout = _corr_inputs()
    out = token_mask_weights(old, rollout, _MASK, _corr("token_mask"))
    _close(out.weight, [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert (
        out.masked.tolist() == icepop_weights(old, rollout, _MASK, _corr("icepop")).masked.tolist()
    )


def test_seq_tis_truncates_the_product_over_each_response() -> None:
    old, rollout = _corr_inputs()
    out = seq_tis_weights(old, rollout, _MASK, _corr("tis"))
    # Row 0: 1 * e * e^-1 = 1 (padding excluded); row 1: 1.5 * 0.6 * e^800 * e^-800 = 0.9;
    # row 2: 0.55 * 1.9 * e^0.25 * e^-0.25 = 1.045. Nothing truncated...
    _close(out.weight, [[1.0] * 4, [0.9] * 4, [1.045] * 4], tol=1e-9)
    assert not out.masked.any()
    # ...until a response's product passes the cap: every token of it is cut to 2.
    big = torch.tensor([[5.0, 5.0, 0.0], [0.1, 0.2, -3.0]], dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = seq_tis_weights(big, torch.zeros_like(big), mask, _corr("seq_tis"))
    _close(out.weight, [[2.0, 2.0, 1.0], [math.exp(-2.7)] * 3], tol=1e-12)
    assert out.masked.tolist() == [[True, True, False], [False, False, False]]


def test_no_correction_is_one() -> None:
    old, rollout = _corr_inputs()
    out = correction_weights(old, rollout, _MASK, _corr("none"))
    _close(out.weight, [[1.0] * 4] * 3)
    assert not out.masked.any()


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
@pytest.mark.kernels
def test_correction_weights_are_detached_and_finite(name: str) -> None:
    for dtype in (torch.float32, F64):
        old, rollout = _corr_inputs(dtype)
        old.requires_grad_(True)
        rollout.requires_grad_(True)
        out = correction_weights(old, rollout, _MASK, _corr(name))
        assert out.weight.dtype == dtype and out.weight.shape == old.shape
        assert not out.weight.requires_grad and out.weight.grad_fn is None
        assert torch.isfinite(out.weight).all()
        # A loss weighted by them: the gradient reaches the current logprobs only, scaled
        # by the weight, and nothing flows into the old or rollout logprobs.
        # Current logprobs near the old ones, as within a PPO step.
        lp = (old.detach() + torch.tensor([0.1, -0.1, 0.3, 0.0], dtype=dtype)).requires_grad_()
        adv = torch.ones_like(old)
        pg = ppo_clip_loss(
            lp,
            old.detach(),
            adv,
            _MASK,
            PPOClipSettings(clip_low=0.2, clip_high=0.2, dual_clip=None),
        )
        (pg.loss * out.weight).sum().backward()
        assert old.grad is None and rollout.grad is None
        assert torch.isfinite(lp.grad).all()
        ratio = torch.exp(lp.detach() - old.detach())
        unclipped = (ratio < 1.2) & _MASK  # A > 0: the clip is active above 1 + clip_high
        torch.testing.assert_close(
            lp.grad, torch.where(unclipped, -ratio * out.weight, 0.0), rtol=1e-6, atol=0
        )


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


REF_KL = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,
}


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(kind: str) -> None:
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(4, 6, generator=gen, dtype=F64) - 1
    ref = lp + torch.randn(4, 6, generator=gen, dtype=F64)
    out = kl_estimate(lp, ref, KL_ESTIMATORS[kind].settings())
    expected = [
        [REF_KL[kind](a, r) for a, r in zip(la, lr, strict=True)]
        for la, lr in zip(lp.tolist(), ref.tolist(), strict=True)
    ]
    _close(out, expected, tol=1e-12)
    if kind != "k1":
        assert (out >= 0).all()
    assert out.abs().max() > 0.1


def test_kl_estimators_are_unbiased_monte_carlo() -> None:
    p = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    true_kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=True))
    gen = torch.Generator().manual_seed(1234)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    lp, lq = p.log()[samples][None], q.log()[samples][None]
    assert kl_estimate(lp, lq, K1Settings()).mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_estimate(lp, lq, K3Settings()).mean().item() == pytest.approx(true_kl, abs=0.01)
    assert true_kl > 0.1  # a distinguishable pair, so the tolerance is meaningful


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------


LENGTHS = [3, 0, 7, 1, 5, 2]


def ragged_loss(seed: int = 2) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(len(LENGTHS), 7, generator=gen, dtype=F64)
    mask = torch.tensor([[t < n for t in range(7)] for n in LENGTHS])
    return loss.masked_fill(~mask, float("nan")), mask  # NaN padding must be ignored


def ref_aggregate(rows: list[list[float]], lengths: list[int], mode: str) -> float:
    sums = [sum(row[:n]) for row, n in zip(rows, lengths, strict=True)]
    n_tokens = sum(lengths)
    n_seqs = len(lengths)  # empty rows count as (zero-loss) sequences
    if mode == "token-mean":
        return sum(sums) / n_tokens
    if mode == "seq-mean-token-sum":
        return sum(sums) / n_seqs
    return sum(s / n for s, n in zip(sums, lengths, strict=True) if n > 0) / n_seqs


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_matches_reference(mode: AggregationName) -> None:
    loss, mask = ragged_loss()
    out = aggregate(loss, mask, mode)
    assert out.dim() == 0 and torch.isfinite(out)
    _close(out, ref_aggregate(loss.tolist(), LENGTHS, mode), tol=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.kernels
def test_aggregate_micro_batches_sum_to_whole(mode: AggregationName) -> None:
    loss, mask = ragged_loss(seed=3)
    whole = aggregate(loss, mask, mode)
    n_tokens = float(sum(LENGTHS))
    n_seqs = float(len(LENGTHS))
    splits = [(0, 2), (2, 3), (3, 6)]
    total = sum(
        aggregate(loss[a:b], mask[a:b], mode, num_tokens=n_tokens, num_seqs=n_seqs)
        for a, b in splits
    )
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    # Local denominators would NOT add up: the global counts are what make this exact.
    naive = sum(aggregate(loss[a:b], mask[a:b], mode) for a, b in splits)
    assert not torch.allclose(naive, whole)


def test_seq_mean_token_sum_norm_micro_batches_sum_to_verl_on_the_whole() -> None:
    """Micro-batches (or ranks) given the global counts, as the train stage passes them, add
    up to verl's agg_loss on the whole mini-batch: the sum of every valid token's loss over
    the constant length, whatever the split."""
    loss, mask = ragged_loss(seed=4)
    verl = sum(sum(row[:n]) for row, n in zip(loss.tolist(), LENGTHS, strict=True)) / 16
    for splits in ([(0, 6)], [(0, 2), (2, 3), (3, 6)], [(i, i + 1) for i in range(6)]):
        total = sum(
            aggregate(
                loss[a:b],
                mask[a:b],
                "seq-mean-token-sum-norm",
                num_tokens=float(sum(LENGTHS)),
                num_seqs=float(len(LENGTHS)),
                norm_len=16.0,
            )
            for a, b in splits
        )
        _close(total, verl, tol=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_empty_batch_is_zero(mode: AggregationName) -> None:
    loss = torch.full((2, 3), float("nan"), dtype=F64)
    assert aggregate(loss, torch.zeros(2, 3, dtype=torch.bool), mode).item() == 0.0


# ---------------------------------------------------------------------------------------------
# Logit utilities
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [4, 1024])
@pytest.mark.kernels
def test_entropy_matches_categorical(chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(3, 5, 11, generator=gen, dtype=F64)
    logits[0, 0, 0] = 80.0  # a near-deterministic position stresses the stable formulation
    out = entropy_from_logits(logits, chunk_rows=chunk_rows)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert out.shape == (3, 5)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.kernels
def test_gather_logprobs_matches_categorical(temperature: float) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(3, 5, 11, generator=gen, dtype=F64)).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    out = gather_logprobs(logits, tokens, temperature, chunk_rows=4)
    expected = torch.distributions.Categorical(logits=logits / temperature).log_prob(tokens)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.kernels
def test_logit_utilities_upcast_half_precision() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 50, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 3), generator=gen)
    reference = logits.float()
    ent = entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, entropy_from_logits(reference))
    torch.testing.assert_close(gather_logprobs(logits, tokens), gather_logprobs(reference, tokens))


# ---------------------------------------------------------------------------------------------
# KL controllers
# ---------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_sequence() -> None:
    ctl = make_kl_controller(AdaptiveKLSettings(target=6.0, horizon=10_000), init_coef=0.1)
    assert isinstance(ctl, AdaptiveKLController)
    # (kl, n_steps, coef after): error clipped to +0.2, zero, clipped to -0.2, unclipped +0.1.
    steps = [
        (12.0, 256, 0.1 * 1.00512),
        (6.0, 256, 0.100512),
        (3.0, 512, 0.100512 * 0.98976),
        (6.6, 1000, 0.09948275712 * 1.01),
    ]
    for kl, n, expected in steps:
        ctl.update(kl, n)
        assert ctl.coef == pytest.approx(expected, rel=1e-12)
    assert ctl.coef == pytest.approx(0.1004775846912, rel=1e-12)


def test_kl_controller_state_dict_round_trip() -> None:
    ctl = AdaptiveKLController(0.05, 2.0, 500)
    ctl.update(4.0, 100)
    state = ctl.state_dict()
    assert state == {"coef": pytest.approx(0.05 * 1.04)}
    restored = AdaptiveKLController(1.0, 2.0, 500)
    restored.load_state_dict(state)
    assert restored.coef == ctl.coef
    ctl.update(1.5, 50)
    restored.update(1.5, 50)
    assert restored.coef == ctl.coef != state["coef"]


def test_fixed_kl_controller() -> None:
    ctl = make_kl_controller(FixedKLSettings(), init_coef=0.02)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 1000)
    assert ctl.coef == 0.02
    ctl.load_state_dict({"coef": 0.5})
    assert ctl.state_dict() == {"coef": 0.5}
    with pytest.raises(UnknownVariantError, match="pid"):
        KL_CONTROLLERS["pid"]
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLSettings(horizon=0)
