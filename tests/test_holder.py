"""One job per run directory (`rftpipe.run.holder`) without Slurm: real processes claim a
directory; a live holder refuses a second, a killed one does not block, and a second local
run of a live one is refused by `jobs.submit` and by its workers. The Slurm cases (two
submissions, a resume racing a requeue, a cancelled job's record) are in tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY, events, submit

from rftpipe.run.holder import HeldElsewhere, Holder, alive, claim, recorded
from rftpipe.storage.layout import RunDir

CLAIM = """
import sys, time
from rftpipe.run.holder import claim
from rftpipe.storage.layout import RunDir
claim(RunDir(sys.argv[1]))
print("claimed", flush=True)
time.sleep(600)
"""


def _claimer(run: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIM, str(run)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_live_holder_refuses_a_second_and_a_killed_one_does_not_block(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    first = _claimer(tmp_path)
    try:
        holder = recorded(run)
        assert holder is not None and holder.pid == first.pid and holder.job is None
        assert alive(holder) is True
        with pytest.raises(HeldElsewhere, match=f"held by pid {first.pid} on .*still live"):
            claim(run)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The record stays behind a SIGKILL; its process is gone, so it does not block.
    stale = recorded(run)
    assert stale == holder and alive(stale) is False
    fd = claim(run)
    assert fd is not None
    os.close(fd)
    assert recorded(run).pid == os.getpid()


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    me = {"job": None, "host": os.uname().nodename, "pid": os.getpid(), "since": 0.0}
    run.holder_path.write_text(json.dumps({**me, "pid_start": "1"}))
    assert alive(recorded(run)) is False  # this pid, but another process's start time
    fd = claim(run)
    assert fd is not None and recorded(run).pid_start not in (None, "1")
    os.close(fd)


def test_a_holder_this_machine_cannot_ask_about_is_told_by_the_lock(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    elsewhere = {"job": None, "host": "elsewhere", "pid": 1, "pid_start": "9", "since": 0.0}
    run.holder_path.write_text(json.dumps(elsewhere))
    assert alive(recorded(run)) is None
    fd = claim(run)  # nothing holds the lock: that holder has ended
    assert fd is not None
    run.holder_path.write_text(json.dumps(elsewhere))
    with pytest.raises(HeldElsewhere, match="held by pid 1 on elsewhere"):
        claim(run)  # the lock is held (here by `fd`): it is live
    os.close(fd)


@pytest.mark.slow
def test_a_second_local_run_of_a_live_one_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    slow = {"RFTPIPE_SLOW": "rollout@2=20"}
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.submit",
            "--cluster",
            "local",
            "--run-dir",
            str(run),
            "--config",
            str(TINY),
            "total_steps=2",
        ],
        cwd=ROOT,
        env={**os.environ, **slow},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "stages" / "step=1" / "sync" / "MANIFEST.json").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.5)
        holder = recorded(RunDir(run))
        assert holder is not None and alive(holder)
        again = submit(run, config=None)
        assert again.returncode == 2
        (line,) = again.stderr.strip().splitlines()
        assert line.startswith(f"rftpipe: error: run_dir: {run}") and "still live" in line
        assert f"pid {holder.pid}" in line
        # Asked to anyway: its worker refuses, naming the holder, and touches nothing.
        manifests = sorted(p.stat().st_mtime_ns for p in run.rglob("MANIFEST.json"))
        forced = submit(run, config=None, extra=("--submit-anyway",))
        assert forced.returncode == 2 and f"held by pid {holder.pid}" in forced.stderr
        assert (
            sorted(p.stat().st_mtime_ns for p in run.rglob("MANIFEST.json"))[: len(manifests)]
            == manifests
        )
        assert first.wait(timeout=300) == 0, first.communicate()
    finally:
        if first.poll() is None:
            first.kill()
    refused = [e for e in events(run) if e["event"] == "user_error"]
    assert len(refused) == 1 and "still live" in refused[0]["message"]
    # Once it has ended, the same command resumes (here: finds it finished).
    assert submit(run, config=None).returncode == 0


def test_an_exited_process_not_yet_reaped_is_not_the_holder(tmp_path: Path) -> None:
    """A rank that SIGKILLed itself stays a zombie until its parent reaps it (the test
    suite's warm forks reap lazily): it holds nothing, so it does not block a resume."""
    child = subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path)], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().strip() == b"claimed"
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert alive(recorded(RunDir(tmp_path))) is False  # a zombie, not yet reaped
    fd = claim(RunDir(tmp_path))
    os.close(fd)
    child.wait()


@pytest.mark.parametrize(
    ("stderr", "ended"),
    [
        ("slurm_load_jobs error: Invalid job id specified", True),
        ("slurm_load_jobs error: Unable to contact slurm controller (connect failure)", False),
    ],
)
def test_a_silent_slurm_is_never_taken_for_an_ended_job(
    tmp_path: Path, monkeypatch, stderr: str, ended: bool
) -> None:
    """`scontrol show job` failing because the controller is unreachable says nothing about
    the job: jobs.submit refuses (it would otherwise start a second job beside a live one),
    and the job's state is UNKNOWN, which `--wait` polls through;
    "Invalid job id" is a job Slurm has forgotten, which has ended. A stand-in `scontrol`
    prints Slurm 22.05's own messages: a down controller is not made in the fast tier."""
    import jobs.slurm
    from rftpipe.errors import UserError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("scontrol", "squeue"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho '{stderr}' >&2\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "jobs.txt").write_text("4242\n")
    if ended:
        assert jobs.slurm.live_jobs(run) == []
    else:
        with pytest.raises(UserError, match="Slurm did not answer about job 4242 of"):
            jobs.slurm.live_jobs(run)
    holder = Holder(job="4242", host="h", pid=1, pid_start=None, since=0.0)
    assert alive(holder) is (False if ended else None)
    # `jobs.status` and `jobs.submit --wait` (which stops at an ended state) alike.
    assert jobs.slurm.job_state("4242") == ("GONE" if ended else "UNKNOWN")
    assert (jobs.slurm.job_state("4242") in jobs.slurm.TERMINAL) is ended
