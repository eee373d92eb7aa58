"""Checkpoints through torch.distributed.checkpoint, committed by a directory rename.

``checkpoints/step=N/`` holds DCP files for every tensor state (model, optimizer),
``extra-rK.pt`` with the small Stateful pieces (LR scheduler, KL controller), and
``COMMITTED.json`` listing every file's size and checksum, plus block checksums of the DCP
data files. The directory is written as ``.tmp-step=N`` and renamed when complete, so a
listing never sees a half-written checkpoint. Old ones are deleted only after a newer one has
committed, and the list is rebuilt from disk at every start.

State goes through one interface: every part is a Stateful (``state_dict`` /
``load_state_dict``). Values that hold tensors are written by DCP (sharded, resharded on
load); the rest must be plain, world-size independent data and goes into the extras, read
back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as tdist

from rftpipe.atomic import (
    TMP_PREFIX,
    CorruptionError,
    atomic_write_json,
    checksum_file,
    fsync_dir,
    read_json,
    read_verified,
    verify_file,
)
from rftpipe.checkpoint.folder import CHECKPOINT_COMMIT_FILE as COMMIT_FILE
from rftpipe.checkpoint.folder import checkpoint_corruption, committed_checkpoints
from rftpipe.dist import Dist
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.space import writing
from rftpipe.storage import direct_io
from rftpipe.storage.layout import step_name

log = logging.getLogger(__name__)
E = TypeVar("E", bound=BaseException)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpoint:
    step: int
    path: Path


def list_committed(root: Path) -> list[Checkpoint]:
    """Committed checkpoints, oldest first (only complete, renamed directories count)."""
    return [Checkpoint(step=s, path=p) for s, p in committed_checkpoints(root)]


def verify(ckpt: Checkpoint) -> None:
    """Check every file of a checkpoint in full (for `rftpipe inspect RUN verify`; a restart
    verifies what it loads while loading it instead, see `load`)."""
    for exc in checkpoint_corruption(ckpt.path):
        raise exc


def _split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values holding tensors, for DCP; plain values, for the extras)."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for k, v in state.items():
        (tensors if _has_tensor(v) else plain)[k] = v
    return tensors, plain


def _has_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_has_tensor(x) for x in v)
    return False


class Writer:
    """Writes checkpoints in the background, one at a time.

    Only the train stage changes the weights, so the checkpoint taken after step N's sync is
    written while step N+1 rolls out, scores and computes advantages; `wait()` runs before
    the next train stage and before the process ends, so a write never sees a half-updated
    model. A kill mid-write leaves only a temp directory, which resume discards, so the
    previous checkpoint stays the newest committed one. Multi-rank writes run their DCP
    collectives on a process group of their own, never interleaved with the main thread's.
    """

    def __init__(self, dist: Dist, direct_io: bool = True, group: Any = None) -> None:
        self.dist = dist
        self.direct_io = direct_io
        # Made on first use over the whole job unless given: the training ranks' own when
        # other ranks only generate (`rftpipe.run.placement`), who never join it.
        self._group: Any = group
        self.given_group: Any = group
        """The process group the caller gave (None: none given)."""
        self._thread: threading.Thread | None = None
        self._abandon = threading.Event()
        self._step = 0
        self._error: BaseException | None = None
        self._then: Callable[[], None] | None = None
        self._what = "checkpoint write"
        self.last_wait_s = 0.0
        """Seconds the last `wait()` blocked (the checkpoint's cost to the next train stage)."""

    def submit(self, root: Path, step: int, parts: dict[str, Stateful], keep_last: int) -> float:
        """Start writing checkpoint `step` of the named Statefuls; returns the seconds the
        caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        dist = self.dist
        tmp = root / f"{TMP_PREFIX}{step_name(step)}"
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        tensors: dict[str, Any] = {}
        extras: dict[str, Any] = {"step": step}
        for name, part in parts.items():
            t, plain = _split(part.state_dict())
            tensors.update({f"{name}.{k}": v for k, v in t.items()})
            extras[name] = plain
        with writing(tmp / f"extra-r{dist.rank}.pt"):
            torch.save(extras, tmp / f"extra-r{dist.rank}.pt")
        if tdist.is_initialized() and self._group is None:
            self._group = tdist.new_group(backend="gloo")
        dist.barrier()  # every rank's extras exist before rank 0 can commit
        self._abandon.clear()
        self._step = step
        self._thread = threading.Thread(
            target=self._write,
            args=(root, step, tmp, tensors, keep_last),
            name=f"rftpipe-checkpoint-{step}",
            daemon=True,  # an abandoned write leaves a temp dir, never a false commit
        )
        self._thread.start()
        return time.perf_counter() - t0

    def run_later(self, work: Callable[[Any], None], then: Callable[[], None], what: str) -> None:
        """Run `work(process_group)` in the background slot (a restart's deferred load);
        `wait()` joins it and then calls `then()` on the caller's thread."""
        self.wait()
        if tdist.is_initialized() and self._group is None:
            self._group = tdist.new_group(backend="gloo")

        def run() -> None:
            try:
                _bind_device(self.dist)
                work(self._group)
            except BaseException as exc:  # surfaced by wait() in the main thread
                self._error = exc

        self._then, self._what = then, what
        self._thread = threading.Thread(target=run, name="rftpipe-deferred-load", daemon=True)
        self._thread.start()

    def wait(self, until: float | None = None) -> float:
        """Block until the pending background work (if any) has finished; re-raise its
        failure (a `CorruptionError` as itself, anything else as a RuntimeError).

        With `until` (a Unix time: when Slurm will kill this job), a checkpoint still
        writing then is abandoned instead: its writes stop at their next piece, it never
        commits, its temporary directory is removed by the next start, and the previous
        checkpoint stays the newest. A rank inside a write when SIGKILL comes would outlive
        the kill until the write returned (`rftpipe.storage.direct_io`)."""
        self.last_wait_s = 0.0
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        if until is not None:
            self._thread.join(max(0.0, until - time.time()))
            if self._thread.is_alive():
                self._abandon_write(t0)
                return self.last_wait_s
        self._thread.join()
        self._thread = None
        then, what = self._then, self._what
        self._then, self._what = None, "checkpoint write"
        self.last_wait_s = time.perf_counter() - t0
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CorruptionError):
                raise err
            raise RuntimeError(f"{what} failed: {err}") from err
        if then is not None:
            then()
        return self.last_wait_s

    def _abandon_write(self, t0: float) -> None:
        """Stop the running write at its next piece and wait (briefly) for its thread."""
        assert self._thread is not None
        self._abandon.set()
        self._thread.join(ABANDON_JOIN_S)
        self.last_wait_s = time.perf_counter() - t0
        alive, error = self._thread.is_alive(), self._error
        self._thread, self._error, self._then = None, None, None
        if not alive and error is None:  # it finished within the last piece
            return
        failed = error is not None and _behind(error, direct_io.Abandoned) is None
        log.warning(
            "checkpoint %d abandoned: the job ends before it could be written%s",
            self._step,
            f" (it had failed: {error})" if failed else "",
        )
        if self.dist.is_main:
            events().write("checkpoint_abandoned", step=self._step, waited_s=self.last_wait_s)

    def _write(
        self, root: Path, step: int, tmp: Path, state: dict[str, Any], keep_last: int
    ) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            # Lowest CPU priority for this thread alone: the rollout it overlaps keeps the
            # cores, the write soaks up their idle moments, and whatever is left runs at full
            # speed while the next train stage waits for it.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            _bind_device(self.dist)
            writer, fs = direct_io.storage_writer(tmp, self.direct_io, self._abandon)
            with writing(tmp):  # a full disk names the checkpoint, or its file
                try:
                    # Returns on rank 0 only after every rank's files are written and synced.
                    dcp.save(state, storage_writer=writer, process_group=self._group)
                except BaseException as exc:  # DCP's CheckpointException is a BaseException
                    if fs.write_error is None:
                        raise
                    raise fs.write_error from exc  # "No space left on device", not an offset
            # Each rank's digests of the files it wrote, so rank 0 never reads them back.
            digests = {Path(k).name: v.as_dict() for k, v in fs.written.items()}
            atomic_write_json(tmp / f"digests-r{self.dist.rank}.json", digests)
            if self._group is not None:
                tdist.barrier(group=self._group)
            fault("ckpt_mid_write")
            if self.dist.is_main and not self._abandon.is_set():
                _commit(root, step, tmp, self.dist.world, keep_last)
        except BaseException as exc:  # surfaced by wait() in the main thread
            self._error = exc


def _bind_device(dist: Dist) -> None:
    """Make this rank's GPU the current device of a background thread (a new thread starts
    on cuda:0, and DCP stages its device-to-host copies on the current device's stream)."""
    if dist.device.type == "cuda":
        torch.cuda.set_device(dist.device)


def _commit(root: Path, step: int, tmp: Path, world: int, keep_last: int) -> None:
    """List every file with its digest: the DCP files from the writers' own digests, the
    small rest (extras, digest records) read back here."""
    files: dict[str, Any] = {}
    for r in range(world):
        files.update(read_json(tmp / f"digests-r{r}.json"))
    for f in sorted(tmp.iterdir()):
        if f.name in files:
            continue
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[f.name] = {"bytes": f.stat().st_size, "xxh3_128": checksum_file(f)}
    atomic_write_json(tmp / COMMIT_FILE, {"step": step, "world_size": world, "files": files})
    fault("ckpt_before_rename")
    os.replace(tmp, root / step_name(step))
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


ABANDON_JOIN_S = 1.0
"""Seconds an abandoned write gets to reach the end of its piece (one takes about
`direct_io.PIECE_S`); a thread still in the kernel after that is left to the process exit."""


LATE_KEYS = frozenset({"optim"})
"""State entries a restart needs only at its first train step (the optimizer's moments, two
thirds of a checkpoint): with a `Writer` given, `load` reads them in the background while
the first rollout runs, and the writer's `wait()`, which every train stage calls first,
applies them."""


def load(ckpt: Checkpoint, parts: dict[str, Stateful], later: Writer | None = None) -> None:
    """Restore the named Statefuls in place (resharding to this world size).

    Each file is verified as it is read, never in a pass of its own: the small ones
    (DCP's metadata, which DCP unpickles, and the extras) before they are deserialized, the
    DCP data block by block (`direct_io.VerifyingReader`). On `CorruptionError` the parts
    may hold a mix of old and loaded state: the caller loads an older checkpoint or rebuilds.
    With `later`, the `LATE_KEYS` entries load in its background slot instead (see there).
    """
    files = read_json(ckpt.path / COMMIT_FILE)["files"]
    for name in (".metadata", "extra-r0.pt"):
        if name not in files:
            raise CorruptionError(ckpt.path / name, "not listed in COMMITTED.json")
    verify_file(ckpt.path / ".metadata", files[".metadata"])
    extras_bytes = read_verified(ckpt.path / "extra-r0.pt", files["extra-r0.pt"])
    # Rank-local extras hold only world-independent state, so rank 0's serves any world size.
    extras = torch.load(io.BytesIO(extras_bytes), weights_only=True)
    now: dict[str, dict[str, Any]] = {}
    late: dict[str, dict[str, Any]] = {}
    for name, part in parts.items():
        tensors, _ = _split(part.state_dict())
        now[name] = {k: v for k, v in tensors.items() if later is None or k not in LATE_KEYS}
        late[name] = {k: v for k, v in tensors.items() if later is not None and k in LATE_KEYS}
    # The writer's group where it was given one (the training ranks of a job whose other
    # ranks only generate: they load nothing); else the whole job.
    _dcp_load(ckpt, files, now, later.given_group if later is not None else None)
    for name, part in parts.items():
        part.load_state_dict({**now[name], **extras[name]})
    if later is not None and any(late.values()):

        def apply() -> None:
            for name, part in parts.items():
                if late[name]:
                    part.load_state_dict(late[name])

        later.run_later(partial(_dcp_load, ckpt, files, late), apply, f"checkpoint {ckpt.path}")


def _dcp_load(
    ckpt: Checkpoint, files: dict[str, Any], states: dict[str, dict[str, Any]], group: Any
) -> None:
    import torch.distributed.checkpoint as dcp

    flat = {f"{name}.{k}": v for name, st in states.items() for k, v in st.items()}
    try:
        dcp.load(
            flat,
            storage_reader=direct_io.VerifyingReader(ckpt.path, files),
            process_group=group,
        )
    except BaseException as exc:  # DCP wraps every rank's failure in a CheckpointException
        corrupt = _behind(exc, CorruptionError)
        if corrupt is None:
            raise
        raise corrupt from exc


def _behind(exc: BaseException, kind: type[E]) -> E | None:
    """The `kind` error behind a DCP failure (on this rank or, collectively, another)."""
    if isinstance(exc, kind):
        return exc
    # CheckpointException.failures: rank -> (exception, traceback summary).
    for failure, _tb in getattr(exc, "failures", {}).values():
        found = _behind(failure, kind)
        if found is not None:
            return found
    if exc.__cause__ is not None:
        return _behind(exc.__cause__, kind)
    return None
