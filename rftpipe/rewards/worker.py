"""One reward worker process: ``python -m rftpipe.rewards.worker PARENT_PID``.

It reads length-prefixed pickled requests on stdin and answers each on the stdout it
started with: ``("init", sys_path)`` sets the import path to the parent's and answers
``("ready", None)``; ``(path,
signature, samples)`` imports ``module:function`` by path (cached) and calls it under the
signature (`rftpipe.rewards.signatures.SIGNATURES`), answering ``("ok", values)`` or
``("error", "Type: message")``. Functions travel as import paths, never pickled, so closures and
lambdas are never needed. The parent kills this process with SIGKILL when a call outlives
its timeout (`rftpipe.rewards.pool`); this process dies with its parent too.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1


def read_frame(f: BinaryIO) -> bytes | None:
    """One length-prefixed frame, or None at end of input."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = f.read(size)
    return data if len(data) == size else None


def frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the parent dies, even mid-call (Linux): a SIGKILLed run
    must not leave a reward function hanging. Elsewhere, stdin's EOF ends an idle worker."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 9)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _load(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def main() -> None:
    _die_with_parent(int(sys.argv[1]))
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    # Whatever the user's function prints goes where this process's stderr goes (the
    # parent's log), never into the reply stream.
    os.dup2(2, 1)
    from rftpipe.rewards.signatures import SIGNATURES

    fns: dict[str, Callable[..., Any]] = {}
    while (data := read_frame(requests)) is not None:
        msg = pickle.loads(data)
        if msg[0] == "init":
            sys.path[:] = msg[1]
            # Ready: the parent starts a call's clock only now, so the interpreter's start
            # (slow on a loaded machine) never counts against a function's timeout.
            replies.write(frame(pickle.dumps(("ready", None))))
            replies.flush()
            continue
        path, signature, samples = msg
        try:
            if path not in fns:
                fns[path] = _load(path)
            reply = pickle.dumps(("ok", SIGNATURES[signature](fns[path], samples)))
        except BaseException as exc:  # the user's code: report anything, SystemExit too
            reply = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
        replies.write(frame(reply))
        replies.flush()


if __name__ == "__main__":
    main()
