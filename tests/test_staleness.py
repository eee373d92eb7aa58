"""Bounded staleness by schedule (`rollout.staleness`, k): the rollout of step s samples from
the weights after train step s-1-k, generated in the step that starts with them.

A tiny random model earns no verifier reward, so the runs use the dense synthetic reward of
`configs/tiny_dense.yaml`. The SIGKILL sweep at k=1 is `test_chaos.py`'s `hf-stale1` case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import TESTS_ON_PATH, events, final_weights, stage_history, submit, trajectories

from jobs import status
from rftpipe.inspect.cli import main as inspect_main
from rftpipe.run.staleness import generated_in, weights_of
from rftpipe.stages import ORDER
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore
from tools.bench import staleness as bench_staleness

STEPS = 4


def _run(tmp_path_factory: pytest.TempPathFactory, k: int) -> Path:
    run = tmp_path_factory.mktemp(f"k{k}") / "run"
    out = submit(run, f"total_steps={STEPS}", f"rollout.staleness={k}")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, 0)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run(tmp_path_factory, 1)


def _begins(run: Path) -> list[tuple[int, str]]:
    return [(e["step"], e["stage"]) for e in events(run) if e["event"] == "stage_begin"]


def _step(table: pa.Table, step: int) -> pa.Table:
    return table.filter(pa.compute.equal(table.column("step"), step))


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_every_step_is_generated_once_from_the_weights_it_is_scheduled_for(k: int) -> None:
    """The driver's order (its own generation if not yet done, then `generated_in`), run
    for every length: each step is generated once, no later than it trains, in the step
    whose starting weights (those of train step g-1) are the ones `weights_of` names."""
    for total in range(1, 9):
        made_in: dict[int, int] = {}
        for s in range(1, total + 1):
            if s not in made_in:
                made_in[s] = s
            for later in generated_in(s, k, total):
                assert later not in made_in, (k, total, later)
                made_in[later] = s
        assert sorted(made_in) == list(range(1, total + 1))
        for step, g in made_in.items():
            assert g <= step
            assert weights_of(step, k) == g - 1, (k, total, step, g)
            assert weights_of(step, k) == max(0, step - 1 - k)


def test_synchronous_run_keeps_the_chain_of_stages(sync_run: Path) -> None:
    """k=0 is the synchronous run: each step runs its own five stages in order, once, and
    samples from the weights of the step before (its default, so every other test of the
    suite runs it too)."""
    assert _begins(sync_run) == [(s, st) for s in range(1, STEPS + 1) for st in ORDER]
    t = trajectories(sync_run)
    for s in range(1, STEPS + 1):
        assert set(_step(t, s).column("weight_version").to_pylist()) == {s - 1}


@pytest.mark.tier1
def test_stale_rollouts_sample_the_scheduled_weights(sync_run: Path, stale_run: Path) -> None:
    """k=1: step s's rows carry the weights of train step s-2 (0 for steps 1 and 2), step
    s+1 is generated before step s's advantage stage, PPO's old logprobs are the actor's
    recomputation (decoupled PPO's proximal policy), which differs from the stale sampling
    policy, and the metrics report the lag."""
    begins = _begins(stale_run)
    for s in range(1, STEPS):
        assert begins.index((s + 1, "rollout")) < begins.index((s, "advantage")), s
    assert len(begins) == len(set(begins)) == STEPS * len(ORDER)

    t = trajectories(stale_run)
    metrics = [m for m in _metrics(stale_run) if m["step"] >= 1]
    for s, m in zip(range(1, STEPS + 1), metrics, strict=True):
        rows = _step(t, s)
        assert set(rows.column("weight_version").to_pylist()) == {max(0, s - 2)}
        assert m["rollout/staleness"] == min(1, s - 1)
        gap = max(
            float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(
                rows.column("old_logprobs").to_pylist(),
                rows.column("logprobs").to_pylist(),
                strict=True,
            )
        )
        # Step 1 sampled from the weights it trains (float noise only); later steps from
        # weights one update older.
        assert (gap < 1e-5) if s == 1 else (gap > 1e-2), (s, gap)

    # The same seeds: step 1 samples the same tokens at k=0 and k=1 (both from the initial
    # weights), step 2 not (k=0 samples from the first update).
    ref = trajectories(sync_run)
    same = (
        _step(ref, 1).column("response_token_ids").equals(_step(t, 1).column("response_token_ids"))
    )
    assert same
    assert (
        not _step(ref, 2)
        .column("response_token_ids")
        .equals(_step(t, 2).column("response_token_ids"))
    )
    # It trains: nonzero advantages, and weights that moved away from k=0's.
    adv = np.concatenate([np.asarray(a) for a in t.column("advantages").to_pylist()])
    assert np.abs(adv).max() > 0.1
    wa, wb = final_weights(sync_run), final_weights(stale_run)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) > 1e-4


def test_generation_beside_training_equals_the_sequential_order(
    stale_run: Path, tmp_path: Path
) -> None:
    """`rollout.overlap`: step s+1 is generated in a background thread while step s trains,
    and the run equals the sequential k=1 run bitwise (the engine's own copy of the weights
    is the one the step started with; seeds do not depend on timing)."""
    run = tmp_path / "run"
    out = submit(run, f"total_steps={STEPS}", "rollout.staleness=1", "rollout.overlap=true")
    assert out.returncode == 0, out.stderr[-3000:]
    threads = {
        (e["step"], e["stage"]): e.get("thread") for e in events(run) if e["event"] == "stage_begin"
    }
    assert len(threads) == STEPS * len(ORDER)
    for (step, stage), thread in threads.items():
        beside = stage in ("rollout", "score") and step > 1
        assert thread == (f"generate-{step}" if beside else None), (step, stage, thread)
    assert all("thread" not in e for e in events(stale_run))
    assert trajectories(run).equals(trajectories(stale_run))
    wa, wb = final_weights(stale_run), final_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_status_and_inspect_name_the_steps_generated_before_they_train(
    stale_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The k=1 run as it stood after step 2 (steps 3 and 4 generated, neither trained):
    `jobs.status` and `inspect summary` list them; the finished run lists none."""
    run = tmp_path / "run"
    shutil.copytree(stale_run, run)
    store = StageStore(RunDir(run))
    for step in (4, 3):
        for stage in ("sync", "train", "advantage"):
            store.uncommit(step, stage)
    expected = "step 3 (rollout, score); step 4 (rollout, score)"
    assert status.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "steps: 2/4 committed" in out
    assert f"generated, not yet trained (rollout.staleness=1): {expected}" in out
    assert inspect_main([str(run), "summary"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"generated, not yet trained: {expected}"
    assert status.main([str(stale_run), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["generated_ahead"] == {} and info["staleness"] == 1


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_killed_right_after_a_future_rollout_commits_resumes_bitwise(tmp_path: Path) -> None:
    """k=2: step 1 generates steps 1, 2 and 3 before it trains; kill the run right after
    step 3's score commits (the 6th commit). The resumed run equals an uninterrupted one
    bitwise, and no committed stage ran again (step 3's generation is not redone)."""
    steps = (f"total_steps={STEPS}", "rollout.staleness=2")
    ref = tmp_path / "ref"
    assert submit(ref, *steps).returncode == 0
    run = tmp_path / "run"
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "5"}
    assert submit(run, *steps, env=env).returncode != 0
    commits = [(e["step"], e["stage"]) for e in events(run) if e["event"] == "commit"]
    assert commits == [
        (1, "rollout"),
        (1, "score"),
        (2, "rollout"),
        (2, "score"),
        (3, "rollout"),
        (3, "score"),
    ]
    out = submit(run, *steps)
    assert out.returncode == 0, out.stderr[-3000:]
    for key, seq in stage_history(run).items():
        assert seq.count("begin") == 1 and seq.count("commit") == 1, (key, seq)
    assert trajectories(run).equals(trajectories(ref))
    wa, wb = final_weights(ref), final_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


#: What must compose with k >= 1 (issue 33), each killed once right after a future step's
#: rollout commits and resumed: actor-critic PPO (its values and update read train step
#: s-1's critic), a KL loss under the adaptive controller (its coefficient, train step s-1's),
#: and multi-turn episodes committed turn by turn.
COMPOSED = {
    "critic": ("advantage.estimator=gae", "critic.lr=1e-3", "critic.warmup_steps=1"),
    "kl_adaptive": ("kl.mode=loss", "kl.coef=0.1", "kl.controller=adaptive"),
    "episodes": (
        "rollout.env.path=envs_toy:EvenChars",
        "rollout.env.max_turns=2",
        "rollout.env.max_total_tokens=96",
        "reward.functions=[]",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(COMPOSED))
def test_composes_with_stale_rollouts_and_resumes_bitwise(case: str, tmp_path: Path) -> None:
    steps = ("total_steps=3", "rollout.staleness=1", *COMPOSED[case])
    ref = tmp_path / "ref"
    out = submit(ref, *steps, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(ref)
    for s in (1, 2, 3):
        assert set(_step(t, s).column("weight_version").to_pylist()) == {max(0, s - 2)}
    assert "old_logprobs" in t.column_names
    if case == "critic":
        assert "values" in t.column_names
    # Killed right after step 3's rollout commits, inside step 2 (after step 1's seven
    # commits, and each committed turn of an episode run's).
    commits = [(e["step"], e["stage"]) for e in events(ref) if e["event"] == "commit"]
    skip = commits.index((3, "rollout"))
    assert commits.index((2, "advantage")) > skip > commits.index((1, "sync"))
    run = tmp_path / "run"
    env = {**TESTS_ON_PATH, "RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": str(skip)}
    assert submit(run, *steps, env=env).returncode != 0
    commits = [(e["step"], e["stage"]) for e in events(run) if e["event"] == "commit"]
    assert commits[-1] == (3, "rollout"), commits
    out = submit(run, *steps, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    for key, seq in stage_history(run).items():
        # An episode's turns (`rollout.tN`) commit inside the rollout stage, without a begin.
        assert seq.count("commit") == 1, (key, seq)
        assert seq.count("begin") == (key[1] in ORDER), (key, seq)
    assert trajectories(run).equals(t)
    wa, wb = final_weights(ref), final_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_one_and_two_trainer_ranks_agree_at_k1(tmp_path: Path) -> None:
    """FSDP2 on 1 and 2 ranks at k=1: the same samples and rewards, final weights within
    1e-5 relative (the reduction order differs), as the synchronous run's
    `test_distributed.py::test_pipeline_is_world_size_independent`. On 2 ranks with
    generation beside training, whose collectives run on a group of their own, the run
    equals the 2-rank sequential one bitwise."""
    runs = {}
    for name, world, overlap in (("w1", 1, False), ("w2", 2, False), ("w2-overlap", 2, True)):
        run = tmp_path / name
        out = submit(
            run,
            "train.backend=fsdp2",
            "total_steps=3",
            "rollout.staleness=1",
            f"rollout.overlap={str(overlap).lower()}",
            "data.prompts_per_step=8",
            "rollout.groups_per_call=2",
            extra=("--tasks-per-node", str(world)),
            timeout=500,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = run
    cols = ["prompt_id", "sample_idx", "response_token_ids", "reward", "weight_version"]
    a, b = trajectories(runs["w1"]), trajectories(runs["w2"])
    assert a.select(cols).equals(b.select(cols))
    assert set(b.column("rank").to_pylist()) == {0, 1}
    wa, wb = final_weights(runs["w1"]), final_weights(runs["w2"])
    num = sum(float((wa[k] - wb[k]).pow(2).sum()) for k in wa) ** 0.5
    den = sum(float(wa[k].pow(2).sum()) for k in wa) ** 0.5
    assert num / den < 1e-5, num / den
    assert trajectories(runs["w2-overlap"]).equals(b)
    wc = final_weights(runs["w2-overlap"])
    assert all(torch.equal(wb[k], wc[k]) for k in wb)
    beside = [e for e in events(runs["w2-overlap"]) if e.get("thread")]
    assert {e["rank"] for e in beside} == {0, 1}


@pytest.mark.slow
def test_the_behaviour_weight_of_decoupled_ppo_is_a_rollout_correction(tmp_path: Path) -> None:
    """AReaL's decoupled loss (behaviour weight pi_prox / pi_behav, tokens above a cap
    dropped) is `icepop` with low 0: at k=1 its weights are 1 up to float noise on step 1
    (sampled by the weights it trains) and move away from 1 on the stale steps."""
    run = tmp_path / "run"
    out = submit(
        run,
        "total_steps=3",
        "rollout.staleness=1",
        "train.rollout_correction={type: icepop, low: 0.0, high: 5.0}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = {x["step"]: x for x in _metrics(run)}
    assert abs(m[1]["train/correction_weight_mean"] - 1) < 1e-5
    assert m[1]["train/correction_masked_frac"] == 0
    for s in (2, 3):
        assert abs(m[s]["train/correction_weight_mean"] - 1) > 1e-3, m[s]


def test_the_benchmark_reads_busy_time_and_steady_steps_from_the_event_log(
    tmp_path: Path,
) -> None:
    """`tools.bench.staleness.measure` on a hand-written k=1 overlapped log: generation of
    step 2 (3-6.5 s) beside step 1's training (3-7.5 s)."""
    stages = [  # (step, stage, begin, commit)
        (1, "rollout", 0.0, 2.0),
        (1, "score", 2.0, 3.0),
        (1, "advantage", 3.0, 4.0),
        (2, "rollout", 3.0, 6.0),
        (1, "train", 4.0, 7.0),
        (2, "score", 6.0, 6.5),
        (1, "sync", 7.0, 7.5),
        (2, "advantage", 7.5, 8.0),
        (2, "train", 8.0, 10.0),
        (2, "sync", 10.0, 10.5),
    ]
    log = []
    for step, stage, begin, commit in stages:
        log.append({"t": begin, "rank": 0, "event": "stage_begin", "step": step, "stage": stage})
        log.append({"t": commit, "rank": 0, "event": "commit", "step": step, "stage": stage})
        # Another rank's events and an episode turn's commits are not rank 0's stages.
        log.append({"t": commit + 50, "rank": 1, "event": "commit", "step": step, "stage": stage})
    log.append({"t": 1.0, "rank": 0, "event": "commit", "step": 1, "stage": "rollout.t1"})
    log.sort(key=lambda e: e["t"])
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    m = bench_staleness.measure(tmp_path, samples_per_step=48)
    assert m["span_s"] == 10.5
    assert m["step_s"] == [3.0] and m["steady_step_s"] == 3.0
    assert m["completions_per_s"] == 16.0
    assert m["generation_busy_s"] == 6.5  # 0-3 and 3-6.5
    assert m["training_busy_s"] == 7.5  # 3-7.5 and 7.5-10.5
    line = m["timeline"]
    assert len(line) == 60 and line[0] == "g" and line[-1] == "t" and "#" in line
