"""Agent processes (`rollout.agent`): one process per episode, running the user's agent
function against the rollout stage's endpoint, killed with everything it started.

An agent is ``async def fn(task, client, model, **kwargs)`` returning the episode's reward
(`rftpipe.agents.AgentResult` for the reward with an info dict, or a mapping with the same
keys). It runs its own loop for as long as it likes, so unlike an environment's calls there
is nothing to time out call by call: the stage bounds each episode's time and `kill`s it.
An episode gets a process of its own because an agent's state, threads and child processes
must all end with its episode, which only a killed process group guarantees; a process per
episode also keeps one agent's leaks from the next.

Those processes are forked, not started: an interpreter spends a second of CPU importing
`openai` alone. At its first `start`, `AgentProcesses` starts a *zygote*
(``python -m rftpipe.agents.worker``; `rftpipe.agents.worker` says how it is built) that
imports `openai` and the agent's module (on the run's import path as it is then) and checks
the agent function once, and then, until `close`, forks each episode's process, which
starts with all of that done: milliseconds instead of a second. What this means for an
agent:

- **Its module is imported once**, by the zygote, not once per episode: its module-level
  state is what the import left, and every episode starts from that same state, a
  copy-on-write copy (what one episode changes, no other sees). What the import opened
  (files, sockets) every episode's process inherits and shares, and a process the import
  started is the zygote's child, not an episode's (it ends with the zygote): an agent's
  module should only define things, and leave the rest to the agent function.
- **A module that does not import fails every episode alike**, each as ``import`` (so does
  a function that is not ``async def``, as ``not_async``); its traceback is in the run's log
  once.
- **A module whose import starts a thread** cannot be forked safely: the zygote then starts
  over without it (the run's log says so), each episode's process imports the module
  itself, as slow as a fresh interpreter, and import failures come back per episode.

Each episode's process starts in a session of its own: its process group holds the agent's
children too, and `kill` SIGKILLs the group, from this process, at once. It dies, group and
all, with the run, and so does the zygote, with whatever the agent's module started. They
import only the agent's module and `openai`, never the run's torch, and under
`AgentSpec.python` they may run another interpreter, one whose packages conflict with the
trainer's: it then gets none of the trainer's installed packages (`isolated_sys_path`).

Results come back as events on the caller's queue: a `Started` when an episode's process
exists, then exactly one `Finished` or `Failed` per episode unless it was killed (a `Failed`
without a `Started` when its process never started), so the stage can wait on its
endpoint's calls and its agents' ends together.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, get_args

from rftpipe.agents.worker import RESTARTING, WORKER, recv_frame, send_frame
from rftpipe.workers import read_frame

_PACKAGE = Path(__file__).resolve().parents[1]
"""The rftpipe package directory."""
_CLOSE_S = 10.0
"""How long `close` waits for the zygote's keeper to end after SIGTERM (it ends at once)."""


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
class Started:
    """An episode's agent process exists (forked by the zygote): its time starts now. The
    first `start`s wait for the zygote's imports, and that wait is the pool's, not the
    agent's."""

    episode: int


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


class _Zygote:
    """The pool's side of one zygote: its keeper process (ours to reap), the socket, and
    what its handshake said. Its state changes under the pool's lock only."""

    def __init__(self, keeper: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.keeper, self.sock = keeper, sock
        self.ready = False
        self.failure: tuple[FailureKind, str] | None = None
        """Why every episode fails (an ``import`` or ``not_async`` failure)."""
        self.pidfd: int | None = None
        """The zygote's own pidfd, readable once it has exited."""
        self.lost = False
        """A request found the socket closed: the zygote has exited."""
        self.handshaken = False
        """The handshake thread is done with the socket (else it closes it at its end)."""
        self.closed = False

    def alive(self) -> bool:
        """Whether the zygote still runs, so that its supervisors are still unreaped unless
        it reaped them on request. (Once it has exited they are orphans: the kernel's
        reaper may reap them, and their pids then name other processes.)"""
        if self.lost or self.closed:
            return False
        if self.pidfd is not None:
            poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
            return not poll.poll(0)
        # No pidfd (not Linux, or before 5.3): the keeper ends as soon as the zygote does.
        try:
            info = os.waitid(os.P_PID, self.keeper.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is None

    def request(self, message: dict[str, Any], fd: int | None = None) -> dict[str, Any] | None:
        """Send a request (with `fd`) and return the reply; None once the zygote has
        exited. Only once ready, and under the pool's lock: one conversation at a time."""
        if self.lost:
            return None
        try:
            send_frame(
                self.sock, json.dumps(message, default=str).encode(), [] if fd is None else [fd]
            )
            raw, _ = recv_frame(self.sock)
        except OSError:
            raw = None
        if raw is None:
            self.lost = True
            return None
        reply: dict[str, Any] = json.loads(raw)
        return reply

    def close(self) -> None:
        """End the zygote: its keeper SIGKILLs its group and whatever it started, and its
        supervisors SIGKILL theirs (those that `AgentProcesses` did not kill already)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # a handshake waiting on it wakes up
        if self.handshaken:
            self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.keeper.terminate()
        try:
            self.keeper.wait(_CLOSE_S)
        except subprocess.TimeoutExpired:
            self.keeper.kill()
            self.keeper.wait()


@dataclass(slots=True)
class _Episode:
    """A started episode: waiting for its zygote, or with its supervisor's pid (the id of
    its process group) and the pipe its result comes on."""

    episode: int
    request: dict[str, Any]
    zygote: _Zygote
    pid: int | None = None
    reader: BinaryIO | None = None


class AgentProcesses:
    """The agent processes of one rollout stage, by episode; each one's end arrives in
    `inbox` as a `Finished` or `Failed` (an episode `kill`ed sends none)."""

    def __init__(self, spec: AgentSpec, inbox: queue.Queue[Any]) -> None:
        self.spec, self.inbox = spec, inbox
        self._python = spec.python or sys.executable
        self._lock = threading.Lock()
        """Held to start, reap or kill a process, to talk to the zygote, and to put an
        event: a supervisor is reaped (so its pid, its group's id, may be reused) only
        under it, and no event follows a `kill`."""
        self._running: dict[int, _Episode] = {}
        self._zygote: _Zygote | None = None
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
        comes to `inbox` (a `Failed` at once when the agent's module does not import or
        the interpreter does not start at all).

        Once the zygote is up, the episode's process exists and leads its process group when
        this returns. Until then (the first `start`s, while the zygote imports) the episode
        waits for it, and `kill` just withdraws it. The zygote is started from the calling
        thread, and that thread must outlive it (the stage's own thread does): a process
        learns of its parent's death by PR_SET_PDEATHSIG, which Linux sends when the
        *thread* that started it exits, so a zygote started from a short-lived thread would
        be killed, episodes and all, when that thread ends."""
        # The key travels in the request, not in argv or the environment (which /proc
        # shows). Values JSON cannot hold become their `str`, as an environment's do.
        request = {
            "op": "start",
            "episode": episode,
            "task": task,
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
        }
        with self._lock:
            if self._closed:
                raise RuntimeError("the agent processes are closed")
            if episode in self._running:
                raise ValueError(f"episode {episode}'s agent is already running")
            z = self._zygote
            if z is not None and z.failure is None and z.ready and not z.alive():
                z.close()  # it died (its episodes died with it): another one starts
                z = self._zygote = None
            if z is None:
                try:
                    z = self._zygote = self._spawn()
                except OSError as exc:
                    self.inbox.put(
                        Failed(
                            episode=episode,
                            kind="import",
                            message=f"cannot start the agent's interpreter {self._python}: {exc}",
                        )
                    )
                    return
            if z.failure is not None:
                kind, message = z.failure
                self.inbox.put(Failed(episode=episode, kind=kind, message=message))
                return
            ep = _Episode(episode=episode, request=request, zygote=z)
            self._running[episode] = ep
            if z.ready:
                self._fork(ep)

    def kill(self, episode: int) -> None:
        """SIGKILL `episode`'s process group (the agent's own child processes too) and reap
        it; no event comes for it after this, even one that was on its way. An episode that
        is not running is left alone."""
        with self._lock:
            ep = self._running.pop(episode, None)
            if ep is not None and ep.pid is not None:
                self._end(ep)

    def running(self) -> set[int]:
        """The episodes whose process has not ended (or been killed)."""
        with self._lock:
            return set(self._running)

    def close(self) -> None:
        """Kill every process still running, and the zygote. Idempotent; also run at exit."""
        with self._lock:
            self._closed = True
            started = [ep for ep in self._running.values() if ep.pid is not None]
            self._running.clear()
            for ep in started:  # all at once first: killed groups exit meanwhile
                if ep.pid is not None and ep.zygote.alive():
                    _kill_group(ep.pid)
            for ep in started:
                self._end(ep)
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None
        atexit.unregister(self.close)
        if self._link_dir is not None:
            shutil.rmtree(self._link_dir, ignore_errors=True)
            self._link_dir = None

    # -- the zygote ------------------------------------------------------------------------
    def _spawn(self) -> _Zygote:
        """Start a zygote (its handshake goes on in a thread of its own)."""
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
        config = {
            "path": self.spec.path,
            "kwargs": self.spec.kwargs,
            "sys_path": sys_path,
            "replace_path": replace,
        }
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            keeper = subprocess.Popen(
                [self._python, "-m", WORKER, str(os.getpid()), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                # The agent's prints and tracebacks join the run's log (stdout), as a
                # reward or environment worker's do (`rftpipe.workers`).
                stderr=1,
                env=env,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        z = _Zygote(keeper, mine)
        data = json.dumps(config, default=str).encode()
        threading.Thread(
            target=self._handshake, args=(z, data), name="agent-zygote", daemon=True
        ).start()
        return z

    def _handshake(self, z: _Zygote, config: bytes) -> None:
        """The zygote's start: send the configuration, wait until it has imported, then
        start the episodes waiting for it (or fail them all)."""
        raw: bytes | None = None
        fds: list[int] = []
        with contextlib.suppress(OSError):
            while True:
                send_frame(z.sock, config)
                raw, fds = recv_frame(z.sock, 1)
                if raw is None or raw != RESTARTING:
                    break
                # It left a thread running and execs itself without the agent's module.
        code = None
        if raw is None:  # it exited: the keeper's exit code says how
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = z.keeper.wait(_CLOSE_S)
        with self._lock:
            z.handshaken = True
            if z.closed:
                z.sock.close()
                for fd in fds:
                    os.close(fd)
                return
            z.failure = self._greeting(z, raw, fds, code)
            z.ready = z.failure is None
            for ep in [ep for ep in self._running.values() if ep.zygote is z]:
                if z.failure is None:
                    self._fork(ep)
                else:
                    del self._running[ep.episode]
                    kind, message = z.failure
                    self.inbox.put(Failed(episode=ep.episode, kind=kind, message=message))

    def _greeting(
        self, z: _Zygote, raw: bytes | None, fds: list[int], code: int | None
    ) -> tuple[FailureKind, str] | None:
        """What the zygote's first reply says: None when it is ready, else the failure
        of every episode."""
        if raw is None:
            status = "it did not end" if code is None else _status(code)
            return (
                "import",
                f"the agent's interpreter {self._python} cannot run {WORKER} "
                f"({status}; its error is in the run's log)",
            )
        try:
            msg = json.loads(raw)
            if msg["kind"] == "ready":
                z.pidfd = fds.pop() if fds else None
                return None
            if msg["kind"] in ("import", "not_async"):
                return msg["kind"], str(msg["message"])
        except (ValueError, KeyError, TypeError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
        return "import", f"the agent's zygote sent {raw[:200]!r}"

    # -- episodes --------------------------------------------------------------------------
    def _fork(self, ep: _Episode) -> None:
        """Have the zygote fork `ep`'s process and watch for its result (under the lock)."""
        r, w = os.pipe()
        try:
            reply = ep.zygote.request(ep.request, fd=w)
        finally:
            os.close(w)  # the supervisor's alone now: its end of output is its exit
        ep.request = {}  # the api key: no longer needed
        if reply is None or "pid" not in reply:
            os.close(r)
            del self._running[ep.episode]
            why = (
                "its zygote exited (its error, if any, is in the run's log)"
                if reply is None
                else f"{reply.get('error')}"
            )
            message = f"the agent's process did not start: {why}"
            self.inbox.put(Failed(episode=ep.episode, kind="died", message=message))
            return
        ep.pid = int(reply["pid"])
        ep.reader = os.fdopen(r, "rb")
        self.inbox.put(Started(episode=ep.episode))  # before its watcher can put its end
        threading.Thread(
            target=self._watch, args=(ep,), name=f"agent-{ep.episode}", daemon=True
        ).start()

    def _end(self, ep: _Episode) -> int | None:
        """SIGKILL `ep`'s group and have the zygote reap its supervisor (under the lock): its
        exit code, or None when the zygote is gone (its supervisors took their groups down
        with them, and another process may have their pids by now)."""
        assert ep.pid is not None
        if not ep.zygote.alive():
            return None
        _kill_group(ep.pid)
        reply = ep.zygote.request({"op": "reap", "pid": ep.pid})
        return None if reply is None or reply["code"] is None else int(reply["code"])

    def _watch(self, ep: _Episode) -> None:
        """The episode's reader thread: read the supervisor's reply until it comes or the
        supervisor exits, then end the episode and put its event (unless it was killed
        meanwhile)."""
        assert ep.reader is not None
        reply = None
        with contextlib.suppress(OSError):
            reply = _read_reply(ep.reader)
        try:
            with self._lock:
                if self._running.get(ep.episode) is not ep:
                    return  # killed: `kill` or `close` ended it, and no event follows
                del self._running[ep.episode]
                # The supervisor kills its group after replying; this also takes the group
                # down when the supervisor itself was killed.
                code = self._end(ep)
                self.inbox.put(self._event(ep.episode, reply, code))
        finally:
            ep.reader.close()

    def _event(self, episode: int, reply: bytes | None, code: int | None) -> Finished | Failed:
        if reply is None:
            status = "its zygote exited" if code is None else _status(code)
            return Failed(
                episode=episode,
                kind="died",
                message=f"the agent's process died without a result ({status})",
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


def _read_reply(reader: BinaryIO) -> bytes | None:
    """A supervisor's reply frame, or None when it exited without one."""
    return read_frame(reader)


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group `pgid` (a supervisor's pid: it leads its own session). Only
    while the supervisor is unreaped: until then no other group can take that id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _status(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
