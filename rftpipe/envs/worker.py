"""One environment worker process: ``python -m rftpipe.envs.worker PARENT_PID``.

It holds many environments, by id, and answers one request at a time: length-prefixed JSON
frames on stdin, replies on the stdout it started with. Requests:

- ``["init", sys_path]`` sets the import path to the parent's; answers ``["ready", null]``;
- ``["make", id, env_config]`` builds an environment (`rftpipe.envs.loader`);
- ``["reset", id, task, seed]``, ``["step", id, action]``, ``["restore", id, messages,
  turn_infos]``, ``["close", id]`` call it.

Replies are ``["ok", value]`` or ``["error", "Type: message"]``. Everything crosses as JSON
(values an environment returns that JSON cannot hold become their `str`), never pickled. The
parent (`rftpipe.envs.pool`) SIGKILLs this process when a call outlives its timeout; it
also dies with its parent (Linux `PR_SET_PDEATHSIG`), so no environment outlives the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import struct
import sys
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


def frame(msg: Any) -> bytes:
    data = json.dumps(msg, default=str).encode()
    return HEADER.pack(len(data)) + data


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 9)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _handle(envs: dict[int, Any], msg: list[Any]) -> Any:
    from rftpipe.config.schema import EnvConfig
    from rftpipe.envs.base import StepResult, Task, call
    from rftpipe.envs.loader import make_environment

    kind, env_id = msg[0], msg[1]
    if kind == "make":
        envs[env_id] = make_environment(EnvConfig(**msg[2]))
        return {"replayable": getattr(envs[env_id], "replayable", True) is not False}
    env = envs[env_id]
    if kind == "reset":
        messages, info = call(env.reset, Task(**msg[2]), msg[3])
        return [messages, info]
    if kind == "step":
        out = call(env.step, msg[2])
        return dataclasses.asdict(out) if isinstance(out, StepResult) else out
    if kind == "restore":
        call(env.restore, msg[2], msg[3])
        return None
    if kind == "close":
        envs.pop(env_id)
        call(env.close)
        return None
    raise ValueError(f"unknown request {kind!r}")


def main() -> None:
    _die_with_parent(int(sys.argv[1]))
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    # What an environment prints goes where this process's stderr goes (the run's log),
    # never into the reply stream.
    os.dup2(2, 1)
    envs: dict[int, Any] = {}
    while (data := read_frame(requests)) is not None:
        msg = json.loads(data)
        if msg[0] == "init":
            sys.path[:] = msg[1]
            reply: list[Any] = ["ready", None]
        else:
            try:
                reply = ["ok", _handle(envs, msg)]
            except BaseException as exc:  # the user's code: report anything, SystemExit too
                reply = ["error", f"{type(exc).__name__}: {exc}"]
        replies.write(frame(reply))
        replies.flush()


if __name__ == "__main__":
    main()
