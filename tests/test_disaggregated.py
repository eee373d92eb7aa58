"""Separate rollout ranks (`launch.rollout_ranks`): a local job whose last ranks only
generate and whose first rank only trains, handing the weights over through RUN/handoff.

Every run here is compared bitwise with the colocated run of the same staleness (one
rank doing every stage): the schedule, not the placement, fixes which weights sample each
step, so trajectories and final weights must be equal. `launch.threads=1` on both sides:
the ranks of a local job split the cores, and a matmul's sums may depend on its threads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, events, final_weights, stage_history, submit, trajectories

from rftpipe.faults import HANDOFF_FAULT_POINTS
from rftpipe.stages import ORDER

pytestmark = pytest.mark.slow
THREADS = "launch.threads=1"
STEPS = 6
TWO = ("--tasks-per-node", "2")
THREE = ("--tasks-per-node", "3")


def _reference(root: Path, staleness: int) -> Path:
    ref = root / f"colocated-k{staleness}"
    out = submit(ref, THREADS, f"rollout.staleness={staleness}", f"total_steps={STEPS}")
    assert out.returncode == 0, out.stderr[-3000:]
    return ref


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _reference(tmp_path_factory.mktemp("disaggregated"), 1)


def _assert_equal_runs(run: Path, ref: Path) -> None:
    # `rank` says which rank wrote a row: the placement, nothing the row holds.
    a, b = (trajectories(r).drop_columns(["rank"]) for r in (ref, run))
    assert a.num_rows == b.num_rows == STEPS * 4 * 4
    assert a.equals(b), "trajectories differ from the colocated run"
    wa, wb = final_weights(ref), final_weights(run)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"


def _assert_nothing_committed_ran_again(run: Path) -> None:
    history = stage_history(run)
    assert set(history) == {(s, st) for s in range(1, STEPS + 1) for st in ORDER}
    for key, seq in history.items():
        assert seq.count("commit") == 1, (key, seq)
        assert "begin" not in seq[seq.index("commit") + 1 :], (key, seq)


@pytest.mark.tier1
def test_a_rollout_rank_generates_what_the_colocated_run_generates(
    colocated: Path, tmp_path: Path
) -> None:
    """Rank 1 runs every rollout and score stage, rank 0 the rest; the trainer publishes
    exactly the versions a later step samples from (v >= 1 samples step v+2 at k=1), and
    the hand-over directory is gone at the end."""
    run = tmp_path / "run"
    out = submit(run, THREADS, "rollout.staleness=1", "launch.rollout_ranks=1", extra=TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_equal_runs(run, colocated)
    ranks: dict[str, set[int]] = {}
    for e in events(run):
        if e["event"] == "stage_begin":
            ranks.setdefault(e["stage"], set()).add(e["rank"])
    assert ranks == {
        "rollout": {1},
        "score": {1},
        "advantage": {0},
        "train": {0},
        "sync": {0},
    }, ranks
    published = [e["version"] for e in events(run) if e["event"] == "handoff_publish"]
    assert published == list(range(1, STEPS - 1)), published
    assert not (run / "handoff").exists()
    # Each role's busy seconds reached the trainer's metrics: generation's from rank 1 (rank
    # 0 generates nothing). Which of the trainer's steps see them grow depends on timing:
    # rank 1 may finish two steps' generation between two of the trainer's readings, or
    # before its first (3 of 6 steps saw growth in one fast-tier run, 4 or more before).
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["perf/generation_busy_s"] >= 0 for m in lines), lines
    assert sum(m["perf/generation_busy_s"] for m in lines) > 0, lines
    assert all(m["perf/training_busy_s"] > 0 for m in lines)
    # Each step sampled from the weights of train step s-2 (the rows record it).
    t = trajectories(run)
    pairs = set(
        zip(t.column("step").to_pylist(), t.column("weight_version").to_pylist(), strict=True)
    )
    assert pairs == {(s, max(0, s - 2)) for s in range(1, STEPS + 1)}, pairs


def test_kills_on_either_role_resume_bitwise_on_another_rollout_rank_count(
    colocated: Path, tmp_path: Path
) -> None:
    """SIGKILLs at the trainer's hand-over (weights half written), mid train step while
    the rollout rank generates a later step, at a shard of either role, and after a
    commit; the run then finishes with two rollout ranks instead of one. It equals the
    colocated run bitwise, and no committed stage ran again."""
    run = tmp_path / "run"
    one = (THREADS, "rollout.staleness=1", "launch.rollout_ranks=1")
    kills = [
        ("handoff_mid_publish", 0),
        ("train_mid_step", 1),
        ("shard_before_rename", 2),
        ("stage_after_commit", 3),
    ]
    for point, skip in kills:
        env = {"RFTPIPE_FAULT": point, "RFTPIPE_FAULT_SKIP": str(skip)}
        res = submit(run, *one, env=env, extra=TWO)
        assert res.returncode != 0, f"{point} was never reached: {res.stdout[-2000:]}"
    two = (THREADS, "rollout.staleness=1", "launch.rollout_ranks=2")
    out = submit(run, *two, config=None, extra=THREE)
    assert out.returncode == 0, out.stderr[-3000:]

    hit = {e["point"] for e in events(run) if e["event"] == "fault"}
    assert hit == {p for p, _ in kills} and set(HANDOFF_FAULT_POINTS) <= hit, hit
    _assert_nothing_committed_ran_again(run)
    _assert_equal_runs(run, colocated)
    # The last start's rollout ranks were 1 and 2, and both generated.
    last_start = max(i for i, e in enumerate(events(run)) if e["event"] == "start")
    late = {
        e["rank"]
        for e in events(run)[last_start:]
        if e["event"] == "stage_begin" and e["stage"] == "rollout"
    }
    assert late == {1, 2}, late


def test_staleness_two_killed_once_resumes_bitwise(tmp_path: Path) -> None:
    """k=2 with a rollout rank: killed after the 8th commit of a process, resumed, equal
    to the colocated k=2 run."""
    ref = _reference(tmp_path, 2)
    run = tmp_path / "run"
    args = (THREADS, "rollout.staleness=2", "launch.rollout_ranks=1")
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "7"}
    assert submit(run, *args, env=env, extra=TWO).returncode != 0
    out = submit(run, *args, config=None, extra=TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_nothing_committed_ran_again(run)
    _assert_equal_runs(run, ref)


def test_a_failing_rollout_rank_stops_the_trainer(tmp_path: Path) -> None:
    """The rollout rank's score stage raises (a reward function's error): the trainer,
    waiting for that step's generation, stops too and rank 0 prints the rollout rank's
    error in one line (exit 2), rather than waiting forever (under Slurm nothing else ends
    the wait)."""
    run = tmp_path / "run"
    out = submit(
        run,
        THREADS,
        "launch.rollout_ranks=1",
        "reward.functions=[bad_rewards:boom]",
        extra=TWO,
        env={"PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"},
        timeout=180,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    line = [x for x in out.stderr.splitlines() if x.startswith("rftpipe: error:")]
    assert len(line) == 1 and "the rollout ranks failed" in line[0] and "boom" in line[0], (
        out.stderr[-5000:]
    )
    assert not (run / "stages" / "step=1" / "score" / "MANIFEST.json").exists()
