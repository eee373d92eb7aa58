"""Restart logic: clean leftovers, check every committed file, restore the newest checkpoint.

Rules:
- uncommitted temp files and unlisted shards are deleted;
- a corrupt file in the *newest* committed stage: that stage alone is redone (seeds are
  derived, so its rows come out identical);
- corruption anywhere older: refuse (exit 2, naming the path) unless ``--repair``, which
  moves the corrupt step and everything after it to ``RUN/quarantine/`` and resumes from
  the newest checkpoint before it;
- a corrupt newest checkpoint falls back to the previous one (more train steps replayed).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from rftpipe import checkpoint
from rftpipe.errors import UserError
from rftpipe.faults import events
from rftpipe.runtime import Runtime
from rftpipe.stages import sync
from rftpipe.store import STAGES, CorruptionError, RunDir, Stage, fsync_dir, verify_shard

log = logging.getLogger(__name__)


def committed_stages(run: RunDir) -> list[tuple[int, Stage]]:
    root = run.root / "stages"
    steps = sorted(int(p.name.split("=")[1]) for p in root.glob("step=*")) if root.exists() else []
    return [(s, st) for s in steps for st in STAGES if run.is_committed(s, st)]


def check_files(run: RunDir, repair: bool) -> None:
    """Verify every committed shard and published trajectory file (rank 0 only)."""
    stages = committed_stages(run)
    for step, stage in stages:
        if stage == "train":
            continue
        try:
            if stage == "sync":
                _verify_trajectories(run, step)
            else:
                run.verify_stage(step, stage)
        except CorruptionError as exc:
            if (step, stage) == stages[-1]:
                events().write("redo_corrupt_stage", step=step, stage=stage, path=str(exc.path))
                log.warning(
                    "newest committed stage %s of step %d is corrupt (%s); redoing it",
                    stage,
                    step,
                    exc,
                )
                run.uncommit_stage(step, stage)
                return
            if not repair:
                raise UserError(
                    f"corrupt committed file {exc.path} ({str(exc).split(': ', 1)[1]}); "
                    "rerun with --repair to roll the run back before it"
                ) from exc
            quarantine_from(run, step)
            return


def _verify_trajectories(run: RunDir, step: int) -> None:
    for info in run.manifest(step, "sync")["shards"]:
        verify_shard(run.trajectory_dir(step), info)


def quarantine_from(run: RunDir, step: int) -> None:
    """Move step `step` and everything after it (stages, trajectories, checkpoints) aside."""
    dest = run.root / "quarantine" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True, exist_ok=True)
    moves = [p for p in (run.root / "stages").glob("step=*") if int(p.name.split("=")[1]) >= step]
    moves += [p for p in run.trajectories.glob("step=*") if int(p.name.split("=")[1]) >= step]
    moves += [c.path for c in checkpoint.list_committed(run.checkpoints) if c.step >= step]
    for p in sorted(moves):
        target = dest / p.parent.name / p.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, target)
    for d in {p.parent for p in moves}:
        fsync_dir(d)
    events().write("repair", from_step=step, quarantine=str(dest))
    log.warning("--repair: moved step %d onwards to %s", step, dest)


def restore(rt: Runtime) -> int:
    """Load the newest intact checkpoint; return its step (0: start from the initial weights)."""
    for ckpt in reversed(checkpoint.list_committed(rt.run.checkpoints)):
        try:
            checkpoint.verify(ckpt)
        except CorruptionError as exc:
            events().write("corrupt_checkpoint", step=ckpt.step, path=str(exc.path))
            log.warning(
                "checkpoint %s is corrupt (%s); falling back to an older one", ckpt.path, exc
            )
            if rt.dist.is_main:
                shutil.rmtree(ckpt.path)
            continue
        extra = checkpoint.load(ckpt, rt.train_engine)
        rt.kl_ctrl.load_state_dict(extra["kl_controller"])
        rt.train_engine.load_state_dict(extra["engine"])
        return ckpt.step
    return 0


def prepare(rt: Runtime, repair: bool) -> int:
    """Make the run directory consistent and restore state; returns the checkpoint step."""
    if rt.dist.is_main:
        removed = rt.run.clean_uncommitted()
        check_files(rt.run, repair)
        events().write("start", removed=len(removed), last_commit=str(rt.run.last_commit()))
    rt.dist.barrier()
    step = restore(rt)
    # The engine now serves the restored weights; later rollouts record their version.
    sync.run(rt.rollout_engine, rt.train_engine, version=step)
    rt.dist.barrier()
    return step
