"""The local Slurm cluster from tools/cluster/slurm_local: 2-node jobs and partition preemption.

Needs root (the tool runs munged as the munge user and installs packages with apt-get).
A cluster that was already up is reused and left running for later Slurm tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.cluster import slurm_local

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("tools.cluster.slurm_local needs root")
    was_up = slurm_local.is_up()
    env = slurm_local.ensure_up()
    yield env
    if not was_up:
        slurm_local.down()


def _slurm(env: dict[str, str], *args: str) -> str:
    res = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(args)} failed: {res.stderr or res.stdout}"
    return res.stdout


def _job(env: dict[str, str], job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (JobState, Reason, Restarts, ...)."""
    line = _slurm(env, "scontrol", "show", "job", "-o", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _wait_state(
    env: dict[str, str], job_id: str, states: set[str], timeout: float = 60
) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = _job(env, job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached {states}: {info}")


def _cancel_and_drain(env: dict[str, str], job_ids: list[str]) -> None:
    # Leave idle nodes behind so later Slurm tests do not queue behind our sleeps.
    subprocess.run(["scancel", *job_ids], env=env, capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(job_ids), "-o", "%T"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        if not out.strip():
            return
        time.sleep(0.5)


def test_srun_spans_two_nodes(slurm_env: dict[str, str]) -> None:
    out = _slurm(slurm_env, "srun", "-N2", "-p", "low", "printenv", "SLURMD_NODENAME")
    names = out.split()
    assert len(names) == 2 and len(set(names)) == 2, out
    assert set(names) <= set(slurm_local.node_names(10)), names


def test_sbatch_wait_spans_two_nodes(slurm_env: dict[str, str], tmp_path: Path) -> None:
    out_file = tmp_path / "job.out"
    _slurm(
        slurm_env,
        "sbatch",
        "--wait",
        "-N2",
        "-p",
        "low",
        "-o",
        str(out_file),
        "--wrap",
        "srun printenv SLURMD_NODENAME",
    )
    names = out_file.read_text().split()
    assert len(names) == 2 and len(set(names)) == 2, names


def test_high_partition_preempts_low_by_requeue(slurm_env: dict[str, str]) -> None:
    # --exclusive on both: the high job cannot start without taking the low job's nodes.
    common = ["sbatch", "--parsable", "-N2", "--exclusive", "-o", "/dev/null"]
    low = _slurm(slurm_env, *common, "-p", "low", "--requeue", "--wrap", "srun sleep 300")
    low = low.strip().split(";")[0]
    jobs = [low]
    try:
        _wait_state(slurm_env, low, {"RUNNING"})
        high = _slurm(slurm_env, *common, "-p", "high", "--wrap", "srun sleep 60").strip()
        high = high.split(";")[0]
        jobs.append(high)
        high_info = _wait_state(slurm_env, high, {"RUNNING"})
        assert high_info["Partition"] == "high"
        low_info = _wait_state(slurm_env, low, {"PENDING", "REQUEUED", "REQUEUE_HOLD"})
        # Slurm 22.05 shows a requeued job as PENDING (Reason=BeginTime, then Resources) with
        # Restarts bumped; slurmctld's log names the preemption explicitly.
        assert int(low_info["Restarts"]) >= 1, low_info
        log = (slurm_local.state_dir() / "log" / "slurmctld.log").read_text(errors="replace")
        assert f"preempted JobId={low} has been requeued to reclaim resources for JobId={high}" in (
            log
        )
    finally:
        _cancel_and_drain(slurm_env, jobs)
