"""The full integrity audit of a run directory (`rftpipe inspect RUN verify`): every
committed stage shard, published trajectory file and checkpoint file against its record,
every image of the run's content-addressed store against its sha256 name, and every image
that a committed stage shard or trajectory file references for its presence.
A restart checks only what it reads; this checks everything, for a quiet moment or a cron job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from rftpipe.atomic import CorruptionError
from rftpipe.checkpoint.folder import checkpoint_corruption, committed_checkpoints
from rftpipe.inspect import routes
from rftpipe.storage.images import image_corruption, missing_images, stored_images
from rftpipe.storage.layout import RunDir, list_steps
from rftpipe.storage.stage_store import StageStore


@dataclass(slots=True)
class Audit:
    """What `verify_run` checked and what it found corrupt."""

    stages: int = 0
    """Committed stage directories checked (generation rounds and evaluation included)."""
    checkpoints: int = 0
    """Committed checkpoints checked."""
    images: int = 0
    """Images of the run's image store rehashed."""
    routes: int = 0
    """Committed shards whose routes columns (an MoE run's) were checked."""
    corrupt: list[dict[str, str]] = field(default_factory=list)
    """One {"path", "why"} per missing, truncated or altered file, and per routes problem of
    a shard (its `why` names the column, step, stage, shard and row)."""
    missing_images: list[dict[str, str | int]] = field(default_factory=list)
    """One {"path", "step", "stage"} per image that committed rows reference and the store
    lacks: the first committed stage (or `trajectories`) found referencing it."""


def verify_run(run_dir: Path) -> Audit:
    """Check every committed stage, checkpoint and stored image of the run at `run_dir`."""
    rundir = RunDir(run_dir)
    store = StageStore(rundir)
    audit = Audit()
    with_rows: list[tuple[int, str, Path]] = []
    for step in list_steps(rundir.stages):
        stages = sorted(store.committed_stages(step))
        shapes = routes.step_shapes(store, step, stages)
        for stage in stages:
            audit.stages += 1
            try:
                store.verify(step, stage)
            except CorruptionError as exc:
                audit.corrupt.append({"path": str(exc.path), "why": exc.why})
                continue
            shards = store.shard_files(step, stage)
            with_rows += [(step, stage, p) for p in shards]
            _check_routes(audit, step, stage, shards, shapes)
    with_rows += _unlinked_trajectories(rundir, [p for _, _, p in with_rows])
    audit.missing_images = _missing_images(rundir, with_rows, audit.corrupt)
    for _, path in committed_checkpoints(rundir.checkpoints):
        audit.checkpoints += 1
        audit.corrupt += [{"path": str(e.path), "why": e.why} for e in checkpoint_corruption(path)]
    for image in stored_images(rundir.root):
        audit.images += 1
        if (bad := image_corruption(image)) is not None:
            audit.corrupt.append({"path": str(bad.path), "why": bad.why})
    return audit


def _check_routes(
    audit: Audit, step: int, stage: str, shards: list[Path], shapes: list[dict[str, Any]]
) -> None:
    """Count the (verified) shards of a stage that carry routes, and add to `corrupt` one
    entry per shard whose routes shape is not its step's, or per bad row
    (`routes.shard_problems`)."""
    for shard in shards:
        try:
            problems = routes.shard_problems(shard, step, stage, shapes)
        except (OSError, pa.ArrowException) as exc:
            problems = [f"routes of step {step} {stage} {shard.name}: {exc}"]
        if problems is not None:
            audit.routes += 1
            audit.corrupt += [{"path": str(shard), "why": why} for why in problems]


def _missing_images(
    run: RunDir, with_rows: list[tuple[int, str, Path]], corrupt: list[dict[str, str]]
) -> list[dict[str, str | int]]:
    """`Audit.missing_images` of the files `with_rows`; a file whose `images` column cannot
    be read, or names a path outside the store, is added to `corrupt`."""
    found: dict[Path, dict[str, str | int]] = {}
    for step, stage, shard in with_rows:
        try:
            gone = missing_images(run.root, [(step, stage, shard)])
        except (OSError, ValueError, pa.ArrowException) as exc:
            corrupt.append({"path": str(shard), "why": f"images column: {exc}"})
            continue
        for g in gone:
            found.setdefault(g.path, {"path": str(g.path), "step": g.step, "stage": g.stage})
    return list(found.values())


def _unlinked_trajectories(run: RunDir, shards: list[Path]) -> list[tuple[int, str, Path]]:
    """The published trajectory files that are not hard links to a verified stage shard
    (a copy, where the file system has none): their rows are read on their own."""
    linked = {(st.st_dev, st.st_ino) for st in map(os.stat, shards)}
    out = []
    for step in list_steps(run.trajectories):
        for f in sorted(run.trajectory_dir(step).glob("*.parquet")):
            st = os.stat(f)
            if (st.st_dev, st.st_ino) not in linked:
                out.append((step, "trajectories", f))
    return out
