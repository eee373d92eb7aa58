"""Checkpoints through torch.distributed.checkpoint, committed by a directory rename.

``checkpoints/step-N/`` holds the engine's files (DCP for model and optimizer), ``extra.pt`` with the
small Stateful pieces (scheduler, KL controller, sampler, RNG), and ``COMMITTED.json``
listing every file's checksum. The directory is written as ``.tmp-step-N`` and renamed when
complete, so a listing never sees a half-written checkpoint. Old ones are deleted only after
a newer one has committed, and the list is rebuilt from disk at every start.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rftpipe.dist import Dist
from rftpipe.engines.train import TrainEngine
from rftpipe.faults import events, fault
from rftpipe.store import (
    TMP_PREFIX,
    CorruptionError,
    atomic_write_json,
    checksum_file,
    fsync_dir,
    read_json,
)

log = logging.getLogger(__name__)
COMMIT_FILE = "COMMITTED.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    step: int
    path: Path


def list_committed(root: Path) -> list[Checkpoint]:
    """Committed checkpoints, oldest first (only complete, renamed directories count)."""
    if not root.exists():
        return []
    out = [
        Checkpoint(step=int(p.name.split("-")[1]), path=p)
        for p in root.glob("step-*")
        if (p / COMMIT_FILE).exists()
    ]
    return sorted(out, key=lambda c: c.step)


def verify(ckpt: Checkpoint) -> None:
    manifest = read_json(ckpt.path / COMMIT_FILE)
    for name, info in manifest["files"].items():
        f = ckpt.path / name
        if (
            not f.exists()
            or f.stat().st_size != info["bytes"]
            or checksum_file(f) != info["xxh3_128"]
        ):
            raise CorruptionError(f, "checkpoint file missing, truncated or with a bad checksum")


def save(
    root: Path,
    step: int,
    engine: TrainEngine,
    extra: dict[str, Any],
    dist: Dist,
    keep_last: int,
) -> float:
    """Have the engine write its state, then commit and apply retention; returns seconds."""
    t0 = time.perf_counter()
    final = root / f"step-{step:06d}"
    tmp = root / f"{TMP_PREFIX}step-{step:06d}"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    engine.save_checkpoint(tmp)
    torch.save(extra, tmp / f"extra-r{dist.rank}.pt")
    fault("ckpt_mid_write")
    dist.barrier()
    if dist.is_main:
        files = {}
        for f in sorted(tmp.iterdir()):
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            files[f.name] = {"bytes": f.stat().st_size, "xxh3_128": checksum_file(f)}
        atomic_write_json(
            tmp / COMMIT_FILE, {"step": step, "world_size": dist.world, "files": files}
        )
        fault("ckpt_before_rename")
        os.replace(tmp, final)
        fsync_dir(root)
        events().write("checkpoint", step=step)
        _retain(root, keep_last)
    dist.barrier()
    return time.perf_counter() - t0


def _retain(root: Path, keep_last: int) -> None:
    for old in list_committed(root)[:-keep_last]:
        # Rename first: a crash mid-delete leaves a temp dir that cleanup removes, never a
        # checkpoint that looks committed but is missing files.
        trash = root / f"{TMP_PREFIX}trash-{old.path.name}"
        os.replace(old.path, trash)
        fault("retention_mid_delete")
        shutil.rmtree(trash)


def load(ckpt: Checkpoint, engine: TrainEngine) -> dict[str, Any]:
    """Restore the engine in place (resharding to this world size); return the extras."""
    engine.load_checkpoint(ckpt.path)
    # Rank-local extras hold only world-independent state, so rank 0's copy serves any world size.
    return torch.load(ckpt.path / "extra-r0.pt", weights_only=True)
