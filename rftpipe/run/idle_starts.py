"""Starts of a Slurm job that committed nothing, read from the run's event log.

A job whose stage outlasts its time limit, or that is preempted before every commit, would
otherwise be requeued to do the same work again, commit nothing, and wait in the queue
again, until `launch.max_requeues` is spent. Each start of a job under Slurm writes a
`job_start` event (rank 0); progress is a stage's (or a turn's) commit or a checkpoint.
The starts of the same job since the last progress are its idle starts: past
`launch.max_idle_requeues` of them the job is not requeued and ends FAILED, with an
`idle_requeues` event naming the stage that did not finish, how long it ran and the job's
time limit (`jobs.status` prints it).

The same job id after a requeue is the same job; a new submission starts its own count.
No torch here: `jobs.status` reads this on a login node.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Events that leave something a later start does not redo.
PROGRESS = frozenset({"commit", "checkpoint"})

_BLOCK = 1 << 16


@dataclass(frozen=True, kw_only=True, slots=True)
class IdleStarts:
    """What the event log says about a job since the run's last progress."""

    starts: int
    """`job_start` events of the job since the last progress (the current start included
    once it has written its own)."""
    stage: str | None
    """The last stage begun since then ("step 3 rollout"), None when none began."""
    seconds: float | None
    """From that stage's begin to the last event of its process after it: at least how long
    it ran before the start ended."""

    def line(self, job_id: str, time_limit: str | None, limit: int) -> str:
        """One line for the user: what did not finish and why the job is not requeued."""
        if self.stage is None:
            what = "no stage began"
        else:
            ran = "" if self.seconds is None else f", which ran {self.seconds:.0f} s"
            what = f"{self.stage} did not finish{ran}"
        starts = f"{self.starts} start{'' if self.starts == 1 else 's'}"
        return (
            f"slurm job {job_id}: {starts} committed nothing "
            f"(launch.max_idle_requeues={limit}): {what}; the job's time limit is "
            f"{time_limit or 'unknown'}: give it a longer --time, or make the stage shorter"
        )


def idle_starts(events_path: Path, job_id: str, *, now: float | None = None) -> IdleStarts:
    """Count `job_id`'s starts since the last progress, reading `events_path` backwards
    (a long run's log is read only as far back as its last commit). With `now`, a stage
    this process began ran until `now`."""
    starts = 0
    stage: tuple[str, int, float] | None = None  # (what, pid, begun)
    last_t: dict[int, float] = {}  # each process's latest event seen (read newest first)
    for e in _backwards(events_path):
        kind = e.get("event")
        if kind in PROGRESS:
            break
        pid = int(e.get("pid", 0))
        t = float(e.get("t", 0.0))
        last_t.setdefault(pid, t)
        if e.get("rank", 0) != 0:
            continue
        if kind == "job_start" and str(e.get("job")) == job_id:
            starts += 1
        elif kind == "stage_begin" and stage is None:
            stage = (f"step {e.get('step')} {e.get('stage')}", pid, t)
    if stage is None:
        return IdleStarts(starts=starts, stage=None, seconds=None)
    what, pid, begun = stage
    end = now if now is not None and pid == os.getpid() else last_t[pid]
    return IdleStarts(starts=starts, stage=what, seconds=max(0.0, end - begun))


def _backwards(path: Path) -> Iterator[dict]:
    """The log's records, newest first; a torn last line (a kill mid-write) is skipped."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; a generator holds it open)
    except FileNotFoundError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        rest = b""
        while pos > 0:
            size = min(_BLOCK, pos)
            pos -= size
            f.seek(pos)
            chunk = f.read(size) + rest
            lines = chunk.split(b"\n")
            # The first piece may be the tail of a line that began in an earlier block.
            rest = lines.pop(0) if pos > 0 else b""
            for raw in reversed(lines):
                rec = _record(raw)
                if rec is not None:
                    yield rec
        rec = _record(rest)
        if rec is not None:
            yield rec


def _record(raw: bytes) -> dict | None:
    """One line's record. A line torn by a kill mid-write has the next start's first record
    appended to it (the log is opened for appending): that record is read from where it
    begins."""
    for start in (0, raw.rfind(b'{"t": ')):
        try:
            rec = json.loads(raw[start:])
        except ValueError:
            continue
        return rec if isinstance(rec, dict) else None
    return None
