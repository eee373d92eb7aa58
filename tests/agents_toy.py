"""Agents for tests/test_agent_pool.py (`agents_toy:NAME`; tests/ is on the path of the test
processes, and so of the agent processes they start).

They call no endpoint (the endpoint has tests of its own): each returns, fails or hangs in
one of the ways an agent process must report. Standard library and `rftpipe.agents` only, so
that they import under another interpreter too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from rftpipe.agents import AgentResult

IMPORTED_IN = os.getpid()
"""The process that imported this module: the zygote, whose episodes are forked from it."""
_CALLS: list[int] = []
"""Module-level state an episode changes: every episode starts from the zygote's copy."""


async def constant(task: dict[str, Any], client: Any, model: str, reward: float = 1.0) -> float:
    """A bare reward; prints on the way (which must not disturb the reply)."""
    print("agent output\n" * 1000, flush=True)
    return reward


async def echo(task: dict[str, Any], client: Any, model: str, **kwargs: Any) -> AgentResult:
    """An AgentResult whose info is what the agent was given."""
    seen = {
        "task": task,
        "model": model,
        "kwargs": kwargs,
        "client": {
            "max_retries": client.max_retries,
            "timeout": client.timeout,
            "base_url": str(client.base_url),
            "api_key": client.api_key,
        },
    }
    return AgentResult(reward=0.5, info=seen)


async def mapping(task: dict[str, Any], client: Any, model: str) -> dict[str, Any]:
    """What an agent with no rftpipe import returns."""
    return {"reward": -2, "info": {"via": "mapping"}}


async def raises(task: dict[str, Any], client: Any, model: str) -> float:
    raise ValueError("no answer\nfound")


async def returns(task: dict[str, Any], client: Any, model: str, value: Any) -> Any:
    """Returns `value` (from kwargs) as the reward, whatever it is."""
    return value


def not_async(task: dict[str, Any], client: Any, model: str, marker: str) -> float:
    """A plain function: must be refused without being called (it leaves `marker`)."""
    Path(marker).write_text("called")
    return 1.0


async def exits(task: dict[str, Any], client: Any, model: str) -> float:
    os._exit(3)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _write_pids(pid_file: str, **more: int) -> None:
    """The processes this agent runs in and under (`rftpipe.agents.worker`), and `more`."""
    supervisor = os.getppid()
    zygote = _ppid(supervisor)
    pids = {"agent": os.getpid(), "supervisor": supervisor, "zygote": zygote}
    pids |= {"keeper": _ppid(zygote), **more}
    Path(f"{pid_file}.tmp").write_text(json.dumps(pids))
    os.replace(f"{pid_file}.tmp", pid_file)  # whole when it appears


async def spawns_and_waits(task: dict[str, Any], client: Any, model: str, pid_file: str) -> float:
    """Starts a child process, writes the pids involved to `pid_file`, then waits forever."""
    child = subprocess.Popen(["sleep", "600"])
    _write_pids(pid_file, child=child.pid)
    await asyncio.Event().wait()
    return 0.0


async def scripted(task: dict[str, Any], client: Any, model: str) -> AgentResult:
    """What `task` says: with "pid_file", start a child process and write the pids there;
    with "wait", then wait forever; else return `task["reward"]` with what it saw of its
    process and of this module's state."""
    if "pid_file" in task:
        child = subprocess.Popen(["sleep", "600"])
        _write_pids(task["pid_file"], child=child.pid)
    if task.get("wait"):
        await asyncio.Event().wait()
    _CALLS.append(task.get("prompt_id", 0))
    seen = {"pid": os.getpid(), "imported_in": IMPORTED_IN, "calls": list(_CALLS)}
    return AgentResult(reward=float(task.get("reward", 1.0)), info=seen)


async def forks_and_exits(task: dict[str, Any], client: Any, model: str, pid_file: str) -> float:
    """Forks a copy that holds the agent process's pipes and lives on, then exits."""
    copy = os.fork()
    if copy == 0:
        time.sleep(600)
        os._exit(0)
    Path(pid_file).write_text(json.dumps({"copy": copy}))
    os._exit(4)
