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
also dies with its parent (`rftpipe.workers`), so no environment outlives the run.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from rftpipe.workers import serve_frames


def encode(msg: Any) -> bytes:
    # Values JSON cannot hold (an environment's info objects) become their `str`.
    return json.dumps(msg, default=str).encode()


def _handle(envs: dict[int, Any], msg: list[Any]) -> Any:
    from rftpipe.config.schema import EnvConfig
    from rftpipe.envs.base import StepResult, Task, call
    from rftpipe.envs.loader import make_environment

    kind, env_id = msg[0], msg[1]
    if kind == "make":
        envs[env_id] = make_environment(EnvConfig(**msg[2]))
        env = envs[env_id]
        return {
            "replayable": getattr(env, "replayable", True) is not False,
            "name": type(env).__name__,
        }
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
    envs: dict[int, Any] = {}

    def handle(data: bytes) -> bytes:
        msg = json.loads(data)
        if msg[0] == "init":
            sys.path[:] = msg[1]
            return encode(["ready", None])
        try:
            return encode(["ok", _handle(envs, msg)])
        except BaseException as exc:  # the user's code: report anything, SystemExit too
            return encode(["error", f"{type(exc).__name__}: {exc}"])

    serve_frames(handle)


if __name__ == "__main__":
    main()
