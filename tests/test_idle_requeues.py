"""Starts of a Slurm job that commit nothing (`launch.max_idle_requeues`), without Slurm: the
count read from a real event log, the refusal it leads to, and what `jobs.status` prints.
The job on the local cluster whose stage outlasts its time limit is in tests/test_slurm.py."""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from helpers import submit

from jobs import status
from rftpipe.events import EventLog, set_event_log
from rftpipe.run.idle_starts import idle_starts
from rftpipe.run.preemption import (
    DEADLINE_MARGIN_S,
    RequeuePolicy,
    StopFlag,
    job_end,
    requeue_job,
    start_job,
)
from rftpipe.storage.layout import RunDir


def _log(path: Path, *records: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"t": r["t"], "pid": 7, "rank": 0, **r}) + "\n")


def test_only_the_jobs_starts_since_the_last_progress_count(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    _log(
        log,
        {"t": 1, "event": "job_start", "job": "5"},
        {"t": 2, "event": "commit", "step": 1, "stage": "rollout"},
        {"t": 3, "event": "job_start", "job": "5"},
        {"t": 4, "event": "stage_begin", "step": 1, "stage": "score"},
        {"t": 9, "event": "stop", "at": "x"},
        {"t": 10, "event": "job_start", "job": "6"},  # another submission
        {"t": 11, "event": "job_start", "job": "5", "rank": 1},  # not rank 0's
        {"t": 12, "event": "job_start", "job": "5", "pid": 8},
        {"t": 13, "event": "stage_begin", "step": 1, "stage": "score", "pid": 8},
        {"t": 40, "event": "stage_memory", "step": 1, "stage": "score", "pid": 8, "rank": 1},
        {"t": 41, "event": "requeue_decision", "pid": 8},
    )
    with open(log, "a") as f:
        f.write('{"t": 42, "event": "job_st')  # torn by a kill mid-write
    idle = idle_starts(log, "5")
    assert (idle.starts, idle.stage, idle.seconds) == (2, "step 1 score", 28.0)
    assert idle_starts(log, "6").starts == 1 and idle_starts(log, "7").starts == 0
    _log(log, {"t": 50, "event": "checkpoint", "step": 1})
    assert idle_starts(log, "5") == idle_starts(tmp_path / "absent.jsonl", "5")
    assert idle_starts(log, "5").starts == 0 and idle_starts(log, "5").stage is None


def test_a_long_log_is_read_back_across_its_blocks(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    _log(log, {"t": 0, "event": "commit"})
    pad = "x" * 997  # lines that straddle the 64 KiB blocks read backwards
    for i in range(300):
        _log(log, {"t": i, "event": "job_start" if i % 3 == 0 else "other", "job": "9", "p": pad})
    assert log.stat().st_size > 4 * 65536
    assert idle_starts(log, "9").starts == 100


def test_job_end_reads_slurms_end_time() -> None:
    assert job_end({"EndTime": "Unknown"}) is None and job_end({}) is None
    end = job_end({"EndTime": "2026-12-02T17:20:00"})
    assert end is not None and end - job_end({"EndTime": "2026-12-02T17:19:00"}) == 60.0


@pytest.fixture
def slurm_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RequeuePolicy:
    """A task of job 42 (its environment, as srun sets it) with no Slurm to ask: `scontrol`
    is absent, so the job's state is unknown, as between two polls of a busy controller."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    path = tmp_path / "events.jsonl"
    set_event_log(EventLog(path))
    yield RequeuePolicy(max_requeues=20, max_idle_requeues=2, events_path=path)
    set_event_log(EventLog(None))


class _OneRank:
    is_main = True

    def all_reduce_max(self, t):
        return t


def test_the_third_idle_start_is_not_requeued(slurm_task: RequeuePolicy, capsys) -> None:
    path = slurm_task.events_path
    _log(path, {"t": 1, "event": "commit", "step": 1, "stage": "sync"})
    for t in (2, 70):
        _log(path, {"t": t, "event": "job_start", "job": "42"})
    _log(path, {"t": 71, "event": "stage_begin", "step": 2, "stage": "rollout", "pid": 1})
    _log(path, {"t": 125, "event": "requeue_decision", "pid": 1})
    # The third start (its job_start is written by `start_job`) stops too: no requeue.
    assert start_job(_OneRank(), _NoDeadline(), slurm_task)
    assert requeue_job(signal.SIGUSR2, slurm_task) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rftpipe: error: slurm job 42: 3 starts")
    assert "step 2 rollout did not finish, which ran 54 s" in err[0]
    events = [json.loads(x) for x in path.read_text().splitlines()]
    assert [
        e["verdict"] for e in events if e["event"] == "requeue_decision" and "verdict" in e
    ] == ["3 starts without a commit"]
    (idle,) = [e for e in events if e["event"] == "idle_requeues"]
    assert (idle["job"], idle["starts"], idle["stage"]) == ("42", 3, "step 2 rollout")
    # A start Slurm makes anyway (a node failure requeues by itself) is refused at once.
    assert not start_job(_OneRank(), _NoDeadline(), slurm_task)
    assert "3 starts committed nothing" in capsys.readouterr().err


class _NoDeadline:
    def arm_deadline(self, requeue) -> None:
        self.requeue = requeue


def test_status_says_why_the_job_was_not_requeued(tmp_path: Path, slurm_task, capsys) -> None:
    run = tmp_path / "run"
    assert submit(run, "total_steps=1", extra=("--create-only",)).returncode == 0
    set_event_log(EventLog(RunDir(run).events_path))
    policy = RequeuePolicy(
        max_requeues=20, max_idle_requeues=0, events_path=RunDir(run).events_path
    )
    assert start_job(_OneRank(), _NoDeadline(), policy)
    assert requeue_job(signal.SIGTERM, policy) == 0  # a scancel: not requeued, not counted
    assert requeue_job(signal.SIGUSR2, policy) == 1
    capsys.readouterr()
    assert status.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "not requeued: slurm job 42: 1 start committed nothing" in out
    assert "no stage began" in out


def test_the_watchdog_requeues_before_the_end_without_a_usr2(
    slurm_task: RequeuePolicy, tmp_path: Path
) -> None:
    """Armed at the start, not by USR2: a job whose USR2 never comes (slurmctld sends it
    from a periodic loop, and a loaded one sent a requeued job's only with its time limit)
    is still requeued `DEADLINE_MARGIN_S` before its end, not killed TIMEOUT. A stand-in
    `scontrol` gives the job an end 1.5 s past the margin (no Slurm in the fast tier)."""
    end = datetime.now() + timedelta(seconds=DEADLINE_MARGIN_S + 1.5)
    bin_dir = tmp_path / "no-bin"  # the fixture's PATH
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'JobId=42 EndTime={end:%Y-%m-%dT%H:%M:%S}'\n")
    scontrol.chmod(0o755)
    called: list[int] = []
    stop = StopFlag()
    t0 = time.monotonic()
    stop.arm_deadline(lambda signum: called.append(signum) or 0)
    while not called and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert called == [signal.SIGUSR2] and stop.signum == 0  # no signal was ever received
    assert time.monotonic() - t0 > 0.4  # it waited for the margin, not at once
    (e,) = [json.loads(x) for x in slurm_task.events_path.read_text().splitlines()]
    assert (e["event"], e["signal"], e["at"]) == ("stop", "none", "the job's end, mid-stage")
