"""Stopping cleanly under Slurm: signal flags, a collective stop decision, and requeue.

Slurm announces the end of a job with a signal: USR2 (our `--signal`, sent before the time
limit, or on preemption with `preempt_send_user_signal`) or TERM (preemption, `scontrol
requeue`, `scancel`). The handlers only set a flag. Ranks agree on it at the next stage
boundary through an all-reduce, so they all stop between the same two stages and no rank
is left waiting in a collective. Everything committed so far stays; the requeued job
resumes at the first uncommitted stage.

Requeue policy (rank 0 only, at most once per job run):
- USR2: requeue, unless Slurm is already requeueing the job or the cap is reached;
- TERM: requeue only when Slurm reports the job as preempted and is not requeueing it
  itself; a user's `scancel` is never requeued. (Clusters with `PreemptMode=CANCEL` should
  set `preempt_send_user_signal`: their preemption then arrives as USR2 and requeues.)
- a run that has finished never requeues.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass

import torch

from rftpipe.dist import Dist
from rftpipe.faults import events

log = logging.getLogger(__name__)

#: Signals that mean "the job is about to end"; TERM loses to USR2 when both arrive.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
#: Job states in which Slurm itself puts the job back in the queue.
SLURM_REQUEUEING = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PENDING"}


class StopRequested(Exception):
    """All ranks agreed to stop at a stage boundary."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stop requested by {signal.Signals(signum).name}")
        self.signum = signum


class StopFlag:
    """Set by a signal handler, read collectively at stage boundaries."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        # Replaces submitit's handlers too: it requeues from inside its USR2 handler on
        # rank 0 only, while the other ranks run on into a collective that never completes.
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum != signal.SIGUSR2:
            self.signum = signum

    def check(self, dist: Dist, where: str) -> None:
        """Raise `StopRequested` on every rank if any rank saw a stop signal."""
        # One all-reduce agrees on whether and why: USR2 outranks TERM (it asks for a requeue).
        mine = {0: 0, signal.SIGTERM: 1, signal.SIGUSR2: 2}[self.signum]
        agreed = int(dist.all_reduce_max(torch.tensor([mine]))[0])
        if agreed:
            signum = signal.SIGUSR2 if agreed == 2 else signal.SIGTERM
            events().write("stop", signal=signal.Signals(signum).name, at=where)
            log.warning("%s received; stopping before %s", signal.Signals(signum).name, where)
            raise StopRequested(signum)


class NoStop:
    """Local runs: no handlers, nothing to agree on."""

    def check(self, dist: Dist, where: str) -> None:
        return None


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
    """`scontrol show job -o` as a dict ({} when Slurm does not answer)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    info: dict[str, str] = {}
    for token in out.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in info:
            info[key] = value
    return info


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


def requeue_after_stop(stop: StopRequested, dist: Dist, max_requeues: int) -> None:
    """Rank 0 requeues the job if the policy says so; every rank then just exits."""
    job = SlurmJob.from_env()
    if not dist.is_main or job is None:
        return
    verdict = decide_requeue(stop.signum, job_info(job.job_id), job.restarts, max_requeues)
    events().write("requeue_decision", job=job.job_id, restarts=job.restarts, verdict=verdict)
    if verdict != "requeue":
        log.warning("not requeueing job %s: %s", job.job_id, verdict)
        return
    out = subprocess.run(
        ["scontrol", "requeue", job.job_id], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job.job_id, out.stderr.strip())
    else:
        log.warning("requeued job %s (restart %d)", job.job_id, job.restarts + 1)
