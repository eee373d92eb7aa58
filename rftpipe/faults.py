"""Named fault points and the run's event log.

``RFTPIPE_FAULT=point[,point...]`` makes the process SIGKILL itself the first time it
reaches one of the named points (``RFTPIPE_FAULT_SKIP=k`` lets k hits pass first). The
hit is appended to ``events.jsonl`` *before* the kill so tests can prove every fault point
was exercised. ``RFTPIPE_SLOW=stage=seconds[,...]`` stretches a stage's compute (and
``STAGE_replay`` a restart's replay of a committed one, e.g. ``train_replay``), so a test
can aim a preemption at a known stage. Outside tests each check is one dict lookup.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

FAULT_POINTS: tuple[str, ...] = (
    "shard_before_rename",
    "shard_after_rename",
    "manifest_mid_write",
    "manifest_before_rename",
    "stage_after_commit",
    "publish_before_rename",
    "ckpt_mid_write",
    "ckpt_before_rename",
    "retention_mid_delete",
    "train_mid_step",
    "train_mid_replay",
)

_hits: dict[str, int] = {}


class EventLog:
    """Append-only JSONL diagnostics (not part of the committed state)."""

    def __init__(self, path: Path | None, rank: int = 0) -> None:
        self.path = path
        self.rank = rank

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        rec = {"t": round(time.time(), 3), "pid": os.getpid(), "rank": self.rank, "event": event}
        rec.update(fields)
        # O_APPEND writes of one short line are atomic enough for concurrent ranks.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


_events = EventLog(None)


def set_event_log(log: EventLog) -> None:
    global _events
    _events = log


def events() -> EventLog:
    return _events


def fault(point: str) -> None:
    """Kill this process with SIGKILL if `point` is armed by the environment."""
    armed = os.environ.get("RFTPIPE_FAULT")
    if not armed or point not in armed.split(","):
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] <= int(os.environ.get("RFTPIPE_FAULT_SKIP", "0")):
        return
    _events.write("fault", point=point)
    os.kill(os.getpid(), signal.SIGKILL)


def slow(stage: str) -> None:
    """Sleep inside `stage` if ``RFTPIPE_SLOW`` names it (a test aid, like the fault points)."""
    spec = os.environ.get("RFTPIPE_SLOW")
    if not spec:
        return
    delays = dict(item.split("=", 1) for item in spec.split(","))
    if stage in delays:
        time.sleep(float(delays[stage]))
