"""A small real file system for tests, without root: a size-limited tmpfs mounted in an
unprivileged user and mount namespace (`unshare --user --map-root-user --mount`).

The namespace lives as long as a sleeping process that holds it; commands run inside with
`nsenter`, so a run, its resume and `rftpipe inspect RUN verify` all see the same file
system, which can be filled to a chosen number of free bytes (a ballast file), grown in
place (`mount -o remount,size=`), made read-only, or emptied of its ballast. Outside the
namespace the mount point is an empty directory: `copy_out` brings a run directory back
for comparison.

Where user namespaces are not allowed, `SmallFS` raises `Unavailable` with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

BALLAST = ".ballast"


class Unavailable(RuntimeError):
    """This machine cannot make a small file system without root (the reason)."""


class SmallFS:
    """A tmpfs of `size` bytes at `mountpoint`, in a namespace of its own."""

    def __init__(self, mountpoint: Path, size: int) -> None:
        self.mountpoint = Path(mountpoint)
        self.size = size
        self._holder: subprocess.Popen | None = None
        self.warm: dict[str, str] = {}
        """The environment that makes a run a fork of a warm interpreter inside the
        namespace (tools/testing/zygote.py), where one was started (`tests/helpers.
        small_fs(warm=True)`); empty: new interpreters."""

    def __enter__(self) -> SmallFS:
        for tool in ("unshare", "nsenter", "mount"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} is not installed (util-linux)")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        script = (
            f"mount -t tmpfs -o size={self.size} rftpipe-small {self.mountpoint} "
            "&& echo mounted && exec sleep 86400"
        )
        self._holder = subprocess.Popen(
            [
                "unshare",
                "--user",
                "--map-root-user",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != "mounted":
            err = self._holder.communicate()[1].strip()
            raise Unavailable(f"unshare/mount failed: {err or 'no reason given'}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait()

    def run(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """`cmd` inside the namespace (as its root, which is this user outside)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self._entered(cmd, kwargs), **kwargs)

    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """`cmd` started inside the namespace, not waited for."""
        return subprocess.Popen(self._entered(cmd, kwargs), **kwargs)

    def _entered(self, cmd: list[str], kwargs: dict[str, Any]) -> list[str]:
        assert self._holder is not None
        # Entering the mount namespace starts at its root: the working directory is given.
        wd = kwargs.pop("cwd", os.getcwd())
        return ["nsenter", "-t", str(self._holder.pid), "--user", "--mount", f"--wd={wd}", *cmd]

    def python(self, code: str, *args: str) -> str:
        out = self.run([sys.executable, "-c", code, *args], check=False)
        if out.returncode:
            raise RuntimeError(f"in the small file system: {out.stderr.strip()[-2000:]}")
        return out.stdout

    def free(self) -> int:
        """Free bytes on it."""
        code = "import os,sys; s=os.statvfs(sys.argv[1]); print(s.f_bavail*s.f_frsize)"
        return int(self.python(code, str(self.mountpoint)))

    def fill(self, leave: int = 0) -> None:
        """Grow the ballast so that `leave` bytes stay free (none: a full file system)."""
        code = (
            "import os,sys; p,leave=sys.argv[1],int(sys.argv[2]); s=os.statvfs(os.path.dirname(p));"
            "n=s.f_bavail*s.f_frsize-leave; fd=os.open(p,os.O_WRONLY|os.O_CREAT|os.O_APPEND);"
            "n>0 and os.posix_fallocate(fd,os.fstat(fd).st_size,n); os.close(fd)"
        )
        self.python(code, str(self.mountpoint / BALLAST), str(leave))

    def empty_ballast(self) -> None:
        self.python("import os,sys; os.unlink(sys.argv[1])", str(self.mountpoint / BALLAST))

    def grow(self, size: int) -> None:
        out = self.run(["mount", "-o", f"remount,size={size}", str(self.mountpoint)])
        if out.returncode:
            raise RuntimeError(f"remount,size={size} failed: {out.stderr.strip()}")
        self.size = size

    def read_only(self, directory: Path, on: bool = True) -> None:
        """Make `directory` (inside it) read-only, or writable again: a read-only bind mount
        over it, so new writes fail with EROFS (a plain `remount,ro` is refused while a file
        is open for writing, as a run's lock file is)."""
        d = str(directory)
        steps = (
            [["mount", "--bind", d, d], ["mount", "-o", "remount,bind,ro", d]]
            if on
            else [["umount", d]]
        )
        for cmd in steps:
            out = self.run(cmd)
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")

    def copy_out(self, inside: Path, outside: Path) -> None:
        """Copy `inside` (a path under the mount point) to `outside`, beyond the namespace."""
        out = self.run(["cp", "-a", str(inside), str(outside)])
        if out.returncode:
            raise RuntimeError(f"cp {inside} {outside}: {out.stderr.strip()}")
        # Files made in the namespace belong to this user outside already; nothing to chown.
        assert os.path.exists(outside)


PLAIN_UID = 1000
"""The user id that `as_plain_user` runs a command as, inside its namespace."""


def as_plain_user(cmd: list[str]) -> list[str]:
    """`cmd` run by a user without root's power over file permissions, even where the tests
    run as root: this user becomes `PLAIN_UID` of a user namespace of its own, where it
    still owns its files but holds no capability (dropped at exec, as for any uid but 0),
    so a file whose write bit is off refuses it with EACCES. Where user namespaces are not
    allowed, raises `Unavailable`."""
    probe = subprocess.run(
        ["unshare", "--user", f"--map-user={PLAIN_UID}", f"--map-group={PLAIN_UID}", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode:
        raise Unavailable(f"unshare --user --map-user failed: {probe.stderr.strip()}")
    return ["unshare", "--user", f"--map-user={PLAIN_UID}", f"--map-group={PLAIN_UID}", *cmd]
