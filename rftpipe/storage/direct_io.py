"""Checkpoint files written with O_DIRECT, checksummed as they are written.

Why: a background checkpoint of SmolLM2-135M with AdamW state is 1.6 GB. Written through
the page cache, the kernel's copy and writeback cost the rollout it overlaps about 6 s of
CPU on a 2-core VM (the rollout took twice as long); written with O_DIRECT through DCP it
cost ~2-2.7 s, and ~1 s with the writer thread at nice 19 (see `checkpoint.Writer`). Bytes
gather in a page-aligned buffer that goes to disk in whole chunks; only the unaligned tail
of a file takes the buffered path, and every file is fsynced at close.
Where the filesystem refuses O_DIRECT (tmpfs, some FUSE mounts) the file is written
buffered instead, with the same checksums and fsync.

A rank stopped by Slurm must not be inside a long write when SIGKILL comes: a thread in a
write or fsync sleeps uninterruptibly (D state) until the I/O completes, and the process
lives on with it; Slurm drains a node whose job outlives its kill ("Kill task failed").
On a slow or throttled file system a buffered file's fsync waits for all of the file's
writeback (a 0.85 MB file took 20 s on a disk giving 64 KB/s, a rank outliving its
SIGKILL by as long). So each file goes to disk in O_DIRECT pieces sized to take about
`PIECE_S` at the speed the device gives, all but its last partial block (under 4 KiB)
which alone goes through the page cache; between pieces the writer checks whether its
checkpoint was abandoned (`Abandoned`), so a stop that cannot wait ends the write within
a piece.

The xxh3-128 digest of each file, and an xxh3-64 digest of each CHUNK-sized block of it, are
taken from the bytes on their way to disk, so the commit manifest needs no second read of a
file the page cache no longer holds. The block digests let a restart verify exactly the bytes
it loads, in the same pass (`VerifyingReader`), whatever share of a file a rank needs. Two buffers
alternate: while one chunk goes to disk on a helper thread (the write releases the GIL), the
serializer fills the other, so the disk time (~1 s for 1.6 GB here) hides behind the CPU time
of serializing and hashing instead of adding to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from rftpipe.atomic import CorruptionError
from rftpipe.faults import slow
from rftpipe.space import named_no_space, writing

CHUNK = 8 << 20
"""Bytes of the buffers that go to disk in turn; also the size of the blocks whose digests
the commit manifest records."""

ALIGN = 4096
"""O_DIRECT's alignment of lengths and offsets: a multiple of any device's logical block."""

PIECE_S = 0.25
"""Seconds one O_DIRECT write call should take: pieces double while faster than a fifth of
it and halve while slower, between `MIN_PIECE` and `CHUNK` bytes (64 KiB to 8 MiB is seven
doublings, a few milliseconds on a disk at 500 MB/s)."""

MIN_PIECE = 16 << 10
FIRST_PIECE = 64 << 10


class Abandoned(Exception):
    """The write was abandoned (a stop that could not wait for it) between two pieces."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FileDigest:
    """What a checkpoint's commit manifest records of one file."""

    bytes: int
    xxh3_128: str
    blocks_xxh3_64: tuple[str, ...] = ()
    """Per-CHUNK digests (empty for files not written through `DirectFile`)."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bytes": self.bytes, "xxh3_128": self.xxh3_128}
        if self.blocks_xxh3_64:
            out.update(block_bytes=CHUNK, blocks_xxh3_64=list(self.blocks_xxh3_64))
        return out


class DirectFile(io.RawIOBase):
    """A sequential, write-only file (what DCP and torch.save need: write, tell, fileno)."""

    def __init__(
        self, path: Path, direct: bool = True, abandon: threading.Event | None = None
    ) -> None:
        self._abandon = abandon or threading.Event()
        self._piece = FIRST_PIECE
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self.direct = False
            self._fd = os.open(path, flags, 0o644)
        # Anonymous maps are page-aligned, as O_DIRECT requires of the memory it reads.
        self._bufs = [mmap.mmap(-1, CHUNK) for _ in range(2)]
        self._views = [memoryview(b) for b in self._bufs]
        self._view = self._views[0]
        self._fill = 0
        self._pos = 0
        self._pos_written = 0
        self._hash = xxhash.xxh3_128()
        self.block_digests: list[str] = []
        """xxh3-64 of each CHUNK-sized block of the file, the short last one included."""
        # One writer thread keeps the chunks in file order; it inherits the caller's nice.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="rftpipe-direct-io")
        self._pending: Future | None = None
        self.error: BaseException | None = None
        """The first failed write; the file has a hole from then on and takes no more bytes.
        torch.save, writing through this file, reports it only as a garbled zip position
        ("unexpected pos"), so the caller reads it here."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def write(self, b) -> int:  # noqa: ANN001 (any buffer)
        if self.error is not None:
            raise self.error
        data = memoryview(b).cast("B")
        self._hash.update(data)
        off, n = 0, len(data)
        while off < n:
            k = min(CHUNK - self._fill, n - off)
            self._view[self._fill : self._fill + k] = data[off : off + k]
            self._fill += k
            off += k
            if self._fill == CHUNK:
                self._flush_chunk()
        self._pos += n
        return n

    def _flush_chunk(self) -> None:
        """Send the full buffer to disk in the background and continue in the other one."""
        self._wait()  # the other buffer's write, before it is refilled
        self.block_digests.append(xxhash.xxh3_64_hexdigest(self._view))
        self._pending = self._io.submit(self._write_all, self._view)
        self._view = self._views[1] if self._view is self._views[0] else self._views[0]
        self._fill = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            exc = pending.exception()
            if exc is not None:
                self.error = self.error or exc
                raise exc

    def _write_all(self, view: memoryview) -> None:
        """Write `view` in pieces of about `PIECE_S` each (whole, for a buffered file)."""
        done = 0
        while done < len(view):
            if self._abandon.is_set():
                raise Abandoned(f"abandoned after {self._pos_written + done} bytes")
            if not self.direct:
                done += os.write(self._fd, view[done:])
                continue
            piece = min(self._piece, len(view) - done)
            t0 = time.perf_counter()
            done += os.write(self._fd, view[done : done + piece])
            took = time.perf_counter() - t0
            if took > PIECE_S and self._piece > MIN_PIECE:
                self._piece //= 2
            elif took < PIECE_S / 5 and piece == self._piece and self._piece < CHUNK:
                self._piece *= 2
        self._pos_written += done

    def digest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._wait()
            if self._fill and self.error is None:
                self.block_digests.append(xxhash.xxh3_64_hexdigest(self._view[: self._fill]))
                aligned = self._fill - self._fill % ALIGN
                self._write_all(self._view[:aligned])
                if self.direct and aligned < self._fill:
                    # The last partial block cannot go O_DIRECT: finish it through the cache.
                    mode = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, mode & ~os.O_DIRECT)
                    self.direct = False
                self._write_all(self._view[aligned : self._fill])
                self._fill = 0
            if self.error is None:
                if self._abandon.is_set():
                    raise Abandoned("abandoned before its fsync")
                os.fsync(self._fd)
        except OSError as exc:
            self.error = self.error or exc
            raise
        finally:
            self._io.shutdown(wait=True)  # a write still in flight after an error
            os.close(self._fd)
            for view, buf in zip(self._views, self._bufs, strict=True):
                view.release()
                # A failed write's traceback may still hold a slice of the buffer; the map
                # is then freed with the last reference instead.
                with contextlib.suppress(BufferError):
                    buf.close()
            super().close()


class DirectFileSystem(FileSystem):
    """DCP's local file system with O_DIRECT writes; remembers each file's size and digest."""

    def __init__(self, direct: bool = True, abandon: threading.Event | None = None) -> None:
        super().__init__()
        self.direct = direct
        self.abandon = abandon
        self._lock = threading.Lock()  # DCP may write files from several threads
        self.written: dict[str, FileDigest] = {}
        self.write_error: BaseException | None = None
        """The first write that failed in any file (e.g. disk full), for the caller to report
        instead of the zip-position error torch.save makes of it."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        slow("checkpoint", sleep=self.abandon.wait if self.abandon else None)
        with writing(Path(path)):  # a file system full (or a quota spent) at its creation
            f = DirectFile(Path(path), self.direct, self.abandon)
        try:
            yield f
        finally:
            try:
                f.close()
            finally:
                if f.error is not None:
                    with self._lock:
                        # DCP passes every rank's failure on pickled, where an OSError's
                        # file name would not survive: a NoSpace keeps it.
                        named = named_no_space(f.error, Path(path))
                        self.write_error = self.write_error or named or f.error
        with self._lock:
            self.written[str(Path(path).resolve())] = FileDigest(
                bytes=f.tell(), xxh3_128=f.digest(), blocks_xxh3_64=tuple(f.block_digests)
            )

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            info = self.written.pop(str(Path(path).resolve()), None)
            if info is not None:
                self.written[str(Path(new_path).resolve())] = info


def storage_writer(
    path: Path, direct: bool = True, abandon: threading.Event | None = None
) -> tuple[FileSystemWriter, DirectFileSystem]:
    """A DCP writer for `path` that writes through `DirectFileSystem`, and that file system;
    setting `abandon` makes its writes raise `Abandoned` at their next piece."""
    writer = FileSystemWriter(str(path), sync_files=False)  # DirectFile fsyncs at close
    fs = DirectFileSystem(direct, abandon)
    writer.fs = fs
    return writer, fs


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks every block it reads against the commit manifest.

    Why: a restart must not load a damaged checkpoint, and a separate checksum pass reads
    the whole checkpoint twice (the page cache of a fresh node holds none of it). Each rank
    reads the blocks that hold its items, in file order, verifies each block's digest the
    first time it reads it, and deserializes its items from those bytes. A file's blocks that
    no item of this rank touches are never read (another rank's share of a resharded load).
    Raises `CorruptionError` naming the file on the first bad block, a size mismatch or a
    file the manifest does not list.

    Non-tensor items (optimizer hyper-parameters) are loaded with ``weights_only=True``,
    unlike DCP's default planner, which unpickles them without restriction.
    """

    def __init__(self, path: Path, files: dict[str, dict[str, Any]]) -> None:
        super().__init__(str(path))
        self.files = files

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[tuple[Any, ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise CorruptionError(Path(self.path) / info.relative_path, "unknown transform")
            per_file.setdefault(info.relative_path, []).append((info, item))
        for name, items in per_file.items():
            items.sort(key=lambda x: x[0].offset)
            with _BlockFile(Path(self.path) / name, self.files.get(name)) as f:
                for info, item in items:
                    blob = f.read(info.offset, info.length)
                    if item.type == LoadItemType.BYTE_IO:
                        _load_bytes(planner, item, blob)
                    else:
                        _load_tensor(planner, item, blob)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut


class _BlockFile:
    """Reads byte ranges of one checkpoint file in offset order, verifying each CHUNK block
    once. The blocks last read stay in a buffer, so the many small items that share a block
    (norms, biases, optimizer scalars) cost one read and one digest of it, not one each."""

    def __init__(self, path: Path, record: dict[str, Any] | None) -> None:
        if record is None or "blocks_xxh3_64" not in record:
            raise CorruptionError(path, "not listed with block digests in COMMITTED.json")
        self.path = path
        self.size = int(record["bytes"])
        self.block = int(record["block_bytes"])
        self.digests: list[str] = record["blocks_xxh3_64"]
        self._f: io.FileIO | None = None
        self._buf = bytearray(self.block)
        self._first = 0  # blocks [_first, _end) are in _buf, verified
        self._end = 0

    def __enter__(self) -> _BlockFile:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise CorruptionError(self.path, "listed in COMMITTED.json but missing") from None
        if size != self.size:
            raise CorruptionError(self.path, f"size {size} != {self.size} in COMMITTED.json")
        self._f = open(self.path, "rb", buffering=0)  # noqa: SIM115 (closed in __exit__)
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()

    def read(self, offset: int, length: int) -> memoryview:
        """Bytes [offset, offset + length), verified; valid until the next call."""
        first, end = offset // self.block, (offset + max(length, 1) - 1) // self.block + 1
        if not (self._first <= first and end <= self._end):
            self._load(first, end)
        lo = offset - self._first * self.block
        return memoryview(self._buf)[lo : lo + length]

    def _load(self, first: int, end: int) -> None:
        """Make blocks [first, end) the buffer's window, reading only those not held."""
        assert self._f is not None
        keep = max(0, self._end - first) if self._first <= first < self._end else 0
        need = (end - first) * self.block
        if need > len(self._buf):
            grown = bytearray(need)
            grown[: keep * self.block] = self._buf[(first - self._first) * self.block :][
                : keep * self.block
            ]
            self._buf = grown
        elif keep:
            src = (first - self._first) * self.block
            self._buf[: keep * self.block] = self._buf[src : src + keep * self.block]
        view = memoryview(self._buf)
        start = (first + keep) * self.block
        stop = min(end * self.block, self.size)
        self._f.seek(start)
        got = start
        while got < stop:
            n = self._f.readinto(view[got - first * self.block : stop - first * self.block])
            if not n:
                raise CorruptionError(self.path, "file ended early")
            got += n
        for b in range(first + keep, end):
            lo = (b - first) * self.block
            hi = min(lo + self.block, self.size - first * self.block)
            if xxhash.xxh3_64_hexdigest(view[lo:hi]) != self.digests[b]:
                raise CorruptionError(self.path, f"block {b} disagrees with COMMITTED.json")
        self._first, self._end = first, end


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview: torch.load reads the verified bytes
    where they are (io.BytesIO would copy them first)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + pos
        return self._pos

    def readinto(self, b) -> int:  # noqa: ANN001 (any writable buffer)
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _load_tensor(planner: LoadPlanner, item: ReadItem, blob: memoryview) -> None:
    # torch.load reads any seekable binary file object; its `FileLike` names only IO[bytes].
    tensor = torch.load(_MemoryFile(blob), map_location="cpu", weights_only=True)  # type: ignore[arg-type]
    # The part of the stored chunk this item asks for (a resharded load asks for less).
    for dim, (off, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        if n < tensor.size(dim):
            tensor = tensor.narrow(dim, off, n)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise RuntimeError(f"{item.storage_index}: size {tensor.size()} != {target.size()}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


def _load_bytes(planner: LoadPlanner, item: ReadItem, blob: memoryview) -> None:
    # What DefaultLoadPlanner.load_bytes does, minus its unrestricted unpickling.
    value = torch.load(_MemoryFile(blob), weights_only=True)  # type: ignore[arg-type]  # as above
    fqn = item.dest_index.fqn
    if isinstance(planner, DefaultLoadPlanner) and planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    elif isinstance(planner, DefaultLoadPlanner):
        planner.state_dict[fqn] = value
    else:
        planner.load_bytes(item, io.BytesIO(blob))
