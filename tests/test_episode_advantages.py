"""Advantages over multi-turn episodes: environment tokens are not steps, and each turn's
environment reward is credited where it was paid (token-level estimators) or summed into
the episode's return (sequence-level ones)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from helpers import TESTS_ON_PATH, submit, trajectories

from rftpipe.algos.advantage import (
    AdvantageInputs,
    _discounted_returns,
    _token_outcome,
    compute_advantages,
    gae_returns,
)
from rftpipe.algos.variants import (
    ADVANTAGE_ESTIMATORS,
    GAESettings,
    GRPOSettings,
    ReinforcePPSettings,
)
from rftpipe.config.loader import load_config
from rftpipe.config.schema import AdvantageConfig, KLConfig, RunConfig
from rftpipe.stages import advantage
from rftpipe.stages.batching import turn_tokens

# One episode of 3 turns: model tokens (1) and the environment's (0) between them.
LOSS_MASK = [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1]
OFFSETS = [0, 5, 10]
TURN_REWARDS = [0.5, -0.25, 1.0]


def _compressed(x: torch.Tensor, mask: list[int]) -> torch.Tensor:
    return x[:, torch.tensor(mask, dtype=torch.bool)]


def test_turn_rewards_sit_on_each_turns_last_model_token() -> None:
    placed = turn_tokens([OFFSETS], [TURN_REWARDS], [LOSS_MASK], (1, len(LOSS_MASK) + 2))[0]
    want = torch.zeros(1, len(LOSS_MASK) + 2, dtype=torch.float64)
    want[0, 2], want[0, 6], want[0, 13] = 0.5, -0.25, 1.0
    assert torch.equal(placed, want)
    # A turn cut to no model token pays on the last one before it.
    placed = turn_tokens([[0, 3, 3]], [[1.0, 2.0, 4.0]], [[1, 1, 0, 0]], (1, 4))[0]
    assert placed[0].tolist() == [0.0, 7.0, 0.0, 0.0]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.7, 0.0)])
def test_gae_over_an_episode_equals_gae_over_its_model_tokens_alone(
    gamma: float, lam: float
) -> None:
    """Environment tokens are skipped: the same numbers as the model tokens laid end to end."""
    gen = torch.Generator().manual_seed(0)
    t = len(LOSS_MASK)
    values = torch.randn(1, t, dtype=torch.float64, generator=gen)
    mask = torch.tensor([LOSS_MASK], dtype=torch.bool)
    turns = turn_tokens([OFFSETS], [TURN_REWARDS], [LOSS_MASK], (1, t))[0]
    settings = GAESettings(gamma=gamma, lam=lam)
    episode = AdvantageInputs(
        rewards=torch.tensor([sum(TURN_REWARDS) + 2.0], dtype=torch.float64),
        group_index=torch.zeros(1, dtype=torch.int64),
        response_mask=mask,
        values=values,
        turn_rewards=turns,
    )
    n = sum(LOSS_MASK)
    flat_turns = _compressed(turns, LOSS_MASK)
    flat = AdvantageInputs(
        rewards=episode.rewards,
        group_index=episode.group_index,
        response_mask=torch.ones(1, n, dtype=torch.bool),
        values=_compressed(values, LOSS_MASK),
        turn_rewards=flat_turns,
    )
    got, want = gae_returns(episode, settings), gae_returns(flat, settings)
    assert torch.equal(_compressed(got, LOSS_MASK), want)
    assert bool((got[~mask] == 0).all())
    # With gamma = lam = 1, the return at a token is every reward paid from its turn on
    # (the reward functions' 2.0 at the end): a turn is not credited with earlier turns'.
    if gamma == lam == 1.0:
        firsts = [0, 5, 10]
        assert [float(got[0, j]) for j in firsts] == pytest.approx([3.25, 2.75, 3.0])


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_turn_gamma_discounts_each_turn_once(estimator: str) -> None:
    """With gamma = lam = 1 and turn_gamma g, a reward paid j turns after a token's turn
    reaches it times g^j: turn t's first token's return is sum_j g^(j-t) r_j."""
    t = len(LOSS_MASK)
    mask = torch.tensor([LOSS_MASK], dtype=torch.bool)
    starts = turn_tokens([OFFSETS], [TURN_REWARDS], [LOSS_MASK], (1, t))[1]
    assert starts[0].nonzero().flatten().tolist() == [0, 5, 10]
    turns = turn_tokens([OFFSETS], [TURN_REWARDS], [LOSS_MASK], (1, t))[0]
    rewards = torch.tensor([sum(TURN_REWARDS) + 2.0], dtype=torch.float64)
    g = 0.5
    inputs = AdvantageInputs(
        rewards=rewards,
        group_index=torch.zeros(1, dtype=torch.int64),
        response_mask=mask,
        values=torch.zeros(1, t, dtype=torch.float64),
        turn_rewards=turns,
        turn_starts=starts,
    )
    # Per turn: 0.5, -0.25 and 1.0 + the reward functions' 2.0 on the last.
    r = [0.5, -0.25, 3.0]
    want = [r[0] + g * r[1] + g * g * r[2], r[1] + g * r[2], r[2]]
    if estimator == "gae":
        got = gae_returns(inputs, GAESettings(gamma=1.0, lam=1.0, turn_gamma=g))
        assert [float(got[0, j]) for j in (0, 5, 10)] == pytest.approx(want)
        # Within a turn there is no discount: its tokens' returns are equal.
        assert float(got[0, 0]) == pytest.approx(float(got[0, 2]))
    else:
        # The returns before whitening (the estimator whitens them over the batch).
        got = _discounted_returns(_token_outcome(inputs), 1.0, mask, starts, g)
        assert [float(got[0, j]) for j in (0, 5, 10)] == pytest.approx(want)
        adv = compute_advantages(ReinforcePPSettings(turn_gamma=g), inputs)
        flat = compute_advantages(ReinforcePPSettings(), inputs)
        assert not torch.allclose(adv, flat)


def test_reinforce_pp_discounts_over_model_tokens_only() -> None:
    n = sum(LOSS_MASK)
    settings = ReinforcePPSettings(gamma=0.9)
    # Two rows so whitening has a spread: the episode, and a flat row standing for it.
    ep = torch.stack([torch.tensor(LOSS_MASK, dtype=torch.bool), torch.ones(14, dtype=torch.bool)])
    got = compute_advantages(
        settings,
        AdvantageInputs(
            response_mask=ep,
            rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
            group_index=torch.tensor([0, 1]),
        ),
    )
    flat_mask = torch.zeros(2, 14, dtype=torch.bool)
    flat_mask[0, :n] = True
    flat_mask[1] = True
    want = compute_advantages(
        settings,
        AdvantageInputs(
            response_mask=flat_mask,
            rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
            group_index=torch.tensor([0, 1]),
        ),
    )
    assert torch.allclose(_compressed(got[:1], LOSS_MASK), want[:1, :n], rtol=0, atol=1e-12)


def _episode_table(rewards: list[float]) -> pa.Table:
    rows = len(rewards)
    return pa.table(
        {
            "prompt_id": [7] * rows,
            "prompt_token_ids": [[1, 2, 3]] * rows,
            "response_token_ids": [list(range(5, 5 + len(LOSS_MASK)))] * rows,
            "logprobs": [[-1.0] * len(LOSS_MASK)] * rows,
            "loss_mask": pa.array([LOSS_MASK] * rows, pa.list_(pa.int8())),
            "turn_offsets": pa.array([OFFSETS] * rows, pa.list_(pa.int32())),
            "turn_rewards": pa.array([[r / 3] * 3 for r in rewards], pa.list_(pa.float64())),
            "reward": rewards,
        }
    )


def test_the_advantage_stage_leaves_environment_tokens_out() -> None:
    """GRPO (sequence-level) gives every model token the episode's advantage and the
    environment's tokens none; GAE reads the critic's values over the model tokens only."""
    table = _episode_table([0.0, 3.0])
    mask = torch.tensor(LOSS_MASK, dtype=torch.bool)
    cfg = advantage.AdvantageStageConfig(
        advantage=AdvantageConfig(estimator=GRPOSettings()), kl=KLConfig(mode="none"), kl_coef=0.0
    )
    out, _ = advantage.run(cfg, table, None, lambda x: x)
    adv = torch.tensor(out.column("advantages").to_pylist())
    assert bool((adv[:, ~mask] == 0).all())
    assert adv[0, mask].unique().numel() == 1 and float(adv[0, 0]) < 0 < float(adv[1, 0])

    def critic(prompts: list, responses: list) -> list[list[float]]:
        return [[0.1 * j for j in range(len(r))] for r in responses]

    cfg = advantage.AdvantageStageConfig(
        advantage=AdvantageConfig(estimator=GAESettings(gamma=1.0, lam=1.0)),
        kl=KLConfig(mode="none"),
        kl_coef=0.0,
    )
    out, metrics = advantage.run(cfg, table, None, lambda x: x, critic_values=critic)
    returns = torch.tensor(out.column("returns").to_pylist(), dtype=torch.float64)
    assert bool((returns[:, ~mask] == 0).all())
    # gamma = lam = 1: each turn's first token's return is the rewards paid from it on.
    assert returns[1, [0, 5, 10]].tolist() == pytest.approx([3.0, 2.0, 1.0])
    assert "critic/explained_var" in metrics


def test_every_estimator_takes_episodes() -> None:
    env = ["rollout.env.path=envs_toy:EvenChars"]
    for estimator in ADVANTAGE_ESTIMATORS.names():
        extra = ["critic.lr=1e-5"] if estimator == "gae" else []
        cfg = load_config(RunConfig, None, [*env, f"advantage.estimator={estimator}", *extra])
        assert cfg.rollout.env is not None


ENV_RUN = (
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    "reward.functions=[]",
    "total_steps=2",
)
ENV_PATH = TESTS_ON_PATH


@pytest.mark.slow
def test_a_remax_run_plays_a_greedy_baseline_episode_per_prompt(tmp_path: Path) -> None:
    """ReMax over episodes through the real entry point: one greedy episode per prompt
    (sample n, `is_baseline`), scored and used as the group's baseline, never trained on."""
    run = tmp_path / "remax"
    out = submit(run, *ENV_RUN, "advantage.estimator=remax", env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(run).to_pandas()
    n = int(t["sample_idx"].max())
    base = t[t["is_baseline"]]
    assert len(base) == t.groupby(["step", "prompt_id"]).ngroups and (base["sample_idx"] == n).all()
    assert (base["num_turns"] >= 1).all() and (t["num_turns"] == 2).any()
    for _, r in base.iterrows():
        assert all(a == 0.0 for a in r["advantages"]) and all(lp == 0.0 for lp in r["logprobs"])
    # A sample's advantage is its return minus its group's greedy episode's return.
    for _, group in t.groupby(["step", "prompt_id"]):
        greedy = float(group[group["is_baseline"]]["reward"].iloc[0])
        for _, r in group[~group["is_baseline"]].iterrows():
            model = [a for a, m in zip(r["advantages"], r["loss_mask"], strict=True) if m]
            assert model and all(a == pytest.approx(r["reward"] - greedy) for a in model)


@pytest.mark.slow
def test_a_multi_turn_run_with_a_critic_trains_on_model_tokens(tmp_path: Path) -> None:
    """PPO with GAE over episodes through the real entry point: the critic's values, its
    targets and the advantages are 0 on the environment's tokens, and the critic learns."""
    run = tmp_path / "gae"
    out = submit(run, *ENV_RUN, "advantage.estimator=gae", "critic.lr=1e-4", env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(run).to_pandas()
    assert (t["num_turns"] == 2).any()
    for _, r in t.iterrows():
        env_tokens = [j for j, m in enumerate(r["loss_mask"]) if not m]
        for column in ("advantages", "returns"):
            assert all(r[column][j] == 0.0 for j in env_tokens), column
        model = [j for j, m in enumerate(r["loss_mask"]) if m]
        assert any(r["advantages"][j] != 0.0 for j in model)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/explained_var" in row for row in rows)
