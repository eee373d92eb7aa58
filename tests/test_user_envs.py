"""A user's own skyrl-gym environment class (`rollout.env.path: skyrl:pkg.mod:Class`) and a
dataset row's `env_class` (SkyRL's layout: one run mixes environments), issue 31 items 2 and
4, through `python -m jobs.submit` on the tiny model. The user's class is
`tests/envs_skyrl_user.py:GuessNumber`, defined outside skyrl-gym and never registered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from envs_skyrl_user import reward
from helpers import TESTS_ON_PATH, kill_mid_turn_and_resume, submit, trajectories

from rftpipe.config.schema import EnvConfig
from rftpipe.errors import UserError

GUESS = "skyrl:envs_skyrl_user:GuessNumber"
HINTS = {"Higher.", "Lower.", "Guess a number in [1, 50]."}
STEPS = (
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    # The environment's reward is the whole return.
    "reward.functions=[]",
    "total_steps=2",
)


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _guessed(row: dict[str, Any]) -> None:
    """Assert `row` is a GuessNumber episode: its `init` prompt, its hints, and its rewards,
    recomputed from the recorded actions, are the trajectory's."""
    messages = json.loads(row["messages"])
    assert messages[0] == {"role": "system", "content": "Guess a number in [1, 50]."}, messages
    actions = [m["content"] for m in messages if m["role"] == "assistant"]
    assert row["turn_rewards"] == [reward(a, int(row["answer"])) for a in actions]
    assert row["reward"] == pytest.approx(sum(row["turn_rewards"]))
    observed = [m["content"] for m in messages[2:] if m["role"] == "user"]
    assert set(observed) <= HINTS, observed


@pytest.mark.slow
def test_a_users_skyrl_class_runs_in_environment_workers(tmp_path: Path) -> None:
    """`rollout.env.workers=2`: the class is imported by path in each worker (nothing is
    registered there); `workers=0` is the mixed run below, whose config names it too."""
    run = tmp_path / "run"
    out = submit(
        run, f"rollout.env.path={GUESS}", "rollout.env.workers=2", *STEPS, env=TESTS_ON_PATH
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = trajectories(run).to_pylist()
    assert len(rows) == 2 * 4 * 4
    for r in rows:
        _guessed(r)
    assert sum(r["env_reward"] > 0 for r in rows) > len(rows) // 2
    assert all(m["rollout/reward_mean"] > 0 for m in _metrics(run))


# --------------------------------------------------------------------- per-row env_class

#: A SkyRL-layout dataset: chat `prompt`, `env_class`, `reward_spec`, `extra_info`. Rows
#: name a skyrl-gym id as SkyRL writes it, a plain class by path, or nothing (the config's
#: environment, `rollout.env.path`).
CLASSES = ["gsm8k_multi_turn", "envs_toy:EvenChars", None, "gsm8k_multi_turn"] * 2
ENVS = {
    "gsm8k_multi_turn": "skyrl:gsm8k_multi_turn",
    "envs_toy:EvenChars": "envs_toy:EvenChars",
    None: GUESS,
}


def _skyrl_rows(path: Path, classes: list[str | None]) -> Path:
    rows = [
        {
            "data_source": "mixed",
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}],
            "env_class": c,
            "reward_spec": {"method": "rule", "ground_truth": str(2 * i + 3)},
            "extra_info": {"index": i},
        }
        for i, c in enumerate(classes)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _mixed(data: Path, workers: int) -> tuple[str, ...]:
    return (
        "data.source=datasets",
        f"data.datasets=[{{path: {data}, answer_column: reward_spec.ground_truth}}]",
        f"rollout.env.path={GUESS}",
        f"rollout.env.workers={workers}",
        *STEPS,
    )


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the dataset, an uninterrupted 2-step run over it with environments in-process)."""
    d = tmp_path_factory.mktemp("mixed")
    data = _skyrl_rows(d / "skyrl.parquet", CLASSES)
    out = submit(d / "run", *_mixed(data, 0), env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    return data, d / "run"


@pytest.mark.slow
def test_each_rows_env_class_makes_its_episodes_with_metrics_per_environment(
    mixed: tuple[Path, Path],
) -> None:
    _, run = mixed
    rows = trajectories(run).to_pylist()
    assert len(rows) == 2 * 4 * 4  # every prompt of the one epoch, 4 samples each
    seen = set()
    for r in rows:
        env = ENVS[json.loads(r["metadata"])["env_class"]]
        seen.add(env)
        messages = json.loads(r["messages"])
        observed = [m["content"] for m in messages if m["role"] == "user"][1:]
        if env == GUESS:  # the row names none: the config's environment
            _guessed(r)
        elif env == "skyrl:gsm8k_multi_turn":
            assert all("#### ANSWER" in o for o in observed), observed
        else:
            assert all(o.startswith("Again, more even. (turn ") for o in observed), observed
            assert [json.loads(i)["turn"] for i in r["turn_infos"]] == [1, 2][: r["num_turns"]]
        assert r["episode_status"] != "error"
    assert seen == set(ENVS.values())
    # Per environment, its episodes' reward mean and how they ended.
    for m in _metrics(run):
        step = [r for r in rows if r["step"] == m["step"]]
        for env in ENVS.values():
            mine = [r for r in step if ENVS[json.loads(r["metadata"])["env_class"]] == env]
            assert m[f"episode/{env}/episodes"] == len(mine)
            if mine:
                want = sum(r["reward"] for r in mine) / len(mine)
                assert m[f"episode/{env}/reward_mean"] == pytest.approx(want)
                done = sum(r["episode_status"] == "done" for r in mine) / len(mine)
                assert m[f"episode/{env}/done_frac"] == pytest.approx(done)


@pytest.mark.slow
def test_a_mixed_run_killed_mid_turn_resumes_bitwise_in_environment_workers(
    mixed: tuple[Path, Path], tmp_path: Path
) -> None:
    """Killed in step 2's second turn; the resumed episodes get their rows' environments back
    (made again in the workers, replayed) and the run equals the in-process one bitwise."""
    data, ref = mixed
    # 4 calls x 2 turns in step 1, then step 2's first turn: the 14th mid-turn point.
    kill_mid_turn_and_resume(ref, tmp_path / "run", _mixed(data, 2), TESTS_ON_PATH, 13, [(2, 1)])


def test_an_unknown_env_class_exits_2_naming_the_row_before_anything_is_committed(
    tmp_path: Path,
) -> None:
    data = _skyrl_rows(tmp_path / "bad.parquet", ["gsm8k_multi_turn", None, "no_such_env", None])
    run = tmp_path / "run"
    out = submit(run, *_mixed(data, 2), env=TESTS_ON_PATH)
    assert out.returncode == 2, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert f"data.datasets[0]: row 2 of '{data}': env_class 'no_such_env'" in line, line
    assert "no skyrl-gym environment 'skyrl:no_such_env'" in line, line
    assert not (run / "stages").exists() or not any((run / "stages").iterdir())
    assert not (run / "trajectories").exists()


def test_a_rows_env_class_names_its_environment() -> None:
    """What a row's `env_class` names: a bare name is a skyrl-gym id (as SkyRL writes it),
    anything else a `rollout.env.path`; none (or null) is the config's environment, with its
    kwargs, which another class does not get."""
    from rftpipe.envs.loader import row_env

    base = EnvConfig(path="envs_toy:EvenChars", kwargs={"feedback": "more"}, max_turns=3)
    assert row_env(base, {}) is base
    assert row_env(base, {"env_class": None}) is base
    assert row_env(base, {"env_class": "envs_toy:EvenChars"}) is base
    gsm = row_env(base, {"env_class": "gsm8k_multi_turn"})
    assert (gsm.path, gsm.kwargs, gsm.max_turns) == ("skyrl:gsm8k_multi_turn", {}, 3)
    assert row_env(base, {"env_class": "skyrl:gsm8k"}).path == "skyrl:gsm8k"
    assert row_env(base, {"env_class": GUESS}).path == GUESS
    for bad, why in [(3, "int 3 is not a string"), ("a b", "path must be")]:
        with pytest.raises(UserError) as err:
            row_env(base, {"env_class": bad}, "row 4")
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("row 4: env_class ") and why in msg, msg
