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

import importlib
import pickle
import sys
from collections.abc import Callable
from typing import Any

from rftpipe.workers import serve_frames


def _load(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def main() -> None:
    from rftpipe.rewards.signatures import SIGNATURES

    fns: dict[str, Callable[..., Any]] = {}

    def handle(data: bytes) -> bytes:
        msg = pickle.loads(data)
        if msg[0] == "init":
            sys.path[:] = msg[1]
            # Ready: the parent starts a call's clock only now, so the interpreter's start
            # (slow on a loaded machine) never counts against a function's timeout.
            return pickle.dumps(("ready", None))
        path, signature, samples = msg
        try:
            if path not in fns:
                fns[path] = _load(path)
            return pickle.dumps(("ok", SIGNATURES[signature](fns[path], samples)))
        except BaseException as exc:  # the user's code: report anything, SystemExit too
            return pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))

    serve_frames(handle)


if __name__ == "__main__":
    main()
