"""The Slurm job a process belongs to: who it is, what Slurm says about it, whether to requeue.

No torch here (only the standard library): the launch layer (`jobs.slurm`, and through it
`jobs.submit --wait` and `jobs.status`) reads job states with `ask_job` on a login node,
where importing torch would cost seconds. The stop signals and the collective stop decision
that use these pieces inside a running job are in `rftpipe.run.preemption`.

Requeue policy (rank 0 only, at most once per job run, after all ranks have stopped):
- USR2: requeue, unless Slurm is already requeueing the job or the cap is reached;
- TERM: requeue only when Slurm reports the job as preempted and is not requeueing it
  itself; a user's `scancel` is never requeued. (Clusters with `PreemptMode=CANCEL` should
  set `preempt_send_user_signal`: their preemption then arrives as USR2 and requeues.)
- a run that has finished never requeues (the training loop does not look for a stop
  after its last commit, so it never gets here).
`decide_requeue` implements the first two rules.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
from dataclasses import dataclass

#: Job states in which Slurm itself puts the job back in the queue.
SLURM_REQUEUEING = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmJob:
    """The job this task belongs to, as Slurm's environment describes it."""

    job_id: str
    """`JOBID` or, for an array task, `ARRAYJOBID_TASKID` (what `scontrol requeue` takes)."""
    restarts: int
    """How many times Slurm has requeued this job already."""

    @classmethod
    def from_env(cls) -> SlurmJob | None:
        env = os.environ
        if "SLURM_JOB_ID" not in env:
            return None
        if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
            job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        else:
            job_id = env["SLURM_JOB_ID"]
        return cls(job_id=job_id, restarts=int(env.get("SLURM_RESTART_COUNT", "0")))


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict ({} when Slurm does not answer or no longer knows
    the job)."""
    return ask_job(job_id) or {}


def ask_job(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict: {} for a job Slurm no longer knows (`MinJobAge`
    after its end), None when Slurm did not answer (a timeout, the controller down), which
    says nothing about the job."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return {} if "Invalid job id" in out.stderr else None
    info: dict[str, str] = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in info:
            info[key] = value
    return info


@functools.cache
def kill_wait_s() -> float:
    """The cluster's KillWait: seconds between a job's SIGTERM at its end and its SIGKILL
    (`scontrol show config`; Slurm's default, 30, when it does not answer)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait" and value.split() and value.split()[0].isdigit():
            return float(value.split()[0])
    return 30.0


def decide_requeue(signum: int, info: dict[str, str], restarts: int, max_requeues: int) -> str:
    """'requeue' or the reason not to; pure, so the policy is testable without Slurm."""
    state = info.get("JobState", "")
    if restarts >= max_requeues:
        return f"cap of {max_requeues} requeues reached"
    # Slurm bumps the job's restart count as soon as it decides to requeue it itself
    # (preemption in REQUEUE mode), while this task still sees the old count.
    if state in SLURM_REQUEUEING or int(info.get("Restarts", "0")) > restarts:
        return f"Slurm is already requeueing it ({state})"
    if state == "CANCELLED":
        return "cancelled by the user"
    if signum == signal.SIGUSR2:
        return "requeue"
    if state == "PREEMPTED":
        return "requeue"
    # A bare TERM with no sign of a Slurm requeue is a `scancel` (or a cluster that cancels
    # preempted jobs without `preempt_send_user_signal`, which cannot be told apart from it).
    return f"{signal.Signals(signum).name} without a requeue by Slurm (state {state or 'unknown'})"
