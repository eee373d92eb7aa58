"""DAPO's dynamic sampling: the selection rule, mini-batches of a short batch, and real runs
(which groups are kept, durable rounds under SIGKILL, 1 vs 2 ranks, a short step)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from helpers import (
    ROOT,
    events,
    final_weights,
    stage_history,
    submit,
    trajectories,
    weights_rel_diff,
)
from safetensors.torch import load_file

from rftpipe.data.sampler import SamplerState, global_window
from rftpipe.engines.models import prepare_tiny
from rftpipe.stages import chain_position, generation
from rftpipe.stages.batching import TrainInputs, minibatch_plan
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore

TESTS = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": f"{TESTS}:{ROOT}"}
#: A binary reward of a random model: about 1 group in 8 (n=4) scores alike and is dropped.
#: fsdp2, so that the same run can go on 1 and 2 ranks.
DAPO = (
    "train.backend=fsdp2",
    "rollout.dynamic_sampling.enabled=true",
    "rollout.dynamic_sampling.max_rounds=4",
    "reward.functions=[{path: reward_fns:first_token_even}]",
    "total_steps=8",
)


# -- the rule ------------------------------------------------------------------------------


def test_select_takes_the_first_varied_groups_in_round_order() -> None:
    rounds = [[3, 1], [5, 3, 7], [9]]
    assert generation.select(rounds, 3) == [[3, 1], [5], []]
    # Prompt 3 met again in round 1 (an epoch boundary inside the step) counts once.
    assert generation.select(rounds, 4) == [[3, 1], [5, 7], []]
    assert generation.select(rounds, 9) == [[3, 1], [5, 7], [9]]
    assert generation.filled(rounds, 5) and not generation.filled(rounds, 6)
    assert generation.select([], 4) == [] and not generation.filled([], 1)


def test_varied_groups() -> None:
    t = pa.table(
        {
            "prompt_id": [1, 1, 2, 2, 3, 3, 4, 4],
            "reward_acc": [1.0, 0.0, 1.0, 0.0, None, None, None, 1.0],
            # Prompt 2's greedy baseline row (ReMax) differs, but is not the policy's sample;
            # a null (a component that does not apply) is a value like any other.
            "is_baseline": [False, False, False, True, False, False, False, False],
        }
    )
    assert generation.varied_groups(t, "reward_acc") == {1, 4}


def test_minibatches_of_a_short_batch_hold_whole_groups() -> None:
    def plan(groups: int, n: int, mini_batches: int) -> list[list[tuple[int, int]]]:
        samples = [(p, k) for p in range(groups) for k in range(n)]
        table = pa.table(
            {"prompt_id": [p for p, _ in samples], "sample_idx": [k for _, k in samples]}
        )
        inp = TrainInputs(
            step=3, run_seed=0, table=table, global_samples=samples, kl_coef=0.0, temperature=1.0
        )
        return [[samples[i] for i in mb] for mb in minibatch_plan(inp, 0, mini_batches)]

    # 3 groups of 3 into 2 mini-batches: cut between groups (1 + 2), every sample once.
    mbs = plan(3, 3, 2)
    assert sorted(len(mb) for mb in mbs) == [3, 6]
    for mb in mbs:
        assert all(sum(p == q for q, _ in mb) == 3 for p, _ in mb)
    assert sorted(s for mb in mbs for s in mb) == [(p, k) for p in range(3) for k in range(3)]
    # Fewer groups than mini-batches: one mini-batch per group, none empty.
    assert [len(mb) for mb in plan(1, 3, 4)] == [3]
    # A full batch keeps the equal cut it always had.
    assert [len(mb) for mb in plan(4, 3, 2)] == [6, 6]


def test_round_stages_order_within_a_step(tmp_path: Path) -> None:
    store = StageStore(RunDir(tmp_path))
    names = ["rollout", "score", "rollout.r1", "score.r1", "rollout.r2"]
    for name in names:
        store.commit(1, name, 1, {})
    assert store.newest_commit(chain_position) == (1, "rollout.r2")
    assert sorted(names, key=chain_position) == names
    store.commit(1, "advantage", 1, {})
    store.commit(1, "eval", 1, {})  # not part of the chain
    assert store.newest_commit(chain_position) == (1, "advantage")
    assert chain_position("rollout.r0") is None and chain_position("score.rx") is None


# -- real runs -----------------------------------------------------------------------------


def _manifest(run: Path, step: int, stage: str) -> dict:
    return json.loads((run / "stages" / f"step={step}" / stage / "MANIFEST.json").read_text())


def _rounds(run: Path, step: int) -> list[str]:
    return generation.committed_rounds(StageStore(RunDir(run)), step, "score")


def _round_rows(run: Path, step: int, stage: str) -> pa.Table:
    store = StageStore(RunDir(run))
    m = store.manifest(step, stage)
    return pa.concat_tables([store.read(step, stage, r) for r in range(len(m["shards"]))])


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("dapo") / "run"
    out = submit(run, *DAPO, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.mark.slow
def test_steps_train_on_the_first_varied_groups(dapo_run: Path) -> None:
    run = dapo_run
    traj = trajectories(run)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    consumed, generated = 0, []
    for step in range(1, 9):
        rounds = _rounds(run, step)
        varied = []
        for r, name in enumerate(rounds):
            rows = _round_rows(run, step, name)
            roll = _manifest(run, step, "rollout" if r == 0 else f"rollout.r{r}")
            # Consumed-sample state runs on without a gap across rounds and steps.
            assert roll["sampler"]["consumed_before"] == consumed
            consumed = roll["sampler"]["consumed_after"]
            generated += roll["prompt_ids"]
            # The manifest's varied groups are exactly those whose reward varies, in order.
            by_group: dict[int, set] = {}
            for p, v in zip(rows["prompt_id"].to_pylist(), rows["reward"].to_pylist(), strict=True):
                by_group.setdefault(p, set()).add(v)
            want = [p for p in roll["prompt_ids"] if len(by_group[p]) > 1]
            assert _manifest(run, step, name)["varied"] == want
            varied.append(want)
        kept = [p for ids in generation.select(varied, 4) for p in ids]
        mine = traj.filter(pa.compute.equal(traj["step"], step))
        assert sorted(set(mine["prompt_id"].to_pylist())) == sorted(kept), step
        assert mine.num_rows == 4 * 4
        # Every kept group varies, so it has advantages of both signs.
        for p in kept:
            g = mine.filter(pa.compute.equal(mine["prompt_id"], p))
            assert len(set(g["reward"].to_pylist())) > 1
            flat = [a for row in g["advantages"].to_pylist() for a in row]
            assert min(flat) < 0 < max(flat)
        m = metrics[step - 1]
        assert m["dynamic/rounds"] == len(rounds)
        assert m["dynamic/kept_groups"] == 4 and m["dynamic/shortfall_groups"] == 0
        assert m["dynamic/generated_groups"] == 4 * len(rounds)
    # Some steps needed more rounds, and every prompt was generated once per epoch.
    assert max(len(_rounds(run, s)) for s in range(1, 9)) >= 2
    assert generated == [
        int(i) for i in global_window(20, 0, True, SamplerState(consumed=0), len(generated))
    ]
    initial = load_file(prepare_tiny() / "model.safetensors")
    weights = final_weights(run)
    assert max(float((weights[k] - initial[k]).abs().max()) for k in initial) > 1e-3


@pytest.mark.slow
def test_two_ranks_keep_and_train_the_same_groups(dapo_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "w2"
    out = submit(run, *DAPO, env=ENV, extra=("--tasks-per-node", "2"), timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    cols = ["prompt_id", "sample_idx", "response_token_ids", "reward", "advantages"]
    a, b = trajectories(dapo_run), trajectories(run)
    assert a.select(cols).equals(b.select(cols))
    for step in range(1, 9):
        assert _rounds(run, step) == _rounds(dapo_run, step)
        for name in _rounds(run, step):
            assert _manifest(run, step, name)["varied"] == _manifest(dapo_run, step, name)["varied"]
    assert weights_rel_diff(final_weights(dapo_run), final_weights(run)) < 1e-5


def _commits(run: Path) -> list[tuple[int, str]]:
    return [(e["step"], e["stage"]) for e in events(run) if e["event"] == "commit"]


@pytest.mark.slow
def test_sigkill_in_every_round_resumes_bitwise(dapo_run: Path, tmp_path: Path) -> None:
    """Kill right before and right after the commits of later rounds' stages (and during
    the train stage that follows them): no committed round is generated or scored again,
    and the run ends bitwise equal to the uninterrupted one."""
    ref = _commits(dapo_run)
    targets = [i for i, (_, stage) in enumerate(ref) if ".r" in stage]
    assert len(targets) >= 4
    run = tmp_path / "chaos"
    kills = 0
    for n, t in enumerate(targets[:6]):
        done = len(_commits(run))
        point = "stage_after_commit" if n % 2 else "manifest_before_rename"
        # The k-th commit of this process (k = skip + 1) is the target.
        env = {**ENV, "RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(t - done)}
        res = submit(run, *DAPO, env=env)
        assert res.returncode != 0, f"commit {t} {ref[t]} was never reached"
        kills += 1
    # Mid-way through the next update (its inputs are the rounds' kept rows).
    res = submit(run, *DAPO, env={**ENV, "RFTPIPE_FAULT": "train_mid_step"})
    assert res.returncode != 0
    kills += 1
    final = submit(run, *DAPO, env=ENV)
    assert final.returncode == 0, final.stderr[-3000:]

    assert trajectories(run).equals(trajectories(dapo_run))
    wa, wb = final_weights(dapo_run), final_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"
    history = stage_history(run)
    assert {k for k in history if ".r" in k[1]} == {
        k for k in stage_history(dapo_run) if ".r" in k[1]
    }
    for key, seq in history.items():
        assert seq.count("commit") == 1, (key, seq)
        assert "begin" not in seq[seq.index("commit") + 1 :], (key, seq)
    # The kills before a round's commit made it run twice; those after, once.
    reruns = {k for k, seq in history.items() if seq.count("begin") > 1}
    assert any(".r" in st for _, st in reruns), reruns
    assert sum(e["event"] == "start" for e in events(run)) == kills + 1


@pytest.mark.slow
def test_shortfall_fails_then_resumes_with_more_rounds(tmp_path: Path) -> None:
    """A random model is never correct: no group's accuracy varies. With on_shortfall=fail
    the step stops with exit 2 after max_rounds, its rounds committed; resumed with more
    rounds and on_shortfall=train it reads those rounds back, generates the rest, and trains
    on nothing (the weights stay the initial ones)."""
    ds = (
        "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.metric=accuracy",
        "reward.functions=[dense_even_tokens,accuracy]",
        "total_steps=2",
    )
    run = tmp_path / "run"
    fail = ("rollout.dynamic_sampling.max_rounds=2", "rollout.dynamic_sampling.on_shortfall=fail")
    res = submit(run, *ds, *fail)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "step 1" in lines[0] and "0 of the 4 groups" in lines[0] and "max_rounds" in lines[0]
    assert _rounds(run, 1) == ["score", "score.r1"]
    more = ("rollout.dynamic_sampling.max_rounds=3", "rollout.dynamic_sampling.on_shortfall=train")
    res = submit(run, *ds, *more, config=None)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _rounds(run, 1) == ["score", "score.r1", "score.r2"]
    history = stage_history(run)
    assert all(seq.count("begin") == 1 for seq in history.values()), history
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["dynamic/kept_groups"] for m in metrics] == [0, 0]
    assert [m["dynamic/shortfall_groups"] for m in metrics] == [4, 4]
    assert [m["train/updates"] for m in metrics] == [0.0, 0.0]
    # No kept row: no reward means in the metrics (not NaN, which is not JSON).
    for m in metrics:
        assert not {"rollout/reward_mean", "rollout/reward_accuracy"} & m.keys(), m
    assert trajectories(run).num_rows == 0
    initial = load_file(prepare_tiny() / "model.safetensors")
    weights = final_weights(run)
    assert all(torch.equal(weights[k], initial[k]) for k in initial)
