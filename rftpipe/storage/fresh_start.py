"""A run directory that committed nothing starts afresh; one being used is not touched.

A start that was refused (a text-only model for image rows, a bad column) or killed before
its first commit leaves config.yaml, run.json and events.jsonl behind, but no state: every
row, trajectory and checkpoint exists only once committed. Such a directory takes the next
command's config, model and data as a new run would. The earlier start's files move to
``RUN/superseded/<time>/`` (kept for diagnosis, read by nothing), so the new run neither
inherits their fingerprints nor looks resumed in its event log.

Whether a run is live there is told by ``RUN/.live.lock``: every worker holds a shared
`flock` on it for its whole life, and a fresh start takes it exclusively, without waiting,
before it moves anything. This module imports no torch (``jobs.submit`` runs it on a login
node).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rftpipe.atomic import TMP_PREFIX, fsync_dir, read_json
from rftpipe.errors import UserError
from rftpipe.storage.layout import MANIFEST, RUN_LAYOUT_VERSION, RunDir

log = logging.getLogger(__name__)

CONFIGS = ("config.yaml", "config.next.yaml")
LEFTOVERS: tuple[str, ...] = (
    *CONFIGS,
    "run.json",
    "events.jsonl",
    "metrics.jsonl",
    "eval.json",
    "wandb_id",
    "wandb",
    "tensorboard",
)
"""What a start writes before or beside its first commit and a new run must not inherit.
Left in place: ``images/`` (content-addressed: a file is valid whatever run wrote it),
``slurm/`` (job logs) and uncommitted stage files (the worker removes those)."""


def committed_work(run: RunDir) -> Path | None:
    """The first thing found that makes `run` more than a start (None: nothing): a committed
    stage in any spelling of its step, a trajectory, a checkpoint (committed or not: one is
    only begun after a committed step), a quarantine, or a run.json of another layout."""
    candidates = (
        run.stages.glob(f"*/*/{MANIFEST}"),
        _entries(run.trajectories),
        _entries(run.checkpoints),
        _entries(run.quarantine),
    )
    for found in candidates:
        first = next(iter(found), None)
        if first is not None:
            return first
    if run.run_json.exists() and read_json(run.run_json).get("schema_version") not in (
        None,
        RUN_LAYOUT_VERSION,
    ):
        # An older rftpipe's directory whose commits this one cannot see: never reset it.
        return run.run_json
    return None


def _entries(folder: Path) -> Iterator[Path]:
    if folder.is_dir():
        yield from (p for p in folder.iterdir() if not p.name.startswith(TMP_PREFIX))


def hold_live_lock(run: RunDir) -> int | None:
    """Mark this process as a live run of `run` until it exits (a worker calls this first).

    Returns the descriptor, to be kept open; None where the file system has no `flock`
    (then a fresh start cannot tell that a run is live)."""
    fd = os.open(run.live_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # Shared, so that every rank of a run holds it at once; waits only while a fresh
        # start is moving files (milliseconds).
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        os.close(fd)
        log.warning("run_dir: no flock on %s (%s); a run here is not marked live", run.root, exc)
        return None
    return fd


@contextmanager
def exclusive(run: RunDir) -> Iterator[None]:
    """Hold `run` for a fresh start; refused (exit 2) while any worker of it is live."""
    run.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(run.live_lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock_or_refuse(run, fd)
        yield
    finally:
        os.close(fd)


def _lock_or_refuse(run: RunDir, fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno != errno.EWOULDBLOCK:
            # No flock on this file system (the workers warn of it too): a live run cannot
            # be told, and refusing would block every fresh start here.
            log.warning("run_dir: no flock on %s (%s)", run.root, exc)
            return
        raise UserError(
            f"run_dir: a run is live in {run.root} (it holds {run.live_lock_path.name}); "
            "wait for it to end or stop it before starting this directory again"
        ) from exc


def set_aside(run: RunDir) -> Path | None:
    """Move an earlier start's `LEFTOVERS` to ``RUN/superseded/<time>/``; returns that
    folder (None: nothing but a config, which the caller replaces). Call only under
    `exclusive`, on a directory that has no `committed_work`."""
    present = [run.root / name for name in LEFTOVERS if (run.root / name).exists()]
    if not {p.name for p in present} - set(CONFIGS):
        # Only a config (`--create-only`, or a start refused before its worker ran): it is
        # replaced, and there is nothing to keep for diagnosis.
        run.pending_config_path.unlink(missing_ok=True)
        return None
    dest = run.superseded / time.strftime("%Y%m%d-%H%M%S")
    n = 0
    while dest.exists():  # two fresh starts within a second
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for p in present:
        os.replace(p, dest / p.name)
    fsync_dir(dest)
    fsync_dir(run.root)
    return dest


def refuse_misplaced(path: Path) -> None:
    """Refuse (`UserError`, one line) a run directory that is a file, or that lies inside
    another run's directory (one whose `config.yaml` sits beside its `run.json` or event
    log), where that run's cleanup at its next start would remove it."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise UserError(f"--run-dir: {path} is a file, not a directory")
    for parent in path.parents:
        if (parent / "config.yaml").is_file() and any(
            (parent / name).is_file() for name in ("run.json", "events.jsonl")
        ):
            raise UserError(
                f"--run-dir: {path} is inside the run directory {parent}; give a path outside it"
            )
