"""An agent episode of several sequences (`rollout.agent.branches=split`): the score stage
scores it once and gives every row its reward columns, the advantage stage gives every row
the advantage its last row gets with group statistics over episodes, the train stage's
mini-batches take an episode whole, and the metrics count episodes."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from helpers import TINY

from rftpipe.algos.advantage import AdvantageInputs, compute_advantages, compute_episode_advantages
from rftpipe.algos.variants import ADVANTAGE_ESTIMATORS, GRPOSettings, ReinforcePPSettings
from rftpipe.config.loader import ConfigError, from_dict, load_config
from rftpipe.config.schema import AdvantageConfig, KLConfig, RewardConfig, RunConfig
from rftpipe.rewards import resolve_all
from rftpipe.stages import advantage, score
from rftpipe.stages.batching import TrainInputs, minibatch_plan
from rftpipe.storage.branch_rows import episode_rows, last_flags, last_row_index, last_rows
from rftpipe.storage.episode_stats import EpisodeCounts

# (prompt_id, sample_idx, branch, branches, response length, env_reward): prompt 1's sample 0
# has two sequences, sample 2 three; prompt 2's sample 0 one.
ROWS = [
    (1, 0, 0, 2, 3, 0.0),
    (1, 0, 1, 2, 4, 1.0),
    (1, 1, 0, 1, 2, 0.0),
    (1, 2, 0, 3, 5, 0.0),
    (1, 2, 1, 3, 2, 0.0),
    (1, 2, 2, 3, 3, 0.5),
    (2, 0, 0, 1, 4, 2.0),
    (2, 1, 0, 1, 3, 0.0),
]


def _table(rows=ROWS) -> pa.Table:  # noqa: ANN001
    return pa.Table.from_pylist(
        [
            {
                "step": 1,
                "prompt_id": p,
                "sample_idx": k,
                "prompt": "q",
                "prompt_token_ids": [1, 2],
                "response": f"r{p}{k}{b}",
                "response_token_ids": list(range(n)),
                "response_length": n,
                "finish_reason": "stop",
                "logprobs": [-0.5] * n,
                "answer": None,
                "metadata": "{}",
                "loss_mask": [1] * n,
                "turn_offsets": [0],
                "turn_rewards": [env],
                "turn_infos": ["{}"],
                "num_turns": 1,
                "env_reward": env,
                "episode_status": "done",
                "messages": "[]",
                "branch": b,
                "branches": nb,
            }
            for p, k, b, nb, n, env in ROWS
            if (p, k, b, nb, n, env) in rows
        ]
    )


def test_an_episodes_rows_are_found_by_its_last() -> None:
    t = _table()
    assert last_flags(t) == [False, True, True, False, False, True, True, True]
    assert episode_rows(t).num_rows == 5
    assert last_rows(t) == [1, 1, 2, 5, 5, 5, 6, 7]
    assert last_row_index(t) == [0, 0, 1, 2, 2, 2, 3, 4]
    broken = t.take([1, 0, 2])  # branch 1 before branch 0
    with pytest.raises(ValueError, match="branch 0 of 2 is not followed"):
        last_row_index(broken)


def test_score_scores_an_episode_once_and_gives_each_row_its_reward() -> None:
    cfg = from_dict(
        RewardConfig, {"functions": [{"path": "reward_fns:last_digit", "name": "digit"}]}
    )
    out = score.run(cfg, resolve_all(cfg, None), _table())
    rows = out.to_pylist()
    # Each row has its episode's last sequence's score (r101 scores 1, and r100 gets it),
    # plus the episode's environment return.
    assert [r["reward_digit"] for r in rows] == [1.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0]
    assert [r["reward_env"] for r in rows] == [1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, 0.0]
    assert [r["reward"] for r in rows] == [2.0, 2.0, 0.0, 2.5, 2.5, 2.5, 2.0, 0.0]
    assert out.column_names[: len(_table().column_names)] == _table().column_names


def _scored() -> pa.Table:
    t = _table()
    return t.append_column("reward", pa.array([0.0, 1.0, 0.0, 0.0, 0.0, 3.0, 2.0, 0.5]))


def test_advantages_are_per_episode_and_shared_by_its_sequences() -> None:
    t = _scored()
    cfg = advantage.AdvantageStageConfig(
        advantage=AdvantageConfig(estimator=GRPOSettings()), kl=KLConfig(mode="none"), kl_coef=0.0
    )
    out, _ = advantage.run(cfg, t, None, lambda x: x)
    adv = out.column("advantages").to_pylist()
    # The same as GRPO over the episodes alone (one row each)...
    last = episode_rows(t).drop(["branch", "branches"])
    alone, _ = advantage.run(cfg, last, None, lambda x: x)
    by_episode = [a[0] for a in alone.column("advantages").to_pylist()]
    assert [a for a, f in zip(adv, last_flags(t), strict=True) if f] == alone.column(
        "advantages"
    ).to_pylist()
    # ...and each earlier sequence has its episode's advantage on each of its tokens.
    for row, ep in zip(adv, last_row_index(t), strict=True):
        assert row == [by_episode[ep]] * len(row)
    # Prompt 1's three episodes: rewards 1, 0, 3 (not 0, 1, 0, 0, 0, 3 over its rows).
    assert by_episode[0] == pytest.approx(
        (1 - 4 / 3) / torch.tensor([1.0, 0, 3]).std().item(), rel=1e-5
    )


def test_token_level_estimators_refuse_branches() -> None:
    inputs = AdvantageInputs(
        rewards=torch.tensor([0.0, 1.0], dtype=torch.float64),
        group_index=torch.tensor([1, 1]),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="reinforce_pp"):
        compute_episode_advantages(ReinforcePPSettings(), inputs, torch.tensor([1, 1]))
    # Without branches (each row its own last), the same numbers as compute_advantages.
    got = compute_episode_advantages(GRPOSettings(), inputs, torch.tensor([0, 1]))
    assert torch.equal(got, compute_advantages(GRPOSettings(), inputs))


# ReMax's greedy baseline is refused with agents on its own (test_agents.py).
@pytest.mark.parametrize("estimator", sorted(set(ADVANTAGE_ESTIMATORS.names()) - {"remax"}))
def test_the_config_refuses_what_cannot_share_an_advantage(estimator: str) -> None:
    agent = ["rollout.agent.path=agents_e2e:even_tokens", "reward.functions=[]"]
    per_sequence = ADVANTAGE_ESTIMATORS[estimator].traits.per_sequence
    extra = ["critic.lr=1e-5"] if estimator == "gae" else []
    args = [*agent, f"advantage.estimator={estimator}", *extra]
    if per_sequence:
        load_config(RunConfig, TINY, args)
        with pytest.raises(ConfigError, match="kl.mode=reward"):
            load_config(RunConfig, TINY, [*args, "kl.mode=reward", "kl.coef=0.01"])
    else:
        with pytest.raises(ConfigError) as err:
            load_config(RunConfig, TINY, args)
        assert "\n" not in str(err.value) and "branches=refuse" in str(err.value)
    load_config(RunConfig, TINY, [*args, "rollout.agent.branches=refuse"])


def test_a_mini_batch_takes_an_episode_whole() -> None:
    t = _table()
    samples = sorted({(r["prompt_id"], r["sample_idx"]) for r in t.to_pylist()})
    inp = TrainInputs(
        step=1, run_seed=0, table=t, global_samples=samples, kl_coef=0.0, temperature=1.0
    )
    plan = minibatch_plan(inp, 0, 5)
    assert sorted(i for mb in plan for i in mb) == list(range(t.num_rows))
    keys = [(r["prompt_id"], r["sample_idx"]) for r in t.to_pylist()]
    assert all(len({keys[i] for i in mb}) == 1 for mb in plan)
    assert sorted(len(mb) for mb in plan) == [1, 1, 1, 2, 3]


def test_episode_counts_count_episodes_and_branches() -> None:
    counts = EpisodeCounts.of(_table())
    m = counts.metrics()
    assert counts.episodes == 5 and m["episode/branches_mean"] == 3 / 5
    assert m["episode/turns_mean"] == 8 / 5 and m["episode/done_frac"] == 1.0
    assert (
        "episode/branches_mean"
        not in EpisodeCounts.of(_table().drop(["branch", "branches"])).metrics()
    )


def test_a_prompt_met_twice_in_a_step_trains_each_of_its_episodes_once() -> None:
    """A step that straddles an epoch boundary may hold a prompt twice: each occurrence of
    a sample in the global order takes the next of its episodes on this rank."""
    t = _table().take([0, 1, 0, 1, 6])  # prompt 1's sample 0 twice (two sequences each)
    samples = [(1, 0), (1, 0), (2, 0)]
    inp = TrainInputs(
        step=1, run_seed=0, table=t, global_samples=samples, kl_coef=0.0, temperature=1.0
    )
    plan = minibatch_plan(inp, 0, 3)
    assert sorted(i for mb in plan for i in mb) == [0, 1, 2, 3, 4]
    assert sorted(sorted(mb) for mb in plan) == [[0, 1], [2, 3], [4]]
