"""The full integrity audit of a run directory (`rftpipe inspect RUN verify`): every
committed stage shard, published trajectory file and checkpoint file against its record,
and every image of the run's content-addressed store against its sha256 name.
A restart checks only what it reads; this checks everything, for a quiet moment or a cron job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rftpipe.checkpoint.folder import checkpoint_corruption, committed_checkpoints
from rftpipe.storage.atomic import CorruptionError
from rftpipe.storage.images import image_corruption, stored_images
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
    corrupt: list[dict[str, str]] = field(default_factory=list)
    """One {"path", "why"} per missing, truncated or altered file."""


def verify_run(run_dir: Path) -> Audit:
    """Check every committed stage, checkpoint and stored image of the run at `run_dir`."""
    rundir = RunDir(run_dir)
    store = StageStore(rundir)
    audit = Audit()
    for step in list_steps(rundir.stages):
        for stage in sorted(store.committed_stages(step)):
            audit.stages += 1
            try:
                store.verify(step, stage)
            except CorruptionError as exc:
                audit.corrupt.append({"path": str(exc.path), "why": exc.why})
    for _, path in committed_checkpoints(rundir.checkpoints):
        audit.checkpoints += 1
        audit.corrupt += [{"path": str(e.path), "why": e.why} for e in checkpoint_corruption(path)]
    for image in stored_images(rundir.root):
        audit.images += 1
        if (bad := image_corruption(image)) is not None:
            audit.corrupt.append({"path": str(bad.path), "why": bad.why})
    return audit
