"""Checkpoint files written with O_DIRECT, checksummed as they are written.

Why: a background checkpoint of SmolLM2-135M with AdamW state is 1.6 GB. Written through
the page cache, the kernel's copy and writeback cost the rollout it overlaps about 6 s of
CPU on a 2-core VM (the rollout took twice as long); written with O_DIRECT through DCP it
cost ~2-2.7 s, and ~1 s with the writer thread at nice 19 (see `checkpoint.Writer`). Bytes
gather in a page-aligned buffer that goes to disk in whole chunks; only the unaligned tail
of a file takes the buffered path, and every file is fsynced at close.
Where the filesystem refuses O_DIRECT (tmpfs, some FUSE mounts) the file is written
buffered instead, with the same checksums and fsync.

The xxh3-128 digest of each file is taken from the bytes on their way to disk, so the
commit manifest needs no second read of a file the page cache no longer holds. Two buffers
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
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

CHUNK = 8 << 20
"""Bytes per O_DIRECT write: a multiple of any device's logical block size."""


class DirectFile(io.RawIOBase):
    """A sequential, write-only file (what DCP and torch.save need: write, tell, fileno)."""

    def __init__(self, path: Path, direct: bool = True) -> None:
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
        self._hash = xxhash.xxh3_128()
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
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])

    def digest(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._wait()
            if self._fill and self.error is None:
                if self.direct:  # the tail is not block-sized: finish it through the cache
                    mode = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, mode & ~os.O_DIRECT)
                self._write_all(self._view[: self._fill])
                self._fill = 0
            if self.error is None:
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

    def __init__(self, direct: bool = True) -> None:
        super().__init__()
        self.direct = direct
        self._lock = threading.Lock()  # DCP may write files from several threads
        self.written: dict[str, tuple[int, str]] = {}
        self.write_error: BaseException | None = None
        """The first write that failed in any file (e.g. disk full), for the caller to report
        instead of the zip-position error torch.save makes of it."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        f = DirectFile(Path(path), self.direct)
        try:
            yield f
        finally:
            try:
                f.close()
            finally:
                if f.error is not None:
                    with self._lock:
                        self.write_error = self.write_error or f.error
        with self._lock:
            self.written[str(Path(path).resolve())] = (f.tell(), f.digest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            info = self.written.pop(str(Path(path).resolve()), None)
            if info is not None:
                self.written[str(Path(new_path).resolve())] = info


def storage_writer(path: Path, direct: bool = True) -> tuple[FileSystemWriter, DirectFileSystem]:
    """A DCP writer for `path` that writes through `DirectFileSystem`, and that file system."""
    writer = FileSystemWriter(str(path), sync_files=False)  # DirectFile fsyncs at close
    fs = DirectFileSystem(direct)
    writer.fs = fs
    return writer, fs
