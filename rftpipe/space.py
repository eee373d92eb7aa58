"""A full file system or quota: told apart from every other failure, named in one line.

(The same for a run directory that became read-only or lost its write permission: the
machine, not the config, refuses the write.)

Run directories live on shared scratch with quotas. A write that finds no space (`ENOSPC`)
or no quota (`EDQUOT`) fails where it happens (Parquet, safetensors, DCP, json, the event
log), each library wrapping the OS error its own way. `no_space_in` finds it in an
exception's chain (or its text, where a library kept only that); `writing(path)` names the
file; the worker then ends with one line naming the path and the free bytes of its file
system, and exit status `EXIT_NO_SPACE`, "the machine, not the config". Nothing committed
is touched: every write goes to a temporary name first, and the next start removes those.

No torch here: `jobs.status` and the login node read it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The worker's exit status when the run stopped for lack of space or quota (sysexits'
#: EX_TEMPFAIL: once space is freed, the same command resumes).
EXIT_NO_SPACE = 75

_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
#: The errors that say the storage, not the space, refuses: reported only for a path the
#: run writes (a dataset it cannot read is the config's business).
REFUSED = frozenset({errno.EROFS, errno.EACCES})
# What libraries that keep only the message say (safetensors: "(os error 28)").
_TEXTS = {
    "No space left on device": errno.ENOSPC,
    "os error 28": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "os error 122": errno.EDQUOT,
}


class NoSpace(Exception):
    """A write found its file system full or its quota spent."""

    def __init__(
        self, path: Path, code: int, needed: int | None = None, collective: bool = False
    ) -> None:
        self.path = Path(path)
        self.code = code
        self.needed = needed
        self.collective = collective
        """Raised on every rank alike (a check they agreed on): the first rank reports it."""
        self.free = free_bytes(self.path)
        need = "" if needed is None else f", {human(needed)} needed"
        refused = code in REFUSED  # a refusal may come on a read too: "at", not "writing"
        verb = "at" if refused else "writing"
        advice = "make it writable" if refused else "free space (or raise the quota)"
        super().__init__(
            f"{_ERRNOS[code]} {verb} {self.path}: {human(self.free)} free on its file "
            f"system{need}; {advice} and run the same command to resume"
        )

    def __reduce__(self) -> tuple[type, tuple[Path, int, int | None, bool]]:
        # DCP gathers every rank's failure to all ranks (pickled), so this must round-trip.
        return (NoSpace, (self.path, self.code, self.needed, self.collective))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on `path`'s file system (of its nearest
    existing ancestor; 0 where even that cannot be asked)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def human(n: int) -> str:
    """`n` bytes, exactly and in binary units: "1234567 bytes (1.2 MiB)"."""
    if n < 1024:
        return f"{n} bytes"
    x, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while x >= 1024 and len(units) > 1:
        x, units = x / 1024, units[1:]
    return f"{n} bytes ({x:.1f} {units[0]})"


def no_space_in(exc: BaseException) -> NoSpace | tuple[int, str | None] | None:
    """The `NoSpace` in `exc`'s chain, else (errno, the file it names if any) of an error
    there that says the space ran out (ENOSPC or EDQUOT), else None."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, NoSpace):
            return e
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return e.errno, None if e.filename is None else str(e.filename)
        text = str(e)
        for said, code in _TEXTS.items():
            if said in text:
                return code, None
        stack += [e.__cause__, e.__context__, *_gathered(e)]
    return None


def _gathered(e: BaseException) -> list[BaseException]:
    # DCP's CheckpointException keeps each rank's failure in `failures`: rank -> (exc, tb).
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [f[0] for f in failures.values() if isinstance(f, tuple) and f]


@contextmanager
def writing(path: Path, needed: int | None = None) -> Iterator[None]:
    """Raise `NoSpace` naming `path` when what runs inside fails for lack of space."""
    try:
        quota_fault(path)
        yield
    except NoSpace:
        raise
    except BaseException as exc:
        named = named_no_space(exc, path, needed)
        if named is None:
            raise
        raise named from exc


def named_no_space(exc: BaseException, path: Path, needed: int | None = None) -> NoSpace | None:
    """`exc` as a `NoSpace` naming `path` (or the file inside it that the error names)
    where it says the space ran out, else None."""
    found = no_space_in(exc)
    if found is None:
        return None
    if isinstance(found, tuple) and found[1] and not Path(found[1]).is_relative_to(path):
        found = (found[0], None)  # a temporary sibling of `path`: name what it was for
    return as_no_space(found, path, needed)


def as_no_space(
    found: NoSpace | tuple[int, str | None], path: Path, needed: int | None = None
) -> NoSpace:
    """`no_space_in`'s finding as a `NoSpace`, naming `path` where the error named no file."""
    if isinstance(found, NoSpace):
        return found
    code, named = found
    return NoSpace(Path(named) if named else path, code, needed)


def quota_fault(path: Path) -> None:
    """Test aids, like `rftpipe.faults`, armed by the environment (outside tests each is one
    lookup):

    - ``RFTPIPE_FAULT_QUOTA=part[,part...]``: a write whose path contains one of the parts
      fails with the real `OSError(EDQUOT)`, as a spent quota makes it (no file system here
      can be given a quota without root);
    - ``RFTPIPE_FAULT_FULL=part[,...]`` with ``RFTPIPE_FAULT_FULL_BALLAST=FILE``: the first
      such write first fills its file system for real (FILE grows until the kernel says
      ENOSPC), then goes on and meets the full file system in whatever library writes it.
      Deleting FILE frees the space again.
    """
    armed = os.environ.get("RFTPIPE_FAULT_QUOTA")
    if armed and any(part in str(path) for part in armed.split(",")):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
    full = os.environ.get("RFTPIPE_FAULT_FULL")
    if full and not _filled and any(part in str(path) for part in full.split(",")):
        _fill(Path(os.environ["RFTPIPE_FAULT_FULL_BALLAST"]))


_filled: list[Path] = []


def _fill(ballast: Path) -> None:
    """Grow `ballast` until its file system has no byte left (halving the write each time
    the kernel refuses one, down to a byte)."""
    _filled.append(ballast)
    chunk = 1 << 20
    with open(ballast, "ab", buffering=0) as f:
        while chunk:
            try:
                f.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
