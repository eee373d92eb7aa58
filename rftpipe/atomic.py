"""Files that readers see whole or not at all, and their checksum records.

Every file is written under a temporary name (``TMP_PREFIX``), fsynced and renamed, and its
directory fsynced. A committed file is described by its size and xxh3-128 checksum (a
`ShardInfo` record, or a checkpoint's COMMITTED.json entry); the verify helpers raise
`CorruptionError` when a file disagrees with its record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from rftpipe.faults import fault
from rftpipe.space import writing

if TYPE_CHECKING:
    import pyarrow as pa

TMP_PREFIX = ".tmp-"


class CorruptionError(Exception):
    """A committed file disagrees with its manifest (missing, truncated or bad checksum)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why

    def __reduce__(self) -> tuple[type, tuple[Path, str]]:
        # DCP gathers every rank's failure to all ranks (pickled), so this must round-trip.
        return (CorruptionError, (self.path, self.why))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum_file(path: Path) -> str:
    """xxh3-128 of the file: an integrity check (not a security one) at ~15 GB/s, so
    verifying a multi-GB checkpoint costs a fraction of a second instead of seconds."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes, *, fault_mid: str | None = None) -> None:
    """Write `data` to `path` so that readers see either nothing or all of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with writing(path), _removed_on_error(tmp):
        with open(tmp, "wb") as f:
            if fault_mid:
                # Half the bytes reach the disk before an armed fault kills us.
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                fault(fault_mid)
                f.write(data[len(data) // 2 :])
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def _removed_on_error(tmp: Path) -> Iterator[None]:
    """A write that fails (a full disk) deletes its own temporary file, and only that."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, *, fault_mid: str | None = None) -> None:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, fault_mid=fault_mid)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo:
    """What a manifest records of one shard."""

    file: str
    rows: int
    bytes: int
    xxh3_128: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "bytes": self.bytes,
            "xxh3_128": self.xxh3_128,
        }


def write_parquet_atomic(path: Path, table: pa.Table, metadata: dict[str, str]) -> ShardInfo:
    """Write one Parquet shard atomically and return its checksum record."""
    # Imported here: `jobs.submit` on a login node reads this module, not Parquet (0.35 CPU s).
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    meta = dict(table.schema.metadata or {})
    meta.update({k.encode(): v.encode() for k, v in metadata.items()})
    with writing(path), _removed_on_error(tmp):
        pq.write_table(table.replace_schema_metadata(meta), tmp, compression="zstd")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    info = ShardInfo(
        file=path.name, rows=table.num_rows, bytes=tmp.stat().st_size, xxh3_128=checksum_file(tmp)
    )
    fault("shard_before_rename")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    fault("shard_after_rename")
    return info


def verify_shard(dir_: Path, info: dict[str, Any]) -> None:
    """Raise CorruptionError unless the shard matches its manifest entry."""
    verify_file(dir_ / info["file"], info)


def verify_file(path: Path, info: dict[str, Any]) -> None:
    """Raise CorruptionError unless `path` has the size and xxh3-128 that `info` records."""
    if not path.exists():
        raise CorruptionError(path, "listed in its manifest but missing")
    # The size first: a truncated file is refused without reading it.
    _check_record(path, path.stat().st_size, None, info)
    _check_record(path, info["bytes"], checksum_file(path), info)


def read_verified(path: Path, info: dict[str, Any]) -> bytes:
    """A small file's bytes, checked against its record before anyone deserializes them."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptionError(path, "listed in its manifest but missing") from None
    _check_record(path, len(data), xxhash.xxh3_128_hexdigest(data), info)
    return data


def _check_record(path: Path, size: int, digest: str | None, info: dict[str, Any]) -> None:
    if size != info["bytes"]:
        raise CorruptionError(path, f"size {size} != {info['bytes']} in the manifest (truncated?)")
    if digest is not None and digest != info["xxh3_128"]:
        raise CorruptionError(path, "checksum disagrees with the manifest")
