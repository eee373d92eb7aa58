"""Each role's busy and idle seconds per step: generation (rollout, score) and training
(advantage, train, sync, eval).

Every stage this process computes adds its seconds to its role's counter (`clock`), from
whichever thread runs it (`rollout.overlap`). At each step it logs, the trainers' first
rank takes the counters' growth since the step before against the wall time between the
two (`Roles.step_figures`): a role's idle seconds are that interval less its busy ones.
Separate rollout ranks (`launch.rollout_ranks`) count generation in their own process;
their first rank writes its counter to RUN/handoff/generation_clock.json after each step
it generates, with its own clock's reading, and the trainers read the growth of both.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from rftpipe.stages import GENERATION

CLOCK_FILE = "generation_clock.json"


def role_of(stage: str) -> str:
    """'generation' for a generation stage (a round's or a turn's commit included)."""
    return "generation" if stage.split(".")[0] in GENERATION else "training"


class Clock:
    """This process's busy seconds per role since it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = {"generation": 0.0, "training": 0.0}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._busy[role_of(stage)] += seconds

    def busy(self, role: str) -> float:
        with self._lock:
            return self._busy[role]


_clock = Clock()


def clock() -> Clock:
    return _clock


def write_generation_clock(root: Path) -> None:
    """The rollout ranks' first rank: its generation seconds and its clock, for the
    trainers (written whole: a reader never sees half of it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{CLOCK_FILE}.tmp"
    tmp.write_text(json.dumps({"busy_s": _clock.busy("generation"), "t": time.monotonic()}))
    os.replace(tmp, root / CLOCK_FILE)


class Roles:
    """The trainers' first rank's view: the growth of the counters between two steps."""

    def __init__(self, remote: Path | None) -> None:
        """`remote`: the directory of the rollout ranks' clock file (None: generation runs
        in this process). The rollout ranks write it before the job's start barrier, so it
        is there when the trainers build this."""
        self.remote = remote
        self._last = self._read(None)

    def _read(
        self, last: tuple[float, float, float, float] | None
    ) -> tuple[float, float, float, float]:
        """(wall, training busy, generation's wall, generation busy) now; a clock file
        that cannot be read repeats `last`'s generation figures (none grew)."""
        now = time.monotonic()
        generation = (now, _clock.busy("generation"))
        if self.remote is not None:
            try:
                info = json.loads((self.remote / CLOCK_FILE).read_text())
                generation = (float(info["t"]), float(info["busy_s"]))
            except (OSError, ValueError, KeyError):
                generation = (last[2], last[3]) if last is not None else (0.0, 0.0)
        return now, _clock.busy("training"), *generation

    def step_figures(self) -> dict[str, float]:
        """`perf/<role>_busy_s` and `_idle_s` since the previous call (or the start).
        With separate rollout ranks, generation's are over the interval between the two
        latest writes of their clock file, on their own clock."""
        now = self._read(self._last)
        wall, train_busy = now[0] - self._last[0], now[1] - self._last[1]
        gen_wall, gen_busy = now[2] - self._last[2], now[3] - self._last[3]
        self._last = now
        return {
            "perf/training_busy_s": round(train_busy, 3),
            "perf/training_idle_s": round(max(0.0, wall - train_busy), 3),
            "perf/generation_busy_s": round(gen_busy, 3),
            "perf/generation_idle_s": round(max(0.0, gen_wall - gen_busy), 3),
        }
