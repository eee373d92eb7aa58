"""The trackers that receive each committed step's metrics: RUN/metrics.jsonl, wandb and
TensorBoard, each logging a step only if it does not hold it yet.

A step's metrics are a pure function of its committed files (`rftpipe.run.metrics`), so a
restarted run offers the trackers every committed step again and each logs exactly the
steps it lacks, once each, whatever instant the previous process died.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from rftpipe.atomic import atomic_write_bytes
from rftpipe.space import writing
from rftpipe.storage.layout import RunDir


class Tracker(Protocol):
    """A metrics sink. `log` is called once per committed step, in step order; a tracker
    skips steps it already holds, so restarts can offer it every committed step."""

    def has(self, step: int) -> bool: ...

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    def has(self, step: int) -> bool:
        return True

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Tracking switched off."""

    def close(self) -> None:
        """Nothing to close."""


class JsonlTracker:
    """RUN/metrics.jsonl, one line per committed step; cut back to committed steps on resume.

    It is the last tracker written for a step, so a step that has its line was delivered to
    every tracker and a step that lacks it is offered to all of them again on restart.
    """

    def __init__(self, path: Path, last_committed: int) -> None:
        self.path = path
        self.records: dict[int, dict[str, Any]] = {}
        if path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a kill mid-append
                if rec.get("step", 0) <= last_committed and rec["step"] not in self.records:
                    kept.append(line)
                    self.records[rec["step"]] = rec
            atomic_write_bytes(path, "".join(k + "\n" for k in kept).encode())

    def has(self, step: int) -> bool:
        return step in self.records

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.records:
            return
        with writing(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[step] = metrics

    def close(self) -> None:
        """Every line is already on disk."""


class WandbTracker:
    """wandb with one run id per run directory, resumed across requeues.

    A SIGKILLed process loses whatever wandb-core had not yet written, so the steps wandb
    already holds are read back rather than assumed: the history in the run files under
    RUN/wandb (offline and online runs both keep one per process start), plus, online,
    everything below the server's resumed step. Only the other committed steps are logged.
    """

    def __init__(self, run: RunDir, mode: WandbMode, project: str, config: dict[str, Any]) -> None:
        import wandb

        from rftpipe.observe.wandb_log import logged_steps

        id_file = run.root / "wandb_id"
        if not id_file.exists():
            atomic_write_bytes(id_file, secrets.token_hex(4).encode())
        run_id = id_file.read_text().strip()
        self.dir = run.root / "wandb"
        self.have = set(logged_steps(self.dir, run_id))
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(run.root),
            config=config,
        )
        # The server refuses steps below the one it resumed at.
        self.have.update(range(self.run.starting_step))

    def has(self, step: int) -> bool:
        return step in self.have

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.have:
            return
        with writing(self.dir):
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        self.have.add(step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """RUN/tensorboard, reopened after a restart with `purge_step` at the first step it will
    log again, so events a killed process wrote for that step or later are dropped."""

    def __init__(self, run: RunDir, have: set[int], first_missing: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.have = set(have)
        self.dir = run.root / "tensorboard"
        with writing(self.dir):  # its writer thread's failure surfaces at the next flush
            self.writer = SummaryWriter(str(self.dir), purge_step=first_missing)

    def has(self, step: int) -> bool:
        return step in self.have

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.have:
            return
        with writing(self.dir):
            for k, v in metrics.items():
                if k != "step" and isinstance(v, int | float):
                    self.writer.add_scalar(k, v, global_step=step)
            self.writer.flush()
        self.have.add(step)

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The run's trackers, JSONL last (see JsonlTracker)."""

    def __init__(self, trackers: list[Any], jsonl: JsonlTracker | None = None) -> None:
        self.trackers = trackers
        self.jsonl = jsonl

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def log_committed(self, steps: range, step_metrics: Callable[[int], dict[str, Any]]) -> None:
        """Offer committed steps again; each tracker logs only what it lacks, so steps a kill
        kept from (or cost) a tracker end up logged exactly once. The JSONL line, when there
        is one, is what the other trackers missed; otherwise `step_metrics(step)`, computed
        from the step's files, is."""
        for step in steps:
            if all(t.has(step) for t in self.trackers):
                continue
            rec = self.jsonl.records.get(step) if self.jsonl else None
            self.log(rec if rec is not None else step_metrics(step), step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


WandbMode = Literal["online", "offline"]
"""How a run logs to wandb (`wandb.init`'s `mode`)."""


def wandb_mode(setting: Literal["auto", "offline", "online", "off"]) -> WandbMode | None:
    if setting == "off":
        return None
    if setting == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return setting
