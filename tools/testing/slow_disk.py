"""A slow disk for tests: the block writes of chosen processes throttled to a few hundred
KB/s by the kernel (a cgroup v1 ``blkio.throttle.write_bps_device``, or cgroup v2
``io.max``), as on a shared file system under load.

Throttled writes are real: a thread writing (or fsyncing) sleeps uninterruptibly in the
kernel (D state) until its bios pass, so a process SIGKILLed then lives on, exactly as a
rank on a saturated Lustre or NFS does. A watcher thread moves every process that
`wanted(pid)` selects into the cgroup as soon as it appears (their threads and children
follow). Needs root; where it cannot be made, `SlowDisk` raises `Unavailable`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

V1 = Path("/sys/fs/cgroup/blkio")
V2 = Path("/sys/fs/cgroup/unified")


class Unavailable(RuntimeError):
    """This machine cannot throttle a process's block writes (the reason)."""


def _disk_of(path: Path) -> str:
    """'MAJOR:MINOR' of the whole disk holding `path` (throttling takes disks, not partitions)."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dev.exists():
        raise Unavailable(f"{path} is not on a block device")
    if (sys_dev / "partition").exists():
        return (sys_dev.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def _controllers(root: Path) -> set[str]:
    try:
        return set((root / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def job_processes(job_id: str) -> Callable[[int], bool]:
    """Selects the processes of Slurm job `job_id` (its environment says so)."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()

    def wanted(pid: int) -> bool:
        with contextlib.suppress(OSError):
            return needle in Path(f"/proc/{pid}/environ").read_bytes()
        return False

    return wanted


class SlowDisk:
    """Writes to the disk of `path` by the processes `wanted` selects, at `bps` bytes/s."""

    def __init__(self, path: Path, bps: int, name: str = "rftpipe-slow-disk") -> None:
        if os.geteuid() != 0:
            raise Unavailable("throttling block writes needs root")
        self.disk = _disk_of(Path(path))
        self.bps = bps
        if (V1 / "blkio.throttle.write_bps_device").exists():
            self.group = V1 / name
            self._limit = ("blkio.throttle.write_bps_device", f"{self.disk} {bps}")
        elif _controllers(V2) >= {"io"}:
            self.group = V2 / name
            self._limit = ("io.max", f"{self.disk} wbps={bps}")
        else:
            raise Unavailable("no blkio (cgroup v1) or io (cgroup v2) controller is mounted")
        self._wanted: list[Callable[[int], bool]] = []
        self._moved: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="slow-disk", daemon=True)

    def __enter__(self) -> SlowDisk:
        try:
            self.group.mkdir(exist_ok=True)
            (self.group / self._limit[0]).write_text(self._limit[1] + "\n")
        except OSError as exc:
            raise Unavailable(f"cannot make {self.group}: {exc}") from exc
        self._thread.start()
        return self

    def add(self, wanted: Callable[[int], bool]) -> None:
        """Throttle, from now on, every process `wanted` selects."""
        self._wanted.append(wanted)

    @property
    def moved(self) -> set[int]:
        return set(self._moved)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) in self._moved:
                    continue
                pid = int(entry.name)
                if any(w(pid) for w in list(self._wanted)):
                    with contextlib.suppress(OSError):  # it may have ended meanwhile
                        (self.group / "cgroup.procs").write_text(str(pid))
                        self._moved.add(pid)
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        # Whatever still runs goes back to the root group; the group is removed when empty.
        with contextlib.suppress(OSError):
            for pid in (self.group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.group.parent / "cgroup.procs").write_text(pid)
        for _ in range(50):
            try:
                self.group.rmdir()
                return
            except OSError:
                time.sleep(0.1)
