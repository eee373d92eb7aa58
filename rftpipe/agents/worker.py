"""The processes behind one `rftpipe.agents.pool.AgentProcesses`:
``python -m rftpipe.agents.worker PARENT_PID SOCKET_FD``.

An episode's process is forked, not started: a fresh interpreter would spend a second of
CPU importing `openai` for every episode. Four kinds of process, each forked from the one
above it:

- **The keeper**, this command, in a session of its own; it runs no user code. It forks the
  zygote into a process group of its own and SIGKILLs that group when the zygote exits or
  the run dies, so whatever the agent's module starts when it is imported ends too.
- **The zygote** talks to the pool over the Unix socket SOCKET_FD, in length-prefixed JSON
  frames, one reply per request. Its first frame is the configuration (the agent's path and
  kwargs, the import path); it imports the agent's module and `openai`, checks the function
  once, and replies ``{"kind": "ready", "pid": PID, "preloaded": true}`` (with a pidfd of
  itself where there is one), or ``{"kind": KIND, "message": "one line"}``, an ``import`` or
  ``not_async`` failure that fails every episode. Then, single-threaded, it serves:

  - ``{"op": "start", "episode", "task", "base_url", "api_key", "model"}``, with the write
    end of the episode's result pipe attached (SCM_RIGHTS): it forks the episode's
    supervisor and replies ``{"pid": PID}`` once that process leads a session of its own,
    so the pool can SIGKILL the episode's group (whose id is PID) from then on (or
    ``{"error": "one line"}`` when fork fails);
  - ``{"op": "reap", "pid": PID}``: it reaps a supervisor the pool has SIGKILLed and
    replies ``{"code": its exit code}``. Supervisors are reaped only then: until reaped a
    process keeps its pid, so the id of a group the pool kills cannot meanwhile name
    another group.

  It ends at the end of its input, and is SIGKILLed when the keeper dies.
- **A supervisor** per episode, in a session of its own. It forks the agent process, relays
  the agent's reply, or, when the agent process exits without one, a ``died`` reply with its
  exit status, as one frame on the result pipe, and then SIGKILLs its group: whatever the
  agent left running ends with its episode. A reply is ``{"kind": "finished", "reward": r,
  "info": {...}}`` or ``{"kind": KIND, "message": "one line"}`` with KIND one of
  `rftpipe.agents.pool.FailureKind`.
- **The agent process** runs the agent in an event loop of its own and writes its reply to
  a private pipe.

Why a supervisor: the run may be SIGKILLed at any instant, and then nothing the agent
started may survive. PR_SET_PDEATHSIG signals only the process whose parent died; to take
the group along, the supervisor asks for SIGTERM when the zygote dies (the zygote dies with
the keeper, the keeper's SIGTERM comes with the run's death) and its handler SIGKILLs the
group. In the agent's own process that handler could fail to run: the agent may install its
own SIGTERM handler (servers and agent frameworks do), ignore or block the signal, or keep
the main thread in C code, where Python runs no handler. The supervisor's main thread only
ever waits in select(), so its handler runs at once. The agent process itself is SIGKILLed
by PR_SET_PDEATHSIG if the supervisor dies (`die_with_parent`), and where there is no prctl
(not Linux) the supervisor polls its parent's pid instead. A descendant that leaves the
group (``setsid``, ``start_new_session=True``) escapes all this; only a cgroup would hold
it.

Forking is safe only from a single-threaded process. If importing the agent's module leaves
a thread running in the zygote, the zygote says so in the run's log, replies ``{"kind":
"restarting"}`` and execs itself anew (``python -m rftpipe.agents.worker lazy-zygote
KEEPER_PID SOCKET_FD``: the same process and socket, so the pool sends the configuration
again). That zygote imports only `openai`; each agent process then imports the agent's
module itself, and ``import`` and ``not_async`` come back episode by episode.

Torch-free and light: the standard library, `rftpipe.workers`, `rftpipe.agents`, the agent's
module and `openai`. Everything crosses as JSON, never pickled; what the agent prints joins
the run's log (these processes' stdout and stderr are the run's), never a frame stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import inspect
import json
import math
import numbers
import os
import reprlib
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rftpipe.agents import AgentResult
from rftpipe.workers import HEADER, die_with_parent, frame

WORKER = "rftpipe.agents.worker"
LAZY = "lazy-zygote"
RESTARTING = b'{"kind": "restarting"}'
"""The zygote's reply when it execs itself without the agent's module."""
"""The first argument of a zygote that execs itself without the agent's module."""
_PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when the thread that started it exits."""
_POLL_S = 0.1
"""How often the supervisor looks at its parent and its agent process where it cannot wait
on a pidfd (not Linux, or a kernel before 5.3)."""
_MESSAGE_CHARS = 2000
"""A failure message's longest length (an exception's text may be megabytes)."""
_INSTALL_OPENAI = "pip install 'openai>=2.25,<4'"
_HTTP: Any = None
"""The HTTP client `openai.AsyncOpenAI` built for itself in the zygote, unused: each agent
process's client takes it (its own copy, by fork) rather than building one, which costs a
tenth of a second of CPU (its TLS context loads the certificate store)."""
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGCHLD)
"""Signals whose handling the zygote needs as the default (a SIGCHLD ignored would reap its
supervisors unasked); an agent process gets back what the agent's module set."""


class _Failure(Exception):
    """A failure to reply with: its kind (`rftpipe.agents.pool.FailureKind`) and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass(frozen=True, kw_only=True, slots=True)
class _Agent:
    """What every episode's agent process starts from (built in the zygote)."""

    path: str
    kwargs: dict[str, Any]
    fn: Any
    """The agent function, imported by the zygote; None: each agent process imports it."""
    handlers: dict[int, Any]
    """The handlers of `_AGENT_SIGNALS` as the agent's module left them."""


# -- frames on the zygote's socket ---------------------------------------------------------
def send_frame(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """One frame on `sock`, with `fds` (SCM_RIGHTS) on its first bytes."""
    view = memoryview(frame(data))
    if fds:
        view = view[socket.send_fds(sock, [view], list(fds)) :]
    sock.sendall(view)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[bytes | None, list[int]]:
    """The next frame on `sock` (None at the end of input) and the descriptors that came with
    it (close-on-exec; at most `max_fds`). Exactly the frame is read: the kernel drops the
    descriptors that come with bytes a plain recv reads."""
    fds: list[int] = []
    head = _recv_exact(sock, HEADER.size, fds, max_fds)
    data = None if head is None else _recv_exact(sock, HEADER.unpack(head)[0], fds, 0)
    if data is None:
        for fd in fds:
            os.close(fd)
        return None, []
    return data, fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int], max_fds: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if max_fds:
            chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), max_fds, socket.MSG_CMSG_CLOEXEC)
            fds += got
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


# -- the keeper ----------------------------------------------------------------------------
_zygote_pid = 0
"""The keeper's zygote, once forked (its group's id)."""


def main() -> None:
    if sys.argv[1] == LAZY:
        _zygote(int(sys.argv[2]), socket.socket(fileno=int(sys.argv[3])), preload=False)
    parent, sock_fd = int(sys.argv[1]), int(sys.argv[2])
    if os.getpgid(0) != os.getpid():
        sys.exit(f"{WORKER} runs in a session of its own: rftpipe.agents.pool starts it")
    signal.signal(signal.SIGTERM, _end_keeper)
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
    keeper = os.getpid()
    # Blocked until the zygote's id is known, so that the handler kills its group.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    zygote = os.fork()  # this process is single-threaded: forking it is safe
    if zygote == 0:
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            die_with_parent(keeper)
            _zygote(keeper, socket.socket(fileno=sock_fd), preload=True)
        finally:
            os._exit(70)
    global _zygote_pid
    _zygote_pid = zygote
    with contextlib.suppress(OSError):  # it did so itself (or died)
        os.setpgid(zygote, zygote)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.close(sock_fd)  # the zygote's alone: its end of input is its death
    # Not reaped before its group is killed: until then no other group can take its id.
    info = os.waitid(os.P_PID, zygote, os.WEXITED | os.WNOWAIT)
    assert info is not None
    code = info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status
    _end_keeper(code=code)


def _end_keeper(*_: object, code: int = 128 + signal.SIGTERM) -> NoReturn:
    """SIGKILL the zygote's group and exit (the SIGTERM handler, and the zygote's end)."""
    if _zygote_pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_zygote_pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(_zygote_pid, 0)
    os._exit(code)


# -- the zygote ----------------------------------------------------------------------------
def _zygote(keeper: int, sock: socket.socket, *, preload: bool) -> NoReturn:
    try:
        die_with_parent(keeper)  # again after an exec, whatever the kernel kept
        _serve(sock, preload)
    except BaseException:  # a bug here: say so, and the pool sees the socket's end
        traceback.print_exc()
    _flush()
    os._exit(70)


def _serve(sock: socket.socket, preload: bool) -> None:
    raw, _ = recv_frame(sock)
    if raw is None:
        os._exit(0)
    config = json.loads(raw)
    if config["replace_path"]:
        sys.path[:] = config["sys_path"]  # this interpreter's: the run's path, as the run imports
    else:  # another interpreter: its own path, after the run's entries it may share
        own = [p for p in sys.path if p not in config["sys_path"]]
        sys.path[:] = [*config["sys_path"], *own]
    fn = None
    try:
        if preload:
            fn = _load(config["path"])
        _import_openai()
    except _Failure as f:
        _flush()
        send_frame(sock, _encode({"kind": f.kind, "message": f.message}))
        os._exit(0)
    _flush()
    if preload and (threads := _threads()) > 1:
        print(
            f"{WORKER}: importing {config['path']} left {threads - 1} more thread(s) running, "
            "and a process with threads cannot be forked safely: each episode's agent process "
            "imports it instead (a second or more per episode)",
            file=sys.stderr,
            flush=True,
        )
        send_frame(sock, RESTARTING)
        fd = sock.fileno()
        os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-m", WORKER, LAZY, str(os.getppid()), str(fd)])
    handlers: dict[int, Any] = {}
    for sig in _AGENT_SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not None:  # None: set outside Python, left as it is
            handlers[sig] = handler
            signal.signal(sig, signal.SIG_DFL)
    agent = _Agent(path=config["path"], kwargs=config["kwargs"], fn=fn, handlers=handlers)
    pidfd = _pidfd(os.getpid())
    ready = _encode({"kind": "ready", "pid": os.getpid(), "preloaded": preload})
    send_frame(sock, ready, [] if pidfd is None else [pidfd])
    if pidfd is not None:
        os.close(pidfd)
    # What is alive now is every episode's, shared copy-on-write: the collector of a forked
    # process then never walks (and so copies) it.
    gc.collect()
    gc.freeze()
    while True:
        raw, fds = recv_frame(sock, 1)
        if raw is None:
            os._exit(0)
        request = json.loads(raw)
        if request["op"] == "start":
            (out,) = fds
            try:
                reply: dict[str, Any] = {"pid": _fork_supervisor(sock, out, agent, request)}
            except OSError as exc:  # out of memory or processes: this episode's failure
                reply = {"error": _describe(exc)}
            finally:
                os.close(out)
        elif request["op"] == "reap":
            try:
                _, status = os.waitpid(int(request["pid"]), 0)
                reply = {"code": os.waitstatus_to_exitcode(status)}
            except ChildProcessError:
                reply = {"code": None}
        else:
            raise ValueError(f"unknown request {request['op']!r}")
        send_frame(sock, _encode(reply))


def _import_openai() -> None:
    """Import `openai`, and what its client imports only when first built, used or closed,
    so that agent processes find it all imported; keep an HTTP client for them (`_HTTP`)."""
    global _HTTP
    try:
        openai = importlib.import_module("openai")
    except BaseException as exc:
        raise _Failure("import", _no_openai(exc)) from None

    async def warm() -> None:
        client = openai.AsyncOpenAI(**_client_options("http://127.0.0.1:9/v1", "-"))
        for name in ("chat", "completions", "responses", "models"):
            getattr(client, name)
        client.chat.completions  # noqa: B018  # the lazily imported resources
        await client.close()

    with contextlib.suppress(Exception):  # a client that fails fails each episode, worded
        asyncio.run(warm())
        _HTTP = getattr(
            openai.AsyncOpenAI(**_client_options("http://127.0.0.1:9/v1", "-")), "_client", None
        )


def _fork_supervisor(sock: socket.socket, out: int, agent: _Agent, episode: dict[str, Any]) -> int:
    """Fork the episode's supervisor, whose reply goes to `out`; its pid, once it leads a
    session (and so a group) of its own."""
    zygote = os.getpid()
    r, w = os.pipe()
    _flush()  # a copy must not print again what this process had not yet written
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            sock.close()
            os.setsid()
            os.close(w)  # the zygote's cue
            _supervise(zygote, out, agent, episode)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(70)
    os.close(w)
    os.read(r, 1)  # the end of the pipe: it has its own session, or has died
    os.close(r)
    return pid


# -- the supervisor ------------------------------------------------------------------------
def _supervise(zygote: int, out: int, agent: _Agent, episode: dict[str, Any]) -> NoReturn:
    signal.signal(signal.SIGTERM, _kill_group)
    _pdeathsig(signal.SIGTERM)
    if os.getppid() != zygote:  # the zygote died before prctl took effect
        _kill_group()
    r, w = os.pipe()
    supervisor = os.getpid()
    child = os.fork()  # this process is single-threaded: forking it is safe
    if child == 0:
        os.close(r)
        os.close(out)  # only the supervisor writes to the pool: its end is the supervisor's
        _agent_process(supervisor, w, agent, episode)
    os.close(w)
    try:
        _write(out, frame(_relay(zygote, child, r)))
    finally:
        _kill_group()


def _kill_group(*_: object) -> NoReturn:
    """SIGKILL this process group: the supervisor, the agent and all they started (the
    SIGTERM handler, and the supervisor's end)."""
    os.killpg(0, signal.SIGKILL)
    os._exit(137)  # not reached: the group includes this process


def _relay(parent: int, child: int, r: int) -> bytes:
    """The agent process's reply, or a ``died`` reply once it exits without one. Its
    descendants may hold the pipe open (a forked process inherits it), so its end of output
    does not say it exited: its pidfd, or a poll, does."""
    os.set_blocking(r, False)
    buf = bytearray()
    pidfd = _pidfd(child)
    with selectors.DefaultSelector() as sel:
        sel.register(r, selectors.EVENT_READ)
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        reading = True
        while True:
            sel.select(timeout=None if pidfd is not None else _POLL_S)
            if os.getppid() != parent:  # where PR_SET_PDEATHSIG is missing
                _kill_group()
            # In this order: what it wrote before exiting is in the pipe when it has exited.
            exited, status = os.waitpid(child, os.WNOHANG)
            if reading and not _drain(r, buf):
                sel.unregister(r)
                reading = False
            if len(buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(buf)
                if len(buf) >= HEADER.size + size:
                    return bytes(buf[HEADER.size : HEADER.size + size])
            if exited:
                return _encode({"kind": "died", "message": _died(status)})


def _drain(fd: int, buf: bytearray) -> bool:
    """Read what `fd` holds into `buf`; False at its end."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        buf += chunk


def _died(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    how = f"exited with code {code}" if code >= 0 else f"was killed by {_signal_name(-code)}"
    return f"the agent's process {how} without returning"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


# -- the agent process ---------------------------------------------------------------------
def _agent_process(supervisor: int, w: int, agent: _Agent, episode: dict[str, Any]) -> NoReturn:
    """Run the episode and write the reply to `w`; never returns into the supervisor's code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the group-killing handler is the supervisor's
    for sig, handler in agent.handlers.items():  # as the agent's module set them
        signal.signal(sig, handler)
    die_with_parent(supervisor)
    try:
        reply = _run(agent, episode)
    except BaseException as exc:  # a bug here: say so rather than die without a word
        traceback.print_exc()
        reply = {"kind": "died", "message": f"{WORKER} failed: {_describe(exc)}"}
    _flush()
    _write(w, frame(_encode(reply)))
    # At once, without the interpreter's teardown (the agent's threads, atexit handlers):
    # the reply is sent, and the supervisor SIGKILLs the group next.
    os._exit(0)


def _run(agent: _Agent, episode: dict[str, Any]) -> dict[str, Any]:
    """The reply for one episode."""
    try:
        fn = agent.fn if agent.fn is not None else _load(agent.path)
        client = _client(episode["base_url"], episode["api_key"])
    except _Failure as f:
        return {"kind": f.kind, "message": f.message}
    try:
        result = asyncio.run(_episode(fn, client, agent.kwargs, episode))
    except BaseException as exc:  # the agent's: SystemExit and KeyboardInterrupt too
        print(f"agent {agent.path} raised on episode {episode['episode']}:", file=sys.stderr)
        traceback.print_exc()
        return {"kind": "raised", "message": _describe(exc)}
    return _reply(result)


def _load(path: str) -> Any:
    """The agent function `path` names (``pkg.mod:fn``), checked to be ``async def``
    without calling it."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise _Failure("import", f"{path!r} is not a 'module:function' path")
    try:
        obj: Any = importlib.import_module(module_name)
    except BaseException as exc:  # the module's own code runs: anything may come out
        if isinstance(exc, ModuleNotFoundError) and exc.name == "openai":
            raise _Failure("import", _no_openai(exc)) from None
        traceback.print_exc()
        raise _Failure("import", f"cannot import {module_name}: {_describe(exc)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _Failure("import", f"module {module_name} has no attribute {attr!r}") from None
    if not inspect.iscoroutinefunction(obj):
        raise _Failure(
            "not_async",
            f"{path} is a {type(obj).__name__}, not an async function: an agent is "
            "`async def fn(task, client, model, **kwargs)`",
        )
    return obj


def _client(base_url: str, api_key: str) -> Any:
    """The episode's client. No retries: the client's own would resend calls the endpoint
    refused (409, 5xx). No timeout: the rollout stage bounds the agent's time itself."""
    try:
        # By name: imported (by the zygote) only in the agent's processes, any interpreter.
        openai = importlib.import_module("openai")
    except BaseException as exc:
        raise _Failure("import", _no_openai(exc)) from None
    options = _client_options(base_url, api_key)
    if _HTTP is not None:
        with contextlib.suppress(Exception):  # else as the client builds it itself
            _HTTP.base_url = base_url
            return openai.AsyncOpenAI(**options, http_client=_HTTP)
    try:
        return openai.AsyncOpenAI(**options)
    except Exception as exc:
        raise _Failure(
            "import",
            f"openai.AsyncOpenAI fails in the agent's interpreter {sys.executable} "
            f"(openai {getattr(openai, '__version__', '?')}): {_describe(exc)}; "
            f"it needs {_INSTALL_OPENAI}",
        ) from None


def _client_options(base_url: str, api_key: str) -> dict[str, Any]:
    return {"base_url": base_url, "api_key": api_key, "max_retries": 0, "timeout": None}


def _no_openai(exc: BaseException) -> str:
    return (
        f"openai does not import in the agent's interpreter {sys.executable} "
        f"({_describe(exc)}): install it there ({_INSTALL_OPENAI})"
    )


async def _episode(
    fn: Callable[..., Any], client: Any, kwargs: dict[str, Any], episode: dict[str, Any]
) -> Any:
    try:
        return await fn(episode["task"], client, episode["model"], **kwargs)
    finally:
        with contextlib.suppress(Exception):
            await client.close()


def _reply(result: Any) -> dict[str, Any]:
    """The reply for what the agent returned: a reward (a real number, not bool), an
    `AgentResult`, or a mapping with a "reward" and an optional dict "info" (what an agent
    that does not import rftpipe can build)."""
    wanted = (
        "an agent returns its reward (a real number, not bool), AgentResult(reward, info) "
        "or a mapping {'reward': ..., 'info': {...}}"
    )
    if isinstance(result, AgentResult):
        reward, info = result.reward, result.info
    elif isinstance(result, Mapping) and "reward" in result:
        if extra := [k for k in result if k not in ("reward", "info")]:
            return _returned(f"returned a mapping with keys {extra!r} besides reward and info")
        reward, info = result["reward"], result.get("info", {})
    else:
        reward, info = result, {}
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        what = _short(result) if reward is result else f"reward {_short(reward)}"
        return _returned(f"returned {what}: {wanted}")
    if not math.isfinite(reward):
        return _returned(f"returned a non-finite reward {float(reward)!r}")
    if not isinstance(info, dict):
        return _returned(f"returned info {_short(info)}: info is a dict")
    reply = {"kind": "finished", "reward": float(reward), "info": info}
    try:
        # Values JSON cannot hold become their `str`, as an environment's info does.
        _encode(reply)
    except (TypeError, ValueError, RecursionError) as exc:
        return _returned(f"returned info that JSON cannot hold: {_describe(exc)}")
    return reply


def _returned(message: str) -> dict[str, Any]:
    return {"kind": "returned", "message": message}


# -- helpers -------------------------------------------------------------------------------
def _pdeathsig(sig: int) -> None:
    """Ask for `sig` when the parent dies (Linux; elsewhere nothing: polled instead)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid` (readable once it exits), or None (not Linux, or before 5.3)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _threads() -> int:
    """This process's threads, those Python did not start included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()


def _encode(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, default=str).encode()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _one_line(text: str) -> str:
    line = " ".join(part.strip() for part in text.strip().splitlines())
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__
        text = ""
    return _one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _short(value: Any) -> str:
    """A value's type and a short repr, as failure messages name them."""
    return f"{type(value).__name__} {_one_line(reprlib.repr(value))}"


if __name__ == "__main__":
    main()
