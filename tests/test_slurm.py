"""The Slurm path against a real local cluster (tools/cluster/slurm_local: slurmctld,
2 slurmd, munge).

Every job is the tiny model on 2 emulated nodes (FSDP2, 2 ranks), compared bitwise with the
same run launched locally with 2 ranks and never interrupted. Preemptions are aimed at known
stages: the watcher waits for a stage's commit marker, then preempts while the next stage
is stretched by ``RFTPIPE_SLOW``, so the ranks must stop at the boundary after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
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

from jobs.slurm import TERMINAL
from tools.cluster import slurm_local
from tools.testing.slow_disk import SlowDisk, job_processes
from tools.testing.slow_disk import Unavailable as SlowDiskUnavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = ("train.backend=fsdp2", "total_steps=5")
SLOW = "rollout=3,score=3,advantage=3,train=3"


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("tools.cluster.slurm_local needs root")
    was_up = slurm_local.is_up()
    env = slurm_local.ensure_up(user_signal=False, grace_time=0)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # for the in-process squeue/scontrol calls
    yield env
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    slurm_local.ensure_up(user_signal=False, grace_time=0)
    if not was_up:
        slurm_local.down()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job run locally on 2 ranks, never interrupted."""
    run = tmp_path_factory.mktemp("slurm_ref") / "run"
    out = submit(run, *STEPS, extra=("--tasks-per-node", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _slurm_submit(
    cluster: dict[str, str], run: Path, *extra: str, env: dict | None = None, timeout=300
) -> subprocess.CompletedProcess:
    return submit(
        run,
        *STEPS,
        cluster="slurm",
        extra=("--nodes", "2", "--partition", "low", *extra),
        env={**cluster, **(env or {})},
        timeout=timeout,
    )


def _job_id(run: Path) -> str:
    return (run / "slurm" / "jobs.txt").read_text().split()[-1]


def _events(run: Path, kind: str | None = None) -> list[dict]:
    return [e for e in events(run) if kind is None or e["event"] == kind]


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _committed(run: Path, step: int, stage: str) -> Callable[[], bool]:
    return lambda: (run / "stages" / f"step={step}" / stage / "MANIFEST.json").exists()


def _job_state(job: str) -> str:
    from jobs.slurm import job_state

    return job_state(job)  # squeue/scontrol under the cluster's SLURM_CONF (see `cluster`)


def _run_cmd(cluster: dict[str, str], *cmd: str) -> str:
    res = subprocess.run(list(cmd), env=cluster, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (cmd, res.stderr)
    return res.stdout


def _preempt_with_high_job(cluster: dict[str, str]) -> None:
    _run_cmd(
        cluster,
        "sbatch",
        "-p",
        "high",
        "-N2",
        "--exclusive",
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 2",
    )


def _assert_equal_to_reference(run: Path, reference: Path) -> None:
    a, b = trajectories(reference), trajectories(run)
    assert a.equals(b)
    wa, wb = final_weights(reference), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    t = b.to_pandas()
    ids = list(t.drop_duplicates(["step", "prompt_id"]).prompt_id)
    assert len(ids) == len(set(ids)) == 20  # 5 steps x 4 prompts, each prompt once


def test_two_node_run_equals_local_run(cluster, reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = _slurm_submit(cluster, run, "--wait")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "slurm job:" in out.stdout and "5/5 steps" in out.stdout
    logs = "".join(p.read_text() for p in (run / "slurm").rglob("*_log.out"))
    # submitit's task header: one task on each of the two nodes
    assert "node=0(2), global_rank=0(2)" in logs and "node=1(2), global_rank=1(2)" in logs
    status = subprocess.run(
        [sys.executable, "-m", "jobs.status", "--json", str(run)],
        capture_output=True,
        text=True,
        env=cluster,
        cwd=ROOT,
        timeout=60,
    )
    info = json.loads(status.stdout)
    assert info["finished"] and info["steps_committed"] == 5
    assert set(info["jobs"].values()) <= {"COMPLETED", "GONE"}, info["jobs"]
    _assert_equal_to_reference(run, reference)


def test_preempted_four_times_at_known_stages(cluster, reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Every stage stretched, not only the four after the triggers: with those alone, the
    # third stop came 3 s after step 2's checkpoint began in the background, and once
    # (11b4287's whole run) the rank still writing it did not end on SIGKILL for 66 s;
    # Slurm drained the node ("Kill task failed") and the lane's next test never started.
    out = _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": SLOW})
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    # (trigger: commit of (step, stage), preempt action, cluster settings, expected stop)
    plan = [
        ((1, "rollout"), "high", False, ("step 1 advantage", "SIGTERM")),
        ((2, "score"), "high", True, ("step 2 train", "SIGUSR2")),
        ((3, "advantage"), "high", False, ("step 3 sync", "SIGTERM")),
        ((4, "rollout"), "requeue", False, ("step 4 advantage", "SIGTERM")),
    ]
    for i, ((step, stage), action, user_signal, _) in enumerate(plan):
        slurm_local.ensure_up(user_signal=user_signal, grace_time=10 if user_signal else 0)
        _wait_for(_committed(run, step, stage), 240, f"step {step} {stage} to commit")
        if action == "high":
            _preempt_with_high_job(cluster)
        else:
            _run_cmd(cluster, "scontrol", "requeue", job)
        _wait_for(lambda n=i + 1: len(_events(run, "stop")) >= 2 * n, 60, f"stop {i + 1}")
    slurm_local.ensure_up(user_signal=False, grace_time=0)
    _wait_for(lambda: _job_state(job) in ("COMPLETED", "GONE"), 400, "job to complete")

    stops = [e for e in _events(run, "stop") if e["rank"] == 0]
    assert [(e["at"], e["signal"]) for e in stops] == [p[3] for p in plan]
    decisions = [e["verdict"] for e in _events(run, "requeue_decision")]
    # Slurm requeues a preempted job itself (TERM); USR2 makes rank 0 requeue it.
    assert decisions[1] == "requeue"
    assert all(
        d.startswith("Slurm is already requeueing") for i, d in enumerate(decisions) if i != 1
    )
    # Each restart resumed right after the last committed stage.
    starts = [e["last_commit"] for e in _events(run, "start")]
    assert starts[1:] == ["(1, 'score')", "(2, 'advantage')", "(3, 'train')", "(4, 'score')"]
    _assert_equal_to_reference(run, reference)


@pytest.mark.timeout(900)
def test_time_limit_requeues_and_finishes(cluster, reference: Path, tmp_path: Path) -> None:
    # USR2 comes 70 s into each allocation (2 minutes, 50 s early). The first allocation's
    # stages are stretched (180 s of sleep), so it cannot finish before; the requeued ones
    # run at full speed, and 70 s holds a loaded CI machine's cold two-rank start-up (most
    # of 45 s there) and the tiny run. A later allocation that does not finish either is
    # stopped and requeued the same way, which the assertions allow.
    run = tmp_path / "run"
    out = _slurm_submit(
        cluster,
        run,
        "--time",
        "2",
        "--signal-delay",
        "50",
        "--wait",
        env={
            "RFTPIPE_SLOW": "rollout=9,score=9,advantage=9,train=9",
            "RFTPIPE_SLOW_ALLOCATIONS": "1",
        },
        timeout=840,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    stops = [e for e in _events(run, "stop") if e["rank"] == 0]
    assert stops and all(e["signal"] == "SIGUSR2" for e in stops)
    assert "requeue" in [e["verdict"] for e in _events(run, "requeue_decision")]
    assert len(_events(run, "start")) == len(stops) + 1
    _assert_equal_to_reference(run, reference)


@pytest.mark.timeout(900)
def test_a_stage_longer_than_the_time_limit_ends_the_job_failed(cluster, tmp_path: Path) -> None:
    """Step 1's rollout outlasts every allocation (2 minutes): USR2 comes 25 s before the end
    with no stage boundary in sight, so rank 0's watchdog requeues the job mid-stage 10 s
    before the end (not a TIMEOUT, which Slurm never requeues). The second start commits
    nothing either: past `launch.max_idle_requeues=1` the job ends FAILED, and the event log
    and `jobs.status` name the stage, how long it ran and the time limit. (With a 1-minute
    limit, CI's loaded machine once started both allocations' ranks after their USR2, 35 s
    in, so no rollout began: 2026-12-03.)"""
    run = tmp_path / "run"
    out = submit(
        run,
        "total_steps=2",
        "launch.max_idle_requeues=1",
        cluster="slurm",
        extra=("--nodes", "1", "--partition", "low", "--time", "2", "--signal-delay", "25"),
        env={**cluster, "RFTPIPE_SLOW": "rollout@1=600"},
    )
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    states = _ended(job, 700)
    assert states[-1] == "FAILED", states
    assert "TIMEOUT" not in states
    starts = [e for e in _events(run, "job_start") if e["rank"] == 0]
    assert [(e["job"], e["time_limit"]) for e in starts] == [(job, "00:02:00")] * 2
    verdicts = [e["verdict"] for e in _events(run, "requeue_decision")]
    assert verdicts == ["requeue", "2 starts without a commit"], verdicts
    (idle,) = _events(run, "idle_requeues")
    assert (idle["job"], idle["starts"], idle["time_limit"]) == (job, 2, "00:02:00")
    # The first start began the rollout (the watchdog, not a boundary, ended it) and ran it
    # until 10 s before its end. The second did the same, unless it came up after its own
    # USR2 (under the whole suite's load its ranks took 33 s to start, 2026-12-03): then it
    # stopped at the boundary before the rollout, which commits nothing either.
    begun = [(e["step"], e["stage"]) for e in _events(run, "stage_begin") if e["rank"] == 0]
    assert begun in ([(1, "rollout")], [(1, "rollout")] * 2), begun
    assert idle["stage"] == "step 1 rollout" and 0 < idle["seconds"] < 120
    stops = [e["at"] for e in _events(run, "stop") if e["rank"] == 0]
    mid = "the job's end, mid-stage"
    assert stops == [mid, mid if len(begun) == 2 else "step 1 rollout"], stops
    assert not list((run / "stages").rglob("MANIFEST.json"))
    shown = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(run)], capture_output=True, text=True, check=True
    ).stdout
    assert f"not requeued: slurm job {job}: 2 starts committed nothing" in shown, shown
    assert "step 1 rollout did not finish" in shown and "time limit is 00:02:00" in shown


def _sbatch(
    cluster: dict[str, str], run: Path, out: str | Path, *flags: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    """A plain `sbatch sbatch/rftpipe.sbatch RUN` (past jobs.submit and its checks)."""
    return subprocess.run(
        [
            "sbatch",
            *flags,
            "-p",
            "low",
            f"--output={out}",
            str(ROOT / "sbatch" / "rftpipe.sbatch"),
            str(run),
        ],
        env={**cluster, "RFTPIPE_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def _ended(job: str, timeout: float) -> list[str]:
    """The job's states, polled until one is final (the last)."""
    states: list[str] = []  # Slurm lists an ended job for MinJobAge (5 s) only: polled
    _wait_for(lambda: states.append(_job_state(job)) or states[-1] in TERMINAL, timeout, job)
    return states


def test_a_second_job_of_a_live_run_is_refused(cluster, reference: Path, tmp_path: Path) -> None:
    """While job A runs: `jobs.submit` of the same run submits nothing; a plain sbatch of it
    starts and its worker refuses (exit 2, FAILED) naming A; `--submit-anyway` queues a job
    that waits for A (afterany). A is untouched: it equals the uninterrupted local run."""
    run = tmp_path / "run"
    assert _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": SLOW}).returncode == 0
    a = _job_id(run)
    _wait_for(_committed(run, 1, "rollout"), 240, "the first commit")
    again = _slurm_submit(cluster, run)
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"already has slurm job {a} (RUNNING)" in again.stderr
    sent = _sbatch(cluster, run, tmp_path / "b.out", "--parsable", "-N1")
    assert sent.returncode == 0, sent.stderr
    b = sent.stdout.strip().split(";")[0]
    assert _ended(b, 240)[-1] == "FAILED"
    said = (tmp_path / "b.out").read_text()
    assert f"rftpipe: error: run_dir: {run} is held by slurm job {a} (since " in said, said
    refused = [e["message"] for e in _events(run, "user_error")]
    assert len(refused) == 1 and f"slurm job {a}" in refused[0]
    later = _slurm_submit(cluster, run, "--submit-anyway")
    assert later.returncode == 0, later.stderr
    c = _job_id(run)
    assert _job_info_field(c, "Dependency") == f"afterany:{a}(unfulfilled)"
    assert _ended(a, 400)[-1] == "COMPLETED"
    assert _ended(c, 240)[-1] == "COMPLETED"  # found the run finished
    _assert_equal_to_reference(run, reference)


def test_a_resume_racing_a_requeue_and_a_killed_jobs_record(
    cluster, reference: Path, tmp_path: Path
) -> None:
    """Job A is requeued (`scontrol requeue`): while it waits, a resume by hand is refused
    by jobs.submit and, asked anyway, by its worker; A's own restart is the same holder and
    goes on. Then A is killed (SIGKILL): its record stays, but an ended job does not block
    the next submission, which finishes the run as an uninterrupted one."""
    run = tmp_path / "run"
    assert _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": SLOW}).returncode == 0
    a = _job_id(run)
    _wait_for(_committed(run, 1, "rollout"), 240, "the first commit")
    _run_cmd(cluster, "scontrol", "requeue", a)
    by_hand = submit(run, config=None)
    assert by_hand.returncode == 2 and f"already has slurm job {a}" in by_hand.stderr
    forced = submit(run, config=None, extra=("--submit-anyway",), env=cluster)
    assert forced.returncode == 2, forced.stderr
    assert f"is held by slurm job {a} (since" in forced.stderr
    _wait_for(lambda: len(_events(run, "job_start")) == 2, 240, "A's restart")
    _wait_for(_committed(run, 2, "rollout"), 240, "a commit of A's restart")
    assert len(_events(run, "user_error")) == 1  # the resume by hand, not A's restart
    _run_cmd(cluster, "scancel", "--signal=KILL", a)
    assert _ended(a, 120)[-1] in ("CANCELLED", "GONE")
    assert json.loads((run / ".holder.json").read_text())["job"] == a
    out = _slurm_submit(cluster, run, "--wait", timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads((run / ".holder.json").read_text())["job"] == _job_id(run) != a
    _assert_equal_to_reference(run, reference)


def _job_info_field(job: str, key: str) -> str | None:
    from rftpipe.run.slurm_job import job_info

    return job_info(job).get(key)


def test_stop_during_replay_requeues_without_recomputing(cluster, tmp_path: Path) -> None:
    """A restart replays the committed train steps after its checkpoint (none here: steps
    1-3 replay from the initial weights). USR2 during that replay stops the job before the
    next replayed step, rank 0 requeues it once, and the requeued job replays again and
    finishes: no committed stage is computed again."""
    run = tmp_path / "run"
    steps = ("total_steps=4", "checkpoint.interval=10")
    # Killed locally right after step 4's rollout commit (5 commits a step: the 16th).
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "15"}
    assert submit(run, *steps, env=env).returncode != 0
    assert not list((run / "checkpoints").glob("step=*"))
    manifests = {
        p: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted((run / "stages").rglob("MANIFEST.json"))
    }
    assert len(manifests) == 16
    out = submit(
        run,
        *steps,
        config=None,
        cluster="slurm",
        extra=("--nodes", "1", "--partition", "low"),
        env={**cluster, "RFTPIPE_SLOW": "train_replay@1=6"},
    )
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    _wait_for(lambda: bool(_events(run, "replay")), 240, "step 1's replay")
    # In the pause after step 1's replayed update: what a time limit would send.
    _run_cmd(cluster, "scancel", "--signal=USR2", job)
    _wait_for(_committed(run, 4, "sync"), 400, "the requeued job's last commit")
    _wait_for(lambda: _job_state(job) in ("COMPLETED", "GONE"), 120, "the job to complete")

    assert [(e["at"], e["signal"]) for e in _events(run, "stop")] == [
        ("step 2 train replay", "SIGUSR2")
    ]
    assert [e["verdict"] for e in _events(run, "requeue_decision")] == ["requeue"]
    # The local run, the job that stopped, its requeued run: only the last one replayed
    # past step 1, and every replayed update equals its commit.
    starts = [e["t"] for e in _events(run, "start")]
    assert len(starts) == 3
    replayed = [(e["step"], e["identical"], e["t"] > starts[2]) for e in _events(run, "replay")]
    assert replayed == [(1, True, False), (1, True, True), (2, True, True), (3, True, True)]
    # No committed stage began again: the Slurm jobs computed only what had not committed,
    # and the manifests are as the local run left them.
    later = [(e["step"], e["stage"]) for e in _events(run, "stage_begin") if e["t"] > starts[1]]
    assert later == [(4, "score"), (4, "advantage"), (4, "train"), (4, "sync")]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in manifests} == manifests
    assert (run / "export" / "config.json").exists()


def test_scancel_stays_cancelled(cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": SLOW})
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    _wait_for(_committed(run, 1, "rollout"), 240, "the first commit")
    _run_cmd(cluster, "scancel", job)
    _wait_for(lambda: bool(_events(run, "requeue_decision")), 60, "the requeue decision")
    # Longer than cred_expire + 1 (11 s), after which a requeued job would start again.
    time.sleep(20)
    assert _job_state(job) in ("CANCELLED", "GONE")
    assert len(_events(run, "start")) == 1
    verdict = _events(run, "requeue_decision")[0]["verdict"]
    assert verdict != "requeue" and not verdict.startswith("Slurm is already"), verdict
    assert not (run / "stages" / "step=5").exists()


def test_a_requeue_that_fails_ends_the_job_failed(cluster, tmp_path: Path) -> None:
    """USR2 asks rank 0 to requeue the job, but the job may no longer be requeued
    (`scontrol update ... Requeue=0`, as an administrator's or a QOS's setting would have
    it): `scontrol requeue` refuses, and with the run unfinished and nothing to start it
    again the job must end FAILED, not COMPLETED."""
    run = tmp_path / "run"
    out = _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": "score@1=3"})
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    _wait_for(_committed(run, 1, "rollout"), 240, "the first commit")
    _run_cmd(cluster, "scontrol", "update", f"JobId={job}", "Requeue=0")
    _run_cmd(cluster, "scancel", "--signal=USR2", job)
    states = _ended(job, 120)
    assert states[-1] == "FAILED", states
    assert [e["verdict"] for e in _events(run, "requeue_decision")] == ["requeue"]
    assert len(_events(run, "requeue_failed")) == 1 and len(_events(run, "start")) == 1
    assert not (run / "stages" / "step=5").exists()


def test_signal_after_the_last_step_does_not_requeue(cluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = _slurm_submit(cluster, run, env={"RFTPIPE_SLOW": "finish=8"})
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    _wait_for(_committed(run, 5, "sync"), 240, "the last step to commit")
    # USR2 to every task while the finished run exports: what a time limit would send.
    _run_cmd(cluster, "scancel", "--signal=USR2", job)
    _wait_for(lambda: _job_state(job) in ("COMPLETED", "GONE"), 120, "the job to end")
    time.sleep(15)  # a requeued job would be pending or running again by now
    assert _job_state(job) in ("COMPLETED", "GONE")
    assert not _events(run, "stop") and not _events(run, "requeue_decision")
    assert len(_events(run, "start")) == 1 and (run / "export" / "config.json").exists()


@pytest.mark.tier1
def test_plain_sbatch_script(cluster, reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = submit(run, *STEPS, extra=("--create-only",))
    assert out.returncode == 0 and not (run / "stages").exists(), out.stderr
    res = _sbatch(cluster, run, tmp_path / "sbatch-%j.out", "--wait", "-N2", timeout=300)
    assert res.returncode == 0, res.stderr + "".join(
        p.read_text()[-2000:] for p in tmp_path.glob("sbatch-*.out")
    )
    _assert_equal_to_reference(run, reference)


def test_rollout_node_preempted_and_requeued_with_one_rollout_rank(cluster, tmp_path: Path) -> None:
    """2 nodes x 2 tasks, the second node's ranks only generating (`launch.rollout_nodes=1`,
    k = 1): preempted (TERM) while both roles work, with a new config waiting that gives
    the requeued job 1 rollout rank and 3 FSDP2 trainers. Both roles stop, Slurm requeues,
    and the job finishes without running a committed stage again; its samples equal the
    colocated local run's and its final weights are within 1e-5 of them (relative, over the whole model) (3 trainer ranks
    sum gradients in another order than 2)."""
    async_k1 = ("rollout.staleness=1", "launch.threads=1")
    ref = tmp_path / "ref"
    out = submit(ref, *STEPS, *async_k1, extra=("--tasks-per-node", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    out = _slurm_submit(
        cluster,
        run,
        "--tasks-per-node",
        "2",
        *async_k1,
        "launch.rollout_nodes=1",
        # Stretched until the preemption, so that it finds both roles at work; the requeued
        # job at full speed.
        env={"RFTPIPE_SLOW": "rollout=2,score=1,train=2", "RFTPIPE_SLOW_ALLOCATIONS": "1"},
    )
    assert out.returncode == 0, out.stderr
    job = _job_id(run)
    _wait_for(_committed(run, 2, "score"), 240, "step 2's generation")
    # The requeued job's placement: written now, read at its start (`launch` may change).
    resumed = submit(
        run,
        "launch.rollout_nodes=0",
        "launch.rollout_ranks=1",
        config=None,
        cluster="slurm",
        extra=("--nodes", "2", "--tasks-per-node", "2", "--create-only"),
    )
    assert resumed.returncode == 0, resumed.stderr
    _preempt_with_high_job(cluster)
    _wait_for(lambda: {e["rank"] for e in _events(run, "stop")} == {0, 1, 2, 3}, 90, "stops")
    _wait_for(lambda: _job_state(job) in ("COMPLETED", "GONE"), 400, "job to complete")

    starts = [i for i, e in enumerate(_events(run)) if e["event"] == "start"]
    assert len(starts) == 2, starts
    roles = [{}, {}]  # stage -> ranks that began it, in the first job and the requeued one
    for i, e in enumerate(_events(run)):
        if e["event"] == "stage_begin":
            roles[i > starts[1]].setdefault(e["stage"], set()).add(e["rank"])
    assert roles[0]["rollout"] == {2, 3} and roles[0]["train"] == {0, 1}, roles[0]
    assert roles[1]["rollout"] == {3} and roles[1]["train"] == {0, 1, 2}, roles[1]
    history = stage_history(run)
    for key, seq in history.items():
        assert seq.count("commit") == 1, (key, seq)
        assert "begin" not in seq[seq.index("commit") + 1 :], (key, seq)
    # The same samples; the logprobs of the weights trained on 3 ranks in their last bits.
    near = ["logprobs", "old_logprobs"]
    a = trajectories(ref).drop_columns(["rank"])
    b = trajectories(run).drop_columns(["rank"])
    assert a.drop_columns(near).equals(b.drop_columns(near))
    for column in near:
        x, y = (np.concatenate(t.column(column).to_pylist()) for t in (a, b))
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-4)
    # Over the whole model, as every other world-size change is compared (helpers says why
    # per element would not do: one weight of 16,576 once read 7e-5 relative on CI's CPU).
    assert weights_rel_diff(final_weights(ref), final_weights(run)) < 1e-5


def _preempted_at(job: str, nth: int) -> float:
    """When slurmctld preempted `job` for the `nth` time (Unix time, from its log)."""
    log = (slurm_local.state_dir() / "log" / "slurmctld.log").read_text(errors="replace")
    marks = [
        line[1 : line.index("]")] for line in log.splitlines() if f"preempted JobId={job} " in line
    ]
    return datetime.fromisoformat(marks[nth - 1]).timestamp() if len(marks) >= nth else 0.0


def _kill_failures() -> list[str]:
    """slurmd's lines for a job step whose processes outlived SIGKILL (the node drains)."""
    logs = (slurm_local.state_dir() / "log").glob("slurmd-*.log")
    marks = ("not ending with signals", "Kill task failed")
    return [
        ln
        for p in logs
        for ln in p.read_text(errors="replace").splitlines()
        if any(m in ln for m in marks)
    ]


@pytest.mark.timeout(1200)
def test_preempted_ten_times_while_a_checkpoint_writes(cluster, tmp_path: Path) -> None:
    """Issue 51 item 3. A rank whose thread is inside a disk write when SIGKILL comes lives
    on until the write returns (11b4287: 66 s; here, before the fix, 20 s at 64 KB/s and
    148 s at 12 KB/s). The job's block writes are throttled by the kernel to 256 KB/s (a
    real slow disk: its writes sleep in D state), so each background checkpoint outlasts
    the preemption's budget (GraceTime 0 + KillWait 5 s); the job is preempted while it
    writes, ten times. Each time every process of the job is gone within the budget (the
    stop abandons the write, whose pieces are short), no node drains, and the run ends
    bitwise equal to an uninterrupted one."""
    steps = ("train.backend=fsdp2", "total_steps=11", "checkpoint.interval=1")
    ref = tmp_path / "ref"
    out = submit(ref, *steps, extra=("--tasks-per-node", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    try:
        disk = SlowDisk(tmp_path, 256 << 10)
    except SlowDiskUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run this test: {exc}")
        pytest.skip(str(exc))
    kill_failures = len(_kill_failures())
    budget = 0 + 5  # the cluster's GraceTime (partition low) + KillWait
    with disk:
        # Step 1's rollout is stretched so the job's processes are throttled before it
        # writes its first checkpoint.
        out = submit(
            run,
            *steps,
            cluster="slurm",
            extra=("--nodes", "2", "--partition", "low"),
            env={**cluster, "RFTPIPE_SLOW": "rollout@1=3"},
        )
        assert out.returncode == 0, out.stderr
        job = _job_id(run)
        disk.add(job_processes(job))
        ended_within: list[float] = []
        for i in range(1, 11):
            # Each start commits step i and begins writing its checkpoint (a start after
            # an abandoned one first rewrites the one before, while step i rolls out).
            _wait_for(
                lambda i=i: (run / "checkpoints" / f".tmp-step={i}").is_dir(), 300, f"ckpt {i}"
            )
            _preempt_with_high_job(cluster)
            _wait_for(lambda i=i: _preempted_at(job, i) > 0, 60, f"preemption {i}")
            _wait_for(lambda: not any(job_processes(job)(p) for p in _pids()), 120, f"job end {i}")
            ended_within.append(time.time() - _preempted_at(job, i))
            assert not any(s.startswith("drain") for s in _node_states()), _node_states()
        _wait_for(lambda: _job_state(job) in ("COMPLETED", "GONE"), 600, "job to complete")
    abandoned = _events(run, "checkpoint_abandoned")
    print(f"ended within {ended_within} s; abandoned {[e['step'] for e in abandoned]}")
    # +1 s: Slurm signals the ranks a moment after it logs the preemption, and SIGKILL
    # ends a rank within one O_DIRECT piece. With the code before the fix (the stop
    # waiting for the whole write, buffered files) the job took 5.3-6.9 s (2026-12-02).
    assert max(ended_within) <= budget + 1.0, ended_within
    assert len(_kill_failures()) == kill_failures, _kill_failures()[kill_failures:]
    assert abandoned, "no stop reached a stage boundary while its checkpoint was writing"
    assert trajectories(ref).equals(trajectories(run))
    wa, wb = final_weights(ref), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _node_states() -> list[str]:
    return _run_cmd(slurm_local.cluster_env(), "sinfo", "-h", "-N", "-o", "%t").split()
