"""One job per run directory: the holder record ``RUN/.holder.json`` and ``RUN/.holder.lock``.

Resubmitting a run is a resume, so two jobs could otherwise run one directory at once: a
user resubmits a run that is still queued or running, or resumes it by hand while Slurm
requeues it. The first rank of every start claims the directory before anything else:

- it takes ``.holder.lock`` exclusively for its whole life (without waiting), and reads the
  record the previous holder left: its Slurm job id, or its host and pid, and when it began;
- a record of another job that is still live refuses the start (exit 2, one line naming
  the holder). Live: its Slurm job is pending, running or requeued (`scontrol`), or, for a
  run started without Slurm, its process is alive on this host (same pid and start time).
  Where that cannot be asked (no Slurm here; another host), the lock says it;
- the same Slurm job id after a requeue is the same holder, even while a rank of its
  previous start still lingers with the lock; a holder that has ended does not block;
- it then writes its own record (atomically).

No torch here: `jobs.submit` reads the record on a login node to refuse a second submission.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rftpipe.atomic import atomic_write_json, read_json
from rftpipe.errors import UserError
from rftpipe.run.slurm_job import SlurmJob, ask_job
from rftpipe.storage.layout import RunDir

if TYPE_CHECKING:
    from rftpipe.dist import Dist

log = logging.getLogger(__name__)

#: Slurm job states in which the job still holds (or will hold again) its run directory.
LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Holder:
    """Who runs a run directory."""

    job: str | None
    """Its Slurm job id (array jobs as ``ARRAYJOBID_TASKID``), None outside Slurm."""
    host: str
    pid: int
    """The first rank's process."""
    pid_start: str | None
    """That process's start time in clock ticks since boot (/proc; a reused pid differs)."""
    since: float
    """When it claimed the directory (Unix time)."""

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        who = f"slurm job {self.job}" if self.job else f"pid {self.pid} on {self.host}"
        return f"{who} (since {started})"

    def same_as(self, other: Holder) -> bool:
        if self.job or other.job:
            return self.job == other.job
        return (self.host, self.pid, self.pid_start) == (other.host, other.pid, other.pid_start)


def this_process() -> Holder:
    job = SlurmJob.from_env()
    return Holder(
        job=None if job is None else job.job_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_start=_start_ticks(os.getpid()),
        since=time.time(),
    )


def recorded(run: RunDir) -> Holder | None:
    """The record the last holder wrote (None: none, or one this version cannot read)."""
    try:
        return Holder(**read_json(run.holder_path))
    except (FileNotFoundError, TypeError, ValueError):
        return None


#: Seconds a holder process on this host gets to finish dying before it counts as live: a
#: resume right after a kill (`kill -9` of the launcher's process group) finds its rank
#: still tearing down for a moment.
DYING_GRACE_S = 5.0


def alive(holder: Holder, grace: float = 0.0) -> bool | None:
    """Whether `holder` still holds its directory; None where this machine cannot tell. A
    process holder on this host is given up to `grace` seconds to end."""
    if holder.job:
        if shutil.which("scontrol") is None:
            return None
        # {} once Slurm has forgotten the job (MinJobAge after its end): it has ended;
        # None when Slurm did not answer: not known, never taken for ended.
        info = ask_job(holder.job)
        return None if info is None else info.get("JobState") in LIVE_STATES
    if holder.host != socket.gethostname():
        return None
    deadline = time.monotonic() + grace
    while _running(holder):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)
    return False


def _running(holder: Holder) -> bool:
    ticks = _start_ticks(holder.pid)
    return ticks is not None and ticks == holder.pid_start


def claim(run: RunDir) -> int | None:
    """Claim `run` for this process (its job's first rank): returns the lock's descriptor,
    to be kept open (None: not held, where a lingering rank of this job holds it or the
    file system has no flock). Raises `HeldElsewhere` naming a live holder."""
    me = this_process()
    fd = os.open(run.holder_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked: bool | None = True
    except OSError as exc:
        locked = False if exc.errno == errno.EWOULDBLOCK else None
    prior = recorded(run)
    try:
        _refuse_live(run, me, prior, locked)
    except HeldElsewhere:
        os.close(fd)
        raise
    if not locked:
        why = "a rank of its earlier start still holds it" if locked is False else "no flock"
        log.warning("run_dir: %s claimed without %s (%s)", run.root, run.holder_lock_path, why)
    atomic_write_json(run.holder_path, asdict(me))
    if locked:
        return fd
    os.close(fd)
    return None


class HeldElsewhere(Exception):
    """Another live job holds the run directory."""


def hold(run: RunDir, dist: Dist) -> int | None:
    """`claim` on the job's first rank, agreed by every rank: a refusal raises `UserError`
    on all of them (the first rank's names the holder). Returns `claim`'s descriptor."""
    import torch

    fd, refused = None, ""
    if dist.is_main:
        try:
            fd = claim(run)
        except HeldElsewhere as exc:
            refused = str(exc)
    if int(dist.all_reduce_max(torch.tensor([int(bool(refused))]))[0]):
        raise UserError(refused or f"run_dir: {run.root} is held by another job")
    return fd


def _refuse_live(run: RunDir, me: Holder, prior: Holder | None, locked: bool | None) -> None:
    if prior is not None and prior.same_as(me):
        return  # this job again, after a requeue
    if prior is None:
        if locked is False:  # claimed this instant by another start, or by an older rftpipe
            raise HeldElsewhere(
                f"run_dir: {run.root} is held by a process that holds "
                f"{run.holder_lock_path.name}; wait for it to end"
            )
        return
    live = alive(prior, DYING_GRACE_S)
    if live is None:
        live = locked is not True  # the lock tells, where it works
    if live:
        raise HeldElsewhere(
            f"run_dir: {run.root} is held by {prior.describe()}, which is still live; "
            f"wait for it to end or cancel it (a record of a holder that has ended: remove "
            f"{run.holder_path})"
        )


def _start_ticks(pid: int) -> str | None:
    """The process's start time (None: no such process, or one that has exited and waits
    only to be reaped, a zombie, which holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]
