"""The run's event log, ``RUN/events.jsonl``: append-only JSONL diagnostics.

One process-wide log (`events()`), pointed at the run directory by the worker
(`set_event_log`); until then, and outside runs, writes go nowhere. It is not part of the
committed state: nothing resumes from it, though tests and the checkpoint policy's
preemption history read it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rftpipe.space import writing


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
        with writing(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


_events = EventLog(None)


def set_event_log(log: EventLog) -> None:
    global _events
    _events = log


def events() -> EventLog:
    return _events
