"""The run's content-addressed image store: each distinct image once, under
``images/<first two hex digits>/<sha256>.<ext>``, however many prompts, samples or steps
show it; trajectory rows hold the relative path (`ImageRef.relpath`).

A file is written under a temporary name, fsynced, renamed and its directory fsynced
(`atomic_write_bytes`), so a stage that references an image commits only after the image
is durable. The name is the checksum: `verify_images` rehashes every file against it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from rftpipe.storage.atomic import TMP_PREFIX, CorruptionError, atomic_write_bytes

IMAGES_DIR = "images"
"""The store's folder under the run directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageRef:
    """A stored image, as a trajectory row references it."""

    sha256: str
    ext: str
    """The file's format suffix without the dot (``png``, ``jpeg``)."""

    @property
    def relpath(self) -> str:
        """The path under the run directory, e.g. ``images/ab/ab12….png``."""
        return f"{IMAGES_DIR}/{self.sha256[:2]}/{self.sha256}.{self.ext}"


class ImageStore:
    """The image store of the run directory `run_root`.

    Usage::

        store = ImageStore(run.root)
        ref = store.put(png_bytes, "png")  # writes once; the same bytes again write nothing
        store.path(ref).read_bytes() == png_bytes
        verify_images(run.root)  # [] when every file matches its name
    """

    def __init__(self, run_root: Path) -> None:
        self.root = Path(run_root) / IMAGES_DIR

    def path(self, ref: ImageRef) -> Path:
        return self.root.parent / ref.relpath

    def put(self, data: bytes, ext: str) -> ImageRef:
        """Store `data` (an encoded image file) unless the same bytes are there already."""
        ref = ImageRef(sha256=hashlib.sha256(data).hexdigest(), ext=ext.lower().lstrip("."))
        path = self.path(ref)
        # A file under its final name was renamed there whole after an fsync, so its
        # existence with the right size is proof enough; `verify_images` rehashes.
        if path.exists() and path.stat().st_size == len(data):
            return ref
        atomic_write_bytes(path, data)
        return ref


def verify_images(run_root: Path) -> list[CorruptionError]:
    """Every stored image whose bytes no longer hash to its name (empty: all sound)."""
    root = Path(run_root) / IMAGES_DIR
    bad: list[CorruptionError] = []
    if not root.is_dir():
        return bad
    for sub in sorted(root.iterdir()):
        for f in sorted(sub.iterdir()) if sub.is_dir() else ():
            if f.name.startswith(TMP_PREFIX):
                continue  # a write that died before its rename: never referenced
            want = f.name.partition(".")[0]
            got = hashlib.sha256(f.read_bytes()).hexdigest()
            if got != want or sub.name != want[:2]:
                bad.append(CorruptionError(f, "image bytes disagree with their sha256 name"))
    return bad


def remove_stray_tmp(run_root: Path) -> int:
    """Delete temporary files left by writes that died mid-way; returns how many."""
    root = Path(run_root) / IMAGES_DIR
    n = 0
    for f in root.glob(f"*/{TMP_PREFIX}*") if root.is_dir() else ():
        os.unlink(f)
        n += 1
    return n
