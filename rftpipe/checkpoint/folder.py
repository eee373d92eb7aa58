"""The checkpoints folder without torch: which checkpoints committed, which of their files
disagree with the commit marker, and a page-cache prefetch of the newest one.

Torch-free so that a worker can start the prefetch before it imports torch, and
`rftpipe inspect` can verify a run on a login node; writing and loading checkpoints is
`rftpipe.checkpoint.writer`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from rftpipe.atomic import CorruptionError, read_json, verify_file
from rftpipe.storage.layout import list_steps, step_name

CHECKPOINT_COMMIT_FILE = "COMMITTED.json"
"""A checkpoint directory's commit marker: every file with its size and checksum."""


def checkpoint_corruption(folder: Path) -> Iterator[CorruptionError]:
    """Every file of a committed checkpoint that disagrees with its COMMITTED.json, each
    checked in full (a restart instead verifies what it loads as it loads it)."""
    for name, info in read_json(folder / CHECKPOINT_COMMIT_FILE)["files"].items():
        try:
            verify_file(folder / name, info)
        except CorruptionError as exc:
            yield exc


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the committed checkpoints under `root`, oldest first."""
    out = [(s, root / step_name(s)) for s in list_steps(root)]
    return [(s, p) for s, p in out if (p / CHECKPOINT_COMMIT_FILE).exists()]


def prefetch_newest_checkpoint(root: Path) -> threading.Thread | None:
    """Read the newest committed checkpoint into the page cache on a daemon thread, and
    return that thread (None when there is no checkpoint).

    Why: a restart after a preemption usually lands on a node whose page cache holds none
    of the checkpoint, and until the model is built (imports, tokenizer, data: seconds of
    CPU) the disk is idle. Started first thing, the read runs during that start-up, and the
    load that verifies and deserializes the checkpoint then reads from memory.
    """
    done = committed_checkpoints(root)
    if not done:
        return None

    def read(folder: Path) -> None:
        # A plain sequential read: posix_fadvise(WILLNEED) was measured to be a no-op on
        # this class of VM. The read releases the GIL, so start-up goes on meanwhile.
        buf = bytearray(8 << 20)
        for f in sorted(folder.iterdir()):
            try:
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass
            except OSError:
                continue  # vanished (retention) or unreadable: the load will say so

    t = threading.Thread(target=read, args=(done[-1][1],), name="rftpipe-prefetch", daemon=True)
    t.start()
    return t
