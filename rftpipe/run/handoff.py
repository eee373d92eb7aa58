"""Where the two roles of a disaggregated run meet (`rftpipe.run.placement`): the run
directory.

- The trainers wait for a step's generation to commit (`await_generation`), then read its
  rows as any committed stage's.
- After the sync of version v, the trainers publish v's weights as RUN/handoff/v<v>
  (`publish`), written whole under a temporary name first; the rollout ranks wait for the
  version their next step samples from (`receive`, `rftpipe.run.staleness.weights_of`).

The schedule fixes which versions are used: v >= 1 samples step v+1+k only, so a version
is published only while that step's generation is not committed, and when v is published
every version up to v-1-k has been used (step v trained, so steps up to v generated) and is
deleted. A restart publishes again what the rollout ranks still lack: the checkpoint's
version when it loads, then each replayed step's. Every wait polls, checking the role's
stop flag at each poll, so a stop never leaves a role waiting for the other.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.run.staleness import weights_of
from rftpipe.stages.base import Runtime
from rftpipe.stages.sync import write_weights
from rftpipe.storage.layout import RunDir

log = logging.getLogger(__name__)

POLL_S = 0.1
"""Seconds between two looks at the run directory while a role waits."""

FIRST_STAGE_AFTER_GENERATION = "score"
"""The stage whose commit completes a step's generation (no dynamic sampling: one round)."""


def channel(rt: Runtime) -> Path:
    return channel_of(rt.run)


def channel_of(run: RunDir) -> Path:
    """RUN/handoff: the weights for the rollout ranks, their clock, a role's failure."""
    return run.root / "handoff"


def used_by(version: int, staleness: int) -> int | None:
    """The one step whose rollouts sample from `version` (None: version 0, the initial
    weights, which the rollout ranks load themselves)."""
    if version < 1:
        return None
    step = version + 1 + staleness
    assert weights_of(step, staleness) == version
    return step


def publish(rt: Runtime, version: int) -> None:
    """Trainers, after the sync of `version`: the weights where the rollout ranks read them,
    if a step not yet generated samples from them (every trainer calls this)."""
    step = used_by(version, rt.cfg.rollout.staleness)
    if step is None or step > rt.cfg.total_steps or generated(rt, step):
        return
    t0 = time.perf_counter()
    weights = rt.train_engine.rollout_weights()
    if rt.dist.is_main:
        root = channel(rt)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_weights(weights, tmp)
        fault("handoff_mid_publish")
        target = root / f"v{version}"
        shutil.rmtree(target, ignore_errors=True)  # an earlier start's copy: the same weights
        tmp.rename(target)
        for old in root.iterdir():
            if old.name.startswith("v") and int(old.name[1:]) < version - rt.cfg.rollout.staleness:
                shutil.rmtree(old)
        events().write("handoff_publish", version=version, seconds=time.perf_counter() - t0)
    rt.dist.barrier()


def receive(rt: Runtime, step: int) -> float:
    """Rollout ranks, before generating `step`: the engine takes the weights it samples
    from, once the trainers published them. Returns the seconds spent waiting."""
    version = weights_of(step, rt.cfg.rollout.staleness)
    engine = rt.rollout_engine
    if engine.weight_version == version:
        return 0.0
    path = channel(rt) / f"v{version}"
    waited = wait(rt, path.exists, f"step {step}: weights v{version}")
    engine.update_weights(path, version)
    return waited


def await_generation(rt: Runtime, step: int) -> float:
    """Trainers, before step `step`'s advantage stage: wait until the rollout ranks have
    committed its generation. Returns the seconds spent waiting."""
    return wait(rt, lambda: generated(rt, step), f"step {step}: generation")


def generated(rt: Runtime, step: int) -> bool:
    """Whether step `step`'s generation committed."""
    return rt.store.is_committed(step, FIRST_STAGE_AFTER_GENERATION)


FAILED = "FAILED"
"""Written by a role's rank that fails: the other role stops waiting for it."""


def report_failure(root: Path, role: str, error: BaseException) -> None:
    """A rank of `role` failed with `error` (not a stop): tell the other role's waits."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{FAILED}.{os.getpid()}.tmp"
    tmp.write_text(f"the {role} ranks failed: {type(error).__name__}: {error}"[:2000])
    os.replace(tmp, root / FAILED)


def clear_failure(rt: Runtime) -> None:
    """The trainers' first rank, before the roles start: an earlier job's failure is not
    this one's."""
    if rt.dist.is_main:
        (channel(rt) / FAILED).unlink(missing_ok=True)


class OtherRoleFailed(UserError):
    """The ranks of the other role failed; this one would wait for them forever. A
    `UserError`: its one line (the other role's error) is what the job's rank 0 prints."""


def wait(rt: Runtime, ready: Callable[[], bool], what: str) -> float:
    """Poll until `ready()` on every rank of the role (they agree each poll, as on a stop),
    checking the stop flag at each poll, and that the other role has not failed (under
    Slurm nothing else would end this wait). Returns the seconds waited."""
    t0 = time.perf_counter()
    logged = False
    failed = channel(rt) / FAILED
    while True:
        rt.stop.check(rt.dist, f"waiting for {what}")
        if rt.dist.any(failed.exists()):
            raise OtherRoleFailed(f"{failed.read_text()} (while waiting for {what})")
        if not rt.dist.any(not ready()):
            break
        if not logged and time.perf_counter() - t0 > 5:
            log.info("waiting for %s", what)
            logged = True
        time.sleep(POLL_S)
    seconds = time.perf_counter() - t0
    events().write("handoff_wait", what=what, seconds=round(seconds, 3))
    return seconds


def published_versions(root: Path) -> list[int]:
    """The versions under RUN/handoff, oldest first (for tests and the inspector)."""
    if not root.exists():
        return []
    return sorted(int(p.name[1:]) for p in root.iterdir() if p.name.startswith("v"))
