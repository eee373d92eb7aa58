"""Worker processes that run user code under a hard timeout: reward functions
(`rftpipe.rewards.pool`) and environments (`rftpipe.envs.pool`).

A call that outlives its timeout cannot be stopped from inside Python (`signal.alarm` works
only in the main thread and not while C code holds the GIL; a thread cannot be killed), so
user code runs in a plain ``python -m`` subprocess that is SIGKILLed on timeout. It imports
only the user's module, never the run's ``__main__`` (torch), its pid is ours to kill, and
it dies with the run. `WorkerProcess` is the parent's side; `serve_frames` and
`die_with_parent` the worker's. Messages are length-prefixed frames; each pool picks their
encoding.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
"""A frame's length prefix."""

_PR_SET_PDEATHSIG = 1
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class WorkerGone(Exception):
    """The worker process exited, or its pipe broke."""


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def read_frame(f: BinaryIO) -> bytes | None:
    """One length-prefixed frame, or None at end of input."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = f.read(size)
    return data if len(data) == size else None


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the parent dies, even mid-call (Linux): a SIGKILLed run
    must not leave user code running. Elsewhere, stdin's EOF ends an idle worker."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 9)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def serve_frames(handle: Callable[[bytes], bytes]) -> None:
    """The worker's loop: each request frame on stdin answered with `handle`'s reply frame
    on the stdout it started with. What user code prints goes where this process's stderr
    goes (the run's log), never into the reply stream."""
    die_with_parent(int(sys.argv[1]))
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while (data := read_frame(requests)) is not None:
        replies.write(frame(handle(data)))
        replies.flush()


class WorkerProcess:
    """The parent's side of one worker: ``python -m MODULE PARENT_PID`` with the parent's
    package root on its path, and the bytes of its next reply read so far."""

    def __init__(
        self, module: str, encode: Callable[[Any], bytes], decode: Callable[[bytes], Any]
    ) -> None:
        self.encode, self.decode = encode, decode
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # User code's prints and tracebacks join the run's log (stdout): stderr carries
            # only the run's one-line fatal error.
            stderr=1,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: Any) -> None:
        try:
            self.stdin.write(frame(self.encode(msg)))
            self.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerGone(f"worker {self.pid} is gone") from exc

    def poll(self) -> Any | None:
        """The next reply if it has fully arrived, else None; WorkerGone at end of output."""
        while True:
            if len(self.buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self.buf)
                if len(self.buf) >= HEADER.size + size:
                    data = bytes(self.buf[HEADER.size : HEADER.size + size])
                    del self.buf[: HEADER.size + size]
                    return self.decode(data)
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return None
            if not chunk:
                code = self.proc.wait()
                raise WorkerGone(f"the worker process died (exit code {code})")
            self.buf += chunk

    def wait(self, timeout_s: float) -> Any | None:
        """The next reply within `timeout_s` (None: it did not come)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                if (reply := self.poll()) is not None:
                    return reply
                sel.select(timeout=left)
        return self.poll()

    def kill(self) -> None:
        """SIGKILL: a call is abandoned wherever it is."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """End an idle worker (it exits at end of input); kill it if it does not."""
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.kill()
