"""Restart: clean leftovers, check what the restart will read, restore the newest checkpoint.

The work is proportional to what the restart needs, not to the run's length:
- leftovers exist only around the step in progress (`StageStore.clean_uncommitted`);
- verified here: the newest committed stage (a corrupt one is redone: seeds are derived, so
  its rows come out identical) and the committed stages that replay will read (the newest
  data stage of every step after the checkpoint); corruption there that is not the newest
  stage refuses to start (exit 2, naming the path) unless ``--repair``, which moves that
  step and everything after it to ``RUN/quarantine/`` and recomputes them;
- the checkpoint is verified block by block while it loads; a corrupt one falls back to the
  previous one (more train steps replayed), or to the initial weights;
- everything older is checked by ``rftpipe inspect RUN verify``, off the critical path.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from rftpipe.atomic import CorruptionError, fsync_dir
from rftpipe.checkpoint import writer
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.run.driver import stateful_parts
from rftpipe.run.runtime import rebuild_actor
from rftpipe.space import writing
from rftpipe.stages import FINAL, chain_position
from rftpipe.stages.base import Runtime
from rftpipe.stages.chain import PIPELINE
from rftpipe.stages.images import store_images
from rftpipe.stages.sync import sync_weights
from rftpipe.storage.images import (
    ImageRef,
    missing_images,
    quarantine_corrupt_images,
    verify_images,
)
from rftpipe.storage.layout import RunDir, list_steps
from rftpipe.storage.stage_store import StageStore

log = logging.getLogger(__name__)


def replay_reads(store: StageStore, after: int) -> list[tuple[int, str]]:
    """(step, stage) whose rows a restart from checkpoint `after` reads: in each later step,
    the newest committed stage with rows before the first stage that runs or replays with
    them (the executor reads nothing else)."""
    out = []
    for step in (s for s in list_steps(store.run.stages) if s > after):
        newest = None
        for stage in PIPELINE:
            if not store.is_committed(step, stage.name) or stage.replay_reads_rows:
                break
            if store.manifest(step, stage.name)["shards"]:
                newest = stage.name
        if newest is not None:
            out.append((step, newest))
    return out


def restart_reads(store: StageStore, ckpt_step: int) -> list[tuple[int, str]]:
    """(step, stage) whose rows a restart from checkpoint `ckpt_step` reads: what replay
    reads, and the newest commit (the next stage reads its rows)."""
    newest = store.newest_commit(chain_position)
    todo = replay_reads(store, ckpt_step)
    if newest is not None and newest not in todo:
        todo.append(newest)
    return todo


def check_files(store: StageStore, ckpt_step: int, repair: bool) -> None:
    """Verify the newest commit and what replay reads (rank 0 only); see the module doc."""
    newest = store.newest_commit(chain_position)
    for step, stage in restart_reads(store, ckpt_step):
        try:
            store.verify(step, stage)
        except CorruptionError as exc:
            if (step, stage) == newest:
                events().write("redo_corrupt_stage", step=step, stage=stage, path=str(exc.path))
                log.warning(
                    "newest committed stage %s of step %d is corrupt (%s); redoing it",
                    stage,
                    step,
                    exc,
                )
                store.uncommit(step, stage)
                return
            if not repair:
                raise UserError(
                    f"corrupt committed file {exc.path} ({exc.why}); "
                    "rerun with --repair to roll the run back before it"
                ) from exc
            quarantine_from(store.run, step)
            return


def check_images(rt: Runtime, ckpt_step: int, repair: bool) -> None:
    """Rehash the run's image store, and look for each image that the rows the restart reads
    reference (rank 0). A corrupt or missing image is refused, or with `repair` (a corrupt
    one moved to the quarantine first) written again from the dataset, which still holds it
    (the data fingerprint guarantees the same prompts): the rows that reference it stay
    valid. Older rows' images are `rftpipe inspect RUN verify`'s to check."""
    bad = verify_images(rt.run.root)
    reads = restart_reads(rt.store, ckpt_step)
    shards = [(s, st, f) for s, st in reads for f in rt.store.shard_files(s, st)]
    gone = missing_images(rt.run.root, shards)
    if not bad and not gone:
        return
    if not repair:
        if gone:
            raise UserError(
                f"missing image {gone[0].path} (referenced by step {gone[0].step} "
                f"{gone[0].stage}; {len(gone)} missing in all); rerun with --repair to write "
                "it again from the dataset"
            )
        raise UserError(
            f"corrupt image {bad[0].path} ({bad[0].why}; {len(bad)} in all); rerun with "
            "--repair to write it again from the dataset"
        )
    dest = rt.run.quarantine / time.strftime("%Y%m%d-%H%M%S") / "images"
    moved = quarantine_corrupt_images(rt.run.root, dest) if bad else []
    refs = {ImageRef.parse(p.relative_to(rt.run.root).as_posix()) for p in moved}
    refs |= {m.ref for m in gone}
    prompts = [*rt.prompts.prompts, *(rt.held_out.prompts if rt.held_out else ())]
    store_images(rt.run.root, [p for p in prompts if refs.intersection(p.image_refs)])
    if left := [m for m in gone if not m.path.exists()]:
        # The data fingerprint held, so the dataset shows every image its rows did.
        raise UserError(f"missing image {left[0].path}: no prompt of the dataset shows it")
    events().write("repair_images", moved=len(moved), rewritten=len(refs), quarantine=str(dest))
    log.warning("--repair: rewrote %d corrupt or missing images from the dataset", len(refs))


def quarantine_from(run: RunDir, step: int) -> None:
    """Move step `step` and everything after it (stages, trajectories, checkpoints) aside."""
    dest = run.quarantine / time.strftime("%Y%m%d-%H%M%S")
    moves = [run.step_dir(s) for s in list_steps(run.stages) if s >= step]
    moves += [run.trajectory_dir(s) for s in list_steps(run.trajectories) if s >= step]
    moves += [c.path for c in writer.list_committed(run.checkpoints) if c.step >= step]
    # The directories are all the space a quarantine takes (renames take none): made first,
    # so a full file system or a spent quota stops the repair before it has moved anything.
    with writing(dest):
        for parent in {dest / p.parent.name for p in moves} | {dest}:
            parent.mkdir(parents=True, exist_ok=True)
    for p in sorted(moves):
        os.replace(p, dest / p.parent.name / p.name)
    for d in {p.parent for p in moves}:
        fsync_dir(d)
    events().write("repair", from_step=step, quarantine=str(dest))
    log.warning("--repair: moved step %d onwards to %s", step, dest)


def restore(rt: Runtime) -> int:
    """Load the newest intact checkpoint; return its step (0: the initial weights)."""
    parts = stateful_parts(rt)
    dirty = False
    for ckpt in reversed(writer.list_committed(rt.run.checkpoints)):
        try:
            # The optimizer's moments load while the first rollout runs (the first train
            # stage waits for them): a restart's first new work starts sooner.
            writer.load(ckpt, parts, later=rt.ckpt_writer)
            return ckpt.step
        except CorruptionError as exc:
            dirty = True
            events().write("corrupt_checkpoint", step=ckpt.step, path=str(exc.path))
            log.warning(
                "checkpoint %s is corrupt (%s); falling back to an older one", ckpt.path, exc
            )
            rt.dist.barrier()
            if rt.dist.is_main:
                shutil.rmtree(ckpt.path)
            rt.dist.barrier()
    if dirty:
        # A failed load may have written part of the state: start again from the model.
        rebuild_actor(rt)
    return 0


def prepare(rt: Runtime, repair: bool) -> int:
    """Make the run directory consistent and restore state; returns the checkpoint step."""
    store = rt.store
    if rt.dist.is_main:
        removed = store.clean_uncommitted(FINAL)
        done = writer.list_committed(rt.run.checkpoints)
        ckpt_step = done[-1].step if done else 0
        check_files(store, ckpt_step, repair)
        if rt.vision is not None:
            check_images(rt, ckpt_step, repair)
        newest = store.newest_commit(chain_position)
        last = store.newest_complete_step(FINAL)
        if last and store.manifest(last, FINAL).get("published"):
            # Killed between its commit and its publication (with rollout.staleness, later
            # steps' generation may have committed since, so not always the newest commit).
            store.publish(last, FINAL)
        events().write("start", removed=len(removed), last_commit=str(newest))
    rt.dist.barrier()
    step = restore(rt)
    # The engine now serves the restored weights; later rollouts record their version.
    sync_weights(rt, step)
    rt.dist.barrier()
    return step
