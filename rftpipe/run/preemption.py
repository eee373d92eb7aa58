"""Stopping cleanly under Slurm: signal flags, a collective stop decision, and requeue.

Slurm announces the end of a job with a signal: USR2 (our `--signal`, sent before the time
limit, or on preemption with `preempt_send_user_signal`) or TERM (preemption, `scontrol
requeue`, `scancel`). The handlers only set a flag. Ranks agree on it at the next stage
boundary through an all-reduce, so they all stop between the same two stages and no rank
is left waiting in a collective. Everything committed so far stays; rank 0 then requeues
the job when `rftpipe.run.slurm_job.decide_requeue` says so (the policy is described there),
and the requeued job resumes at the first uncommitted stage.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from typing import TYPE_CHECKING

from rftpipe.events import events
from rftpipe.run.slurm_job import SlurmJob, decide_requeue, job_info

if TYPE_CHECKING:
    from rftpipe.dist import Dist

log = logging.getLogger(__name__)

#: Signals that mean "the job is about to end"; TERM loses to USR2 when both arrive.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


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
        import torch  # here, not at import: the worker installs the handlers before torch loads

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


def requeue_after_stop(stop: StopRequested, dist: Dist, max_requeues: int) -> int:
    """Rank 0 requeues the job if the policy says so; every rank then exits with the code
    returned: 1 on rank 0 when the requeue it decided failed, else 0."""
    job = SlurmJob.from_env()
    if not dist.is_main or job is None:
        return 0
    verdict = decide_requeue(stop.signum, job_info(job.job_id), job.restarts, max_requeues)
    events().write("requeue_decision", job=job.job_id, restarts=job.restarts, verdict=verdict)
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
