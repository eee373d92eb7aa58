"""Stopping cleanly under Slurm: signal flags, a collective stop decision, and requeue.

Slurm announces the end of a job with a signal: USR2 (our `--signal`, sent before the time
limit, or on preemption with `preempt_send_user_signal`) or TERM (preemption, `scontrol
requeue`, `scancel`). The handlers only set a flag. Ranks agree on it at the next stage
boundary through an all-reduce, so they all stop between the same two stages and no rank
is left waiting in a collective. Everything committed so far stays; rank 0 then requeues
the job when `rftpipe.run.slurm_job.decide_requeue` says so (the policy is described there),
and the requeued job resumes at the first uncommitted stage.

A stage that cannot reach its boundary before the job's end (USR2 came `--signal-delay`
seconds early, the stage needs longer; or USR2 came late, or not at all) would otherwise
be killed at the time limit and the job end TIMEOUT, never requeued: rank 0's watchdog,
armed at the start, requeues it `DEADLINE_MARGIN_S` before the end instead, abandoning
the stage (its files are uncommitted; the next start removes them). Starts that commit nothing count against `launch.max_idle_requeues`
(`rftpipe.run.idle_starts`): past it the job ends FAILED rather than loop.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rftpipe.events import events
from rftpipe.run.idle_starts import IdleStarts, idle_starts
from rftpipe.run.slurm_job import SlurmJob, decide_requeue, job_info, kill_wait_s

if TYPE_CHECKING:
    from rftpipe.dist import Dist

log = logging.getLogger(__name__)

#: Signals that mean "the job is about to end"; TERM loses to USR2 when both arrive.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopRequested(Exception):
    """All ranks agreed to stop at a stage boundary."""

    def __init__(self, signum: int, received_at: float | None = None) -> None:
        super().__init__(f"stop requested by {signal.Signals(signum).name}")
        self.signum = signum
        self.received_at = time.time() if received_at is None else received_at
        """When this rank's stop signal came (Unix time; now, for one that saw none)."""

    def deadline(self) -> float | None:
        """When this stopping rank must be done waiting for anything (Unix time; None
        outside Slurm). USR2 asks rank 0 to requeue before the job's end, so
        `DEADLINE_MARGIN_S` before it. After TERM (a preemption, whose GraceTime sets the
        end, `scancel`, the time limit) Slurm sends SIGKILL KillWait after the job's end
        (its EndTime, or this signal where Slurm no longer reports one, as for a job it is
        already requeueing), so `KILL_MARGIN_S` before that."""
        job = SlurmJob.from_env()
        if job is None:
            return None
        end = job_end(job_info(job.job_id))
        if self.signum == signal.SIGUSR2:
            return None if end is None else end - DEADLINE_MARGIN_S
        return max(end or 0.0, self.received_at) + kill_wait_s() - KILL_MARGIN_S


#: Seconds before the job's end at which rank 0 requeues a job whose stage has not reached
#: its boundary since USR2 (`scontrol requeue` answers within a second or two).
DEADLINE_MARGIN_S = 10.0

#: Seconds before Slurm's SIGKILL by which a stopping rank has given up waiting (on a
#: checkpoint still writing) and is on its way out: the abandoned write's last piece, the
#: event log, the exit.
KILL_MARGIN_S = 2.0


class StopFlag:
    """Set by a signal handler, read collectively at stage boundaries."""

    def __init__(self) -> None:
        self.signum = 0
        self.received_at: float | None = None
        self._taken = threading.Event()
        self._on_deadline: Callable[[int], int] | None = None
        self._watching = False

    def install(self) -> None:
        # Replaces submitit's handlers too: it requeues from inside its USR2 handler on
        # rank 0 only, while the other ranks run on into a collective that never completes.
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def arm_deadline(self, requeue: Callable[[int], int]) -> None:
        """On the job's first rank: if the run has not stopped at a boundary by
        `DEADLINE_MARGIN_S` before the job's end, call `requeue(SIGUSR2)` then, and exit
        with its code when it is not 0 (the job then ends FAILED, not TIMEOUT). Armed from
        the start, not from USR2: slurmctld sends `--signal` from a periodic loop, and on a
        loaded controller a requeued job's USR2 came only with its time limit (the local
        cluster under the whole test suite, 2026-12-03), too late to requeue it."""
        if os.environ.get("SLURM_PROCID", "0") != "0":
            return
        self._on_deadline = requeue
        self._watch()

    def _handle(self, signum: int, _frame: object) -> None:
        self.received_at = self.received_at or time.time()
        if self.signum != signal.SIGUSR2:
            self.signum = signum
        if signum == signal.SIGUSR2:
            self._watch()

    def _watch(self) -> None:
        if self._on_deadline is None or self._watching:
            return
        self._watching = True
        threading.Thread(target=self._deadline, name="rftpipe-stop-deadline", daemon=True).start()

    def _deadline(self) -> None:
        job = SlurmJob.from_env()
        if job is None or (end := job_end(job_info(job.job_id))) is None:
            return
        while not self._taken.wait(max(0.0, end - DEADLINE_MARGIN_S - time.time())):
            # The time limit may have been raised meanwhile (`scontrol update`).
            later = job_end(job_info(job.job_id))
            if later is None or later <= end + 1.0:
                break
            end = later
        else:
            return  # the run stopped at a boundary
        assert self._on_deadline is not None
        seen = signal.Signals(self.signum).name if self.signum else "none"
        events().write("stop", signal=seen, at="the job's end, mid-stage", abandoned=True)
        log.warning("no stage boundary before the job's end: requeueing mid-stage")
        code = self._on_deadline(signal.SIGUSR2)
        if code:
            sys.stdout.flush()
            os._exit(code)

    def check(self, dist: Dist, where: str) -> None:
        """Raise `StopRequested` on every rank if any rank saw a stop signal."""
        # One all-reduce agrees on whether and why: USR2 outranks TERM (it asks for a requeue).
        mine = {0: 0, signal.SIGTERM: 1, signal.SIGUSR2: 2}[self.signum]
        import torch  # here, not at import: the worker installs the handlers before torch loads

        agreed = int(dist.all_reduce_max(torch.tensor([mine]))[0])
        if agreed:
            signum = signal.SIGUSR2 if agreed == 2 else signal.SIGTERM
            events().write("stop", signal=signal.Signals(signum).name, at=where)
            log.warning("%s received; stopping before %s", signal.Signals(signum).name, where)
            self._taken.set()
            raise StopRequested(signum, self.received_at)


class NoStop:
    """Local runs: no handlers, nothing to agree on."""

    def check(self, dist: Dist, where: str) -> None:
        return None


def job_end(info: dict[str, str]) -> float | None:
    """The job's end (Unix time) from `scontrol show job`'s EndTime, None if it has none."""
    try:
        return datetime.fromisoformat(info.get("EndTime", "")).timestamp()
    except ValueError:  # "Unknown", "None" or absent
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RequeuePolicy:
    """What the requeue decision needs from the run: its caps and its event log."""

    max_requeues: int
    max_idle_requeues: int
    events_path: Path


def start_job(dist: Dist, stop: StopFlag, policy: RequeuePolicy) -> bool:
    """A Slurm task's start: False on every rank when the job has already started past
    `policy.max_idle_requeues` times without progress (Slurm requeued it itself: a node
    failure, a preemption in REQUEUE mode), which rank 0 then reports; else rank 0 records
    this start (`job_start`) and arms the stop deadline."""
    job = SlurmJob.from_env()
    if job is None:
        return True
    refuse = 0
    if dist.is_main:
        info = job_info(job.job_id)
        idle = idle_starts(policy.events_path, job.job_id)
        if idle.starts > policy.max_idle_requeues:
            refuse_idle(job.job_id, idle, info, policy.max_idle_requeues)
            refuse = 1
        else:
            limit = info.get("TimeLimit")
            events().write("job_start", job=job.job_id, restarts=job.restarts, time_limit=limit)
            stop.arm_deadline(lambda signum: requeue_job(signum, policy))
    import torch

    return not int(dist.all_reduce_max(torch.tensor([refuse]))[0])


def requeue_after_stop(stop: StopRequested, dist: Dist, policy: RequeuePolicy) -> int:
    """Rank 0 requeues the job if the policy says so; every rank then exits with the code
    returned: 1 on rank 0 when the job must end FAILED, else 0."""
    return requeue_job(stop.signum, policy) if dist.is_main else 0


def requeue_job(signum: int, policy: RequeuePolicy) -> int:
    """Requeue this process's job if `decide_requeue` says so and it has not started past
    `max_idle_requeues` times without progress; 1 when the job must end FAILED (the
    requeue failed, or too many idle starts), else 0."""
    job = SlurmJob.from_env()
    if job is None:
        return 0
    info = job_info(job.job_id)
    verdict = decide_requeue(signum, info, job.restarts, policy.max_requeues)
    idle = None
    if verdict == "requeue":
        idle = idle_starts(policy.events_path, job.job_id, now=time.time())
        if idle.starts > policy.max_idle_requeues:
            verdict = f"{idle.starts} starts without a commit"
    events().write("requeue_decision", job=job.job_id, restarts=job.restarts, verdict=verdict)
    if idle is not None and verdict != "requeue":
        refuse_idle(job.job_id, idle, info, policy.max_idle_requeues)
        return 1
    if verdict != "requeue":
        log.warning("not requeueing job %s: %s", job.job_id, verdict)
        return 0
    out = subprocess.run(
        ["scontrol", "requeue", job.job_id], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        # The run is unfinished and nothing will start it again: the job must end FAILED,
        # not COMPLETED, so that the user (and `jobs.status`) sees it.
        events().write("requeue_failed", job=job.job_id, error=out.stderr.strip()[:500])
        log.error("scontrol requeue %s failed: %s", job.job_id, out.stderr.strip())
        return 1
    log.warning("requeued job %s (restart %d)", job.job_id, job.restarts + 1)
    return 0


def refuse_idle(job_id: str, idle: IdleStarts, info: dict[str, str], limit: int) -> None:
    """Record why the job ends FAILED instead of starting or requeueing again, and say it
    in the one line on stderr that the worker keeps for a fatal error."""
    line = idle.line(job_id, info.get("TimeLimit"), limit)
    events().write(
        "idle_requeues",
        job=job_id,
        starts=idle.starts,
        stage=idle.stage,
        seconds=None if idle.seconds is None else round(idle.seconds, 1),
        time_limit=info.get("TimeLimit"),
        message=line,
    )
    log.error("%s", line)
    sys.stderr.write(f"rftpipe: error: {line}\n")
    sys.stderr.flush()
