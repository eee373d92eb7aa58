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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from rftpipe.atomic import TMP_PREFIX, CorruptionError, atomic_write_bytes, fsync_dir
from rftpipe.space import writing
from rftpipe.storage.layout import IMAGES_COLUMN

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

    @classmethod
    def parse(cls, relpath: str) -> ImageRef:
        """The reference a trajectory row's `images` entry names (a `relpath`)."""
        top, _, rest = relpath.partition("/")
        _, _, name = rest.partition("/")
        sha, _, ext = name.partition(".")
        # Exactly a store path: a row naming anything else must not read outside the store.
        hexdigits = set("0123456789abcdef")
        ok = len(sha) == 64 and set(sha) <= hexdigits and ext.isalnum() and ext.isascii()
        if top != IMAGES_DIR or not ok or relpath != cls(sha256=sha, ext=ext).relpath:
            raise ValueError(f"not an image store path: {relpath!r}")
        return cls(sha256=sha, ext=ext)


def image_ref(data: bytes, ext: str) -> ImageRef:
    """The reference of an image file's bytes (where the store keeps it)."""
    return ImageRef(sha256=hashlib.sha256(data).hexdigest(), ext=ext.lower().lstrip("."))


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
        ref = image_ref(data, ext)
        path = self.path(ref)
        # A file under its final name was renamed there whole after an fsync, so its
        # existence with the right size is proof enough; `verify_images` rehashes.
        if path.exists() and path.stat().st_size == len(data):
            return ref
        atomic_write_bytes(path, data)
        return ref


@dataclass(frozen=True, kw_only=True, slots=True)
class MissingImage:
    """An image that committed rows reference and the store lacks."""

    ref: ImageRef
    path: Path
    """Where the store should hold it."""
    step: int
    stage: str
    """The first committed stage found referencing it (of `step`)."""


def shard_image_paths(shard: Path) -> list[str]:
    """The distinct `images` entries of a Parquet shard's rows (none without the column)."""
    if IMAGES_COLUMN not in pq.read_schema(shard).names:
        return []
    column = pq.read_table(shard, columns=[IMAGES_COLUMN]).column(IMAGES_COLUMN)
    return sorted(set(pc.list_flatten(column).to_pylist()))


def missing_images(run_root: Path, shards: Iterable[tuple[int, str, Path]]) -> list[MissingImage]:
    """Every image that the rows of `shards` ((step, stage, shard file), in the order
    given) reference and the store lacks, once each, with the first (step, stage) found."""
    store = ImageStore(run_root)
    seen: set[str] = set()
    out = []
    for step, stage, shard in shards:
        for rel in shard_image_paths(shard):
            if rel in seen:
                continue
            seen.add(rel)
            ref = ImageRef.parse(rel)
            if not store.path(ref).exists():
                out.append(MissingImage(ref=ref, path=store.path(ref), step=step, stage=stage))
    return out


def stored_images(run_root: Path) -> list[Path]:
    """Every image file of the run's store (temporary files of unfinished writes aside:
    a write that died before its rename was never referenced)."""
    root = Path(run_root) / IMAGES_DIR
    if not root.is_dir():
        return []
    return sorted(f for f in root.glob("*/*") if not f.name.startswith(TMP_PREFIX))


def image_corruption(path: Path) -> CorruptionError | None:
    """The error of a stored image whose bytes no longer hash to its name, else None."""
    want = path.name.partition(".")[0]
    if hashlib.sha256(path.read_bytes()).hexdigest() != want or path.parent.name != want[:2]:
        return CorruptionError(path, "image bytes disagree with their sha256 name")
    return None


def verify_images(run_root: Path) -> list[CorruptionError]:
    """Every stored image whose bytes no longer hash to its name (empty: all sound)."""
    return [e for f in stored_images(run_root) if (e := image_corruption(f)) is not None]


def quarantine_corrupt_images(run_root: Path, quarantine: Path) -> list[Path]:
    """The repair path: move every corrupt image (and every temporary file of a write
    that died) out of the store into `quarantine`, and return the moved images' old
    paths. The next `ImageStore.put` of the same image writes it afresh, as the prompts
    that reference it still hold its bytes in their dataset."""
    root = Path(run_root) / IMAGES_DIR
    for tmp in root.glob(f"*/{TMP_PREFIX}*") if root.is_dir() else ():
        os.unlink(tmp)
    moved = [e.path for e in verify_images(run_root)]
    if moved:
        with writing(quarantine):  # its directory is all the space it takes
            quarantine.mkdir(parents=True, exist_ok=True)
    for path in moved:
        os.replace(path, quarantine / path.name)
        fsync_dir(path.parent)
    if moved:
        fsync_dir(quarantine)
    return moved
