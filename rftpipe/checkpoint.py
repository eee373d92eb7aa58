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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from rftpipe import direct_io
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


class Writer:
    """Writes checkpoints in the background, one at a time.

    Only the train stage changes the weights, so the checkpoint taken after step N's sync is
    written while step N+1 rolls out, scores and computes advantages; `wait()` runs before
    the next train stage and before the process ends, so a write never sees a half-updated
    model. A kill mid-write leaves only a temp directory, which resume discards, so the
    previous checkpoint stays the newest committed one. Multi-rank writes run their DCP
    collectives on a process group of their own, never interleaved with the main thread's.
    """

    def __init__(self, dist: Dist, direct_io: bool = True) -> None:
        self.dist = dist
        self.direct_io = direct_io
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(
        self, root: Path, step: int, engine: TrainEngine, extra: dict[str, Any], keep_last: int
    ) -> float:
        """Start writing checkpoint `step`; returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        dist = self.dist
        tmp = root / f"{TMP_PREFIX}step-{step:06d}"
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save(extra, tmp / f"extra-r{dist.rank}.pt")
        state = engine.checkpoint_state()
        if tdist.is_initialized() and self._group is None:
            self._group = tdist.new_group(backend="gloo")
        dist.barrier()  # every rank's extras exist before rank 0 can commit
        self._thread = threading.Thread(
            target=self._write,
            args=(root, step, tmp, state, keep_last),
            name=f"rftpipe-checkpoint-{step}",
            daemon=True,  # an abandoned write leaves a temp dir, never a false commit
        )
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the pending write (if any) has finished; re-raise its failure."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed: {err}") from err
        return time.perf_counter() - t0

    def _write(
        self, root: Path, step: int, tmp: Path, state: dict[str, Any], keep_last: int
    ) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            # Lowest CPU priority for this thread alone: the rollout it overlaps keeps the
            # cores, the write soaks up their idle moments, and whatever is left runs at full
            # speed while the next train stage waits for it.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            writer, fs = direct_io.storage_writer(tmp, self.direct_io)
            try:
                # Returns on rank 0 only after every rank's files are written and synced.
                dcp.save(state, storage_writer=writer, process_group=self._group)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if fs.write_error is None:
                    raise
                raise fs.write_error from exc  # "No space left on device", not a zip offset
            fault("ckpt_mid_write")
            if self.dist.is_main:
                _commit(root, step, tmp, self.dist.world, keep_last, fs.written)
        except BaseException as exc:  # surfaced by wait() in the main thread
            self._error = exc


def _commit(
    root: Path,
    step: int,
    tmp: Path,
    world: int,
    keep_last: int,
    written: dict[str, tuple[int, str]],
) -> None:
    """`written`: size and digest of the files this rank wrote (already fsynced); the rest
    (other ranks' shards, the extras) are synced and read back here."""
    files = {}
    for f in sorted(tmp.iterdir()):
        size = f.stat().st_size
        known = written.get(str(f.resolve()))
        if known is not None and known[0] == size:
            files[f.name] = {"bytes": size, "xxh3_128": known[1]}
            continue
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": size, "xxh3_128": checksum_file(f)}
    atomic_write_json(tmp / COMMIT_FILE, {"step": step, "world_size": world, "files": files})
    fault("ckpt_before_rename")
    os.replace(tmp, root / f"step-{step:06d}")
    fsync_dir(root)
    events().write("checkpoint", step=step)
    _retain(root, keep_last)


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
