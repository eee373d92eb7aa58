"""One agent episode: ``python -m rftpipe.agents.worker PARENT_PID``.

The parent (`rftpipe.agents.pool`) starts this module in a session of its own, so that its
process group (whose id is this process's pid) holds everything the episode starts, sends it
one job as a JSON frame on stdin, and reads JSON frames from the stdout it started with:
``{"kind": "started"}`` once this module has imported (a failure before it is the
interpreter's, not the episode's), then exactly one reply, ``{"kind": "finished",
"reward": r, "info": {...}}`` or ``{"kind": KIND, "message": "one line"}`` with KIND one of
`rftpipe.agents.pool.FailureKind`.

Two processes, one group. This process, the supervisor, runs no user code: it forks the
agent process, which imports the agent, runs it in an event loop of its own and writes its
reply to a private pipe. The supervisor relays that reply, or, when the agent process exits
without one, a ``died`` reply with its exit status, and then SIGKILLs the group: whatever the
agent left running ends with its episode.

Why a supervisor: the run may be SIGKILLed at any instant, and then neither this process nor
anything the agent started may survive. PR_SET_PDEATHSIG signals only this process when its
parent dies; to take the group along, the supervisor asks for SIGTERM and its handler
SIGKILLs the group. In the agent's own process that handler could fail to run: the agent
may install its own SIGTERM handler (servers and agent frameworks do), ignore or block the
signal, or keep the main thread in C code, where Python runs no handler. The supervisor's
main thread only ever waits in select(), so its handler runs at once. The agent process
itself is SIGKILLed by PR_SET_PDEATHSIG if the supervisor dies (`die_with_parent`), and
where there is no prctl (not Linux) the supervisor polls its parent's pid instead. A
descendant that leaves the group (``setsid``, ``start_new_session=True``) escapes all this;
only a cgroup would hold it.

Torch-free and light: the standard library, `rftpipe.workers`, `rftpipe.agents`, then, in
the agent process only, the agent's module and `openai`. Everything crosses as JSON, never
pickled; what the agent prints joins the run's log (this process's stderr), never the
reply stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import inspect
import json
import math
import numbers
import os
import reprlib
import selectors
import signal
import sys
import traceback
from collections.abc import Mapping
from typing import Any, NoReturn

from rftpipe.agents import AgentResult
from rftpipe.workers import HEADER, die_with_parent, frame, read_frame

_PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when the thread that started it exits."""
_POLL_S = 0.1
"""How often the supervisor looks at its parent and its agent process where it cannot wait
on a pidfd (not Linux, or a kernel before 5.3)."""
_MESSAGE_CHARS = 2000
"""A failure message's longest length (an exception's text may be megabytes)."""
_INSTALL_OPENAI = "pip install 'openai>=2.25,<4'"


class _Failure(Exception):
    """A failure to reply with: its kind (`rftpipe.agents.pool.FailureKind`) and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


# -- the supervisor ----------------------------------------------------------------------
def main() -> None:
    parent = int(sys.argv[1])
    if os.getpgid(0) != os.getpid():
        # `_kill_group` would SIGKILL whoever started this process, and their group.
        sys.exit(
            "rftpipe.agents.worker runs in a session of its own: rftpipe.agents.pool starts it"
        )
    signal.signal(signal.SIGTERM, _kill_group)
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux (polled below)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        _kill_group()
    _write(1, frame(_encode({"kind": "started"})))
    job = read_frame(sys.stdin.buffer)
    if job is None:  # the parent is gone, or withdrew the job
        _kill_group()
    # Neither the agent nor its children hold the parent's pipes: only the supervisor
    # writes to the parent, so its end of stdout closing means it exited.
    _redirect(0, os.open(os.devnull, os.O_RDONLY))
    r, w = os.pipe()
    supervisor = os.getpid()
    child = os.fork()  # this process is single-threaded: forking it is safe
    if child == 0:
        os.close(r)
        _agent_process(supervisor, w, job)
    os.close(w)
    try:
        _write(1, frame(_relay(parent, child, r)))
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
    try:
        pidfd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None
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


# -- the agent process -------------------------------------------------------------------
def _agent_process(supervisor: int, w: int, job: bytes) -> NoReturn:
    """Run the job and write the reply to `w`; never returns into the supervisor's code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the group-killing handler is the supervisor's
    die_with_parent(supervisor)
    _redirect(1, os.dup(2))  # what the agent prints joins the run's log
    try:
        reply = _run(json.loads(job))
    except BaseException as exc:  # a bug here: say so rather than die without a word
        traceback.print_exc()
        reply = {"kind": "died", "message": f"rftpipe.agents.worker failed: {_describe(exc)}"}
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    _write(w, frame(_encode(reply)))
    # At once, without the interpreter's teardown (the agent's threads, atexit handlers):
    # the reply is sent, and the supervisor SIGKILLs the group next.
    os._exit(0)


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """The reply to one job."""
    if job["replace_path"]:
        sys.path[:] = job["sys_path"]  # this interpreter's: the run's path, as the run imports
    else:  # another interpreter: its own path, after the run's entries it may share
        sys.path[:] = [*job["sys_path"], *(p for p in sys.path if p not in job["sys_path"])]
    try:
        fn = _load(job["path"])
        client = _client(job["base_url"], job["api_key"])
    except _Failure as f:
        return {"kind": f.kind, "message": f.message}
    try:
        result = asyncio.run(_episode(fn, client, job))
    except BaseException as exc:  # the agent's: SystemExit and KeyboardInterrupt too
        print(f"agent {job['path']} raised on episode {job['episode']}:", file=sys.stderr)
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
        # Imported here, by name: only the agent process needs it, under any interpreter.
        openai = importlib.import_module("openai")
    except BaseException as exc:
        raise _Failure("import", _no_openai(exc)) from None
    try:
        return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=None)
    except Exception as exc:
        raise _Failure(
            "import",
            f"openai.AsyncOpenAI fails in the agent's interpreter {sys.executable} "
            f"(openai {getattr(openai, '__version__', '?')}): {_describe(exc)}; "
            f"it needs {_INSTALL_OPENAI}",
        ) from None


def _no_openai(exc: BaseException) -> str:
    return (
        f"openai does not import in the agent's interpreter {sys.executable} "
        f"({_describe(exc)}): install it there ({_INSTALL_OPENAI})"
    )


async def _episode(fn: Any, client: Any, job: dict[str, Any]) -> Any:
    try:
        return await fn(job["task"], client, job["model"], **job["kwargs"])
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


# -- helpers -----------------------------------------------------------------------------
def _encode(reply: dict[str, Any]) -> bytes:
    return json.dumps(reply, default=str).encode()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _redirect(fd: int, to: int) -> None:
    os.dup2(to, fd)
    os.close(to)


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
