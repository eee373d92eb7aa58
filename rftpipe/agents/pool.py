"""Agent processes (`rollout.agent`): one process per episode, running the user's agent
function against the rollout stage's endpoint, killed with everything it started.

An agent is ``async def fn(task, client, model, **kwargs)`` returning the episode's reward
(`rftpipe.agents.AgentResult` for the reward with an info dict, or a mapping with the same
keys). It runs its own loop for as long as it likes, so unlike an environment's calls there
is nothing to time out call by call: the stage bounds each episode's time and `kill`s it.
An episode gets a process of its own (``python -m rftpipe.agents.worker``,
`rftpipe.agents.worker` says how it is built) because an agent's state, threads and child
processes must all end with its episode, which only a killed process group guarantees; a
fresh process per episode also keeps one agent's leaks from the next.

Each process starts in a session of its own: its process group holds the agent's children
too, and `kill` SIGKILLs the group. It dies, group and all, with the run. It imports only
the agent's module and `openai`, never the run's torch, and under `AgentSpec.python` it may
be another interpreter, one whose packages conflict with the trainer's: it then gets none
of the trainer's installed packages (`isolated_sys_path`).

Results come back as events on the caller's queue, exactly one `Finished` or `Failed` per
episode unless it was killed, so the stage can wait on its endpoint's calls and its
agents' ends together.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast, get_args

from rftpipe.workers import frame, read_frame

_PACKAGE = Path(__file__).resolve().parents[1]
"""The rftpipe package directory."""
WORKER = "rftpipe.agents.worker"


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentSpec:
    """Which agent to run, and under which interpreter (`rollout.agent`)."""

    path: str
    """The agent function, ``pkg.mod:fn``."""
    kwargs: dict[str, Any]
    """Passed to it by name after ``task, client, model`` (JSON values: the config's)."""
    python: str | None = None
    """The interpreter of the agent processes; None: the run's own (`sys.executable`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """An agent returned."""

    episode: int
    reward: float
    info: dict[str, Any]
    """What it returned besides the reward (JSON values; others became their `str`)."""


FailureKind = Literal["import", "not_async", "raised", "returned", "died"]
"""How an episode's agent failed:

- ``import``: its path does not import or has no such attribute, its interpreter cannot
  run `rftpipe.agents.worker`, or `openai` does not import there (the message names it);
- ``not_async``: the function is not ``async def`` (checked before calling it);
- ``raised``: it raised (the message is ``Type: message``);
- ``returned``: it returned something other than a reward (the message names its type and
  a short repr);
- ``died``: its process exited without a result (the message has its exit code or signal).

``import`` and ``not_async`` fail every episode alike: the configuration's error."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failed:
    """An agent failed (see `FailureKind`)."""

    episode: int
    kind: FailureKind
    message: str
    """One line."""


def isolated_sys_path(
    entries: Sequence[str], *, prefixes: Sequence[str], package_root: str
) -> list[str]:
    """The run's import path as another interpreter (`AgentSpec.python`) gets it: the
    entries that are the user's own, then `package_root`, from which `rftpipe.agents.worker`
    imports. An entry inside an installation (one of `prefixes`: the trainer's
    `sys.prefix` and `sys.base_prefix`) or inside any ``site-packages`` or
    ``dist-packages`` directory is left out: the point of another interpreter is packages
    that conflict with the trainer's, so none of those may shadow its own (which its own
    path, after these, holds)."""
    roots = [Path(os.path.realpath(p)) for p in prefixes]
    out: list[str] = []
    for entry in entries:
        real = Path(os.path.realpath(entry or os.curdir))  # "": the current directory
        if {"site-packages", "dist-packages"} & set(real.parts):
            continue
        if any(real.is_relative_to(root) for root in roots) or entry in out:
            continue
        out.append(entry)
    if package_root not in out:
        out.append(package_root)
    return out


class AgentProcesses:
    """The agent processes of one rollout stage, by episode; each one's end arrives in
    `inbox` as a `Finished` or `Failed` (an episode `kill`ed sends none)."""

    def __init__(self, spec: AgentSpec, inbox: queue.Queue[Any]) -> None:
        self.spec, self.inbox = spec, inbox
        self._python = spec.python or sys.executable
        self._lock = threading.Lock()
        """Held to start, reap or kill a process, and to put its event: a process is reaped
        (so its pid, its group's id, may be reused) only under it, and no event follows a
        `kill`."""
        self._running: dict[int, subprocess.Popen[bytes]] = {}
        self._closed = False
        self._link_dir: str | None = None
        if spec.python is not None:
            # The rftpipe package alone, for another interpreter: the directory above it may
            # be the trainer's site-packages (an installed rftpipe), and it may hold other
            # modules besides.
            self._link_dir = tempfile.mkdtemp(prefix="rftpipe-agents-")
            os.symlink(_PACKAGE, Path(self._link_dir) / _PACKAGE.name)
        atexit.register(self.close)

    def start(
        self, episode: int, task: dict[str, Any], base_url: str, api_key: str, model: str
    ) -> None:
        """Start `episode`'s agent process and return at once; its `Finished` or `Failed`
        comes to `inbox` (a `Failed` of kind ``import`` at once when the interpreter does not
        start at all).

        The process is started from the calling thread, and that thread must outlive it (the
        stage's own thread does): a process learns of its parent's death by
        PR_SET_PDEATHSIG, which Linux sends when the *thread* that started it exits, so a
        process started from a short-lived thread would be killed, group and all, when that
        thread ends."""
        if self.spec.python is None:
            # This interpreter: the run's own import path, so the user's modules import as
            # they do in the run.
            sys_path, replace = list(sys.path), True
            roots = [str(_PACKAGE.parent), os.environ.get("PYTHONPATH", "")]
        else:
            assert self._link_dir is not None
            sys_path = isolated_sys_path(
                sys.path, prefixes=[sys.prefix, sys.base_prefix], package_root=self._link_dir
            )
            replace, roots = False, [self._link_dir]  # not the trainer's PYTHONPATH either
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, roots)))
        # The key travels in the job, not in argv or the environment (which /proc shows).
        # Values JSON cannot hold become their `str`, as an environment's do.
        job = json.dumps(
            {
                "episode": episode,
                "path": self.spec.path,
                "kwargs": self.spec.kwargs,
                "task": task,
                "base_url": base_url,
                "api_key": api_key,
                "model": model,
                "sys_path": sys_path,
                "replace_path": replace,
            },
            default=str,
        ).encode()
        with self._lock:
            if self._closed:
                raise RuntimeError("the agent processes are closed")
            if episode in self._running:
                raise ValueError(f"episode {episode}'s agent is already running")
            try:
                proc = subprocess.Popen(
                    [self._python, "-m", WORKER, str(os.getpid())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    # The agent's prints and tracebacks join the run's log (stdout), as a
                    # reward or environment worker's do (`rftpipe.workers`).
                    stderr=1,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                self.inbox.put(
                    Failed(
                        episode=episode,
                        kind="import",
                        message=f"cannot start the agent's interpreter {self._python}: {exc}",
                    )
                )
                return
            self._running[episode] = proc
        threading.Thread(
            target=self._watch, args=(episode, proc, job), name=f"agent-{episode}", daemon=True
        ).start()

    def kill(self, episode: int) -> None:
        """SIGKILL `episode`'s process group (the agent's own child processes too) and reap
        it; no event comes for it after this, even one that was on its way. An episode that
        is not running is left alone."""
        with self._lock:
            proc = self._running.pop(episode, None)
            if proc is not None:
                _kill_group(proc)
                proc.wait()

    def running(self) -> set[int]:
        """The episodes whose process has not ended (or been killed)."""
        with self._lock:
            return set(self._running)

    def close(self) -> None:
        """Kill every process still running. Idempotent; also run at exit."""
        with self._lock:
            self._closed = True
            procs = list(self._running.values())
            self._running.clear()
            for proc in procs:
                _kill_group(proc)
            for proc in procs:
                proc.wait()
        atexit.unregister(self.close)
        if self._link_dir is not None:
            shutil.rmtree(self._link_dir, ignore_errors=True)
            self._link_dir = None

    def _watch(self, episode: int, proc: subprocess.Popen[bytes], job: bytes) -> None:
        """The episode's reader thread: send the job, read the process's frames until its
        reply or its end, reap it and put its event (unless it was killed meanwhile)."""
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):  # it died first: its end shows below
            proc.stdin.write(frame(job))
        with contextlib.suppress(OSError):
            proc.stdin.close()
        started = reply = None
        out = cast(BinaryIO, proc.stdout)
        with contextlib.suppress(OSError):
            started = read_frame(out)
            if started is not None:
                reply = read_frame(out)
        try:
            with self._lock:
                if self._running.get(episode) is not proc:
                    return  # killed: `kill` or `close` reaped it, and no event follows
                del self._running[episode]
                # The worker kills its group after replying; this also takes the group down
                # when the worker itself was killed (while unreaped, its id is not reused).
                _kill_group(proc)
                code = proc.wait()
                self.inbox.put(self._event(episode, started, reply, code))
        finally:
            proc.stdout.close()

    def _event(
        self, episode: int, started: bytes | None, reply: bytes | None, code: int
    ) -> Finished | Failed:
        if started is None:
            return Failed(
                episode=episode,
                kind="import",
                message=f"the agent's interpreter {self._python} cannot run {WORKER} "
                f"({_status(code)}; its error is in the run's log)",
            )
        if reply is None:
            return Failed(
                episode=episode,
                kind="died",
                message=f"the agent's process died without a result ({_status(code)})",
            )
        try:
            msg = json.loads(reply)
            if msg["kind"] == "finished":
                return Finished(episode=episode, reward=float(msg["reward"]), info=msg["info"])
            if msg["kind"] in get_args(FailureKind):
                return Failed(episode=episode, kind=msg["kind"], message=str(msg["message"]))
        except (ValueError, KeyError, TypeError):
            pass
        return Failed(
            episode=episode, kind="died", message=f"the agent's process sent {reply[:200]!r}"
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group (its id is its pid: it leads its own session). Only
    before `proc` is reaped: until then no other group can take that id."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
