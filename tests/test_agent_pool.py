"""Agent processes (`rftpipe.agents.pool`): what an agent returns or how it fails comes back
as one event per episode, a killed episode takes its child processes along and sends
nothing (even when its reply was on its way), a SIGKILLed run leaves no agent process
behind (nor the zygote, nor what the agent's module started), episodes are forked from a
zygote that imported the agent's module once (and one that fails to import fails each
episode), and another interpreter gets none of the trainer's packages. The agents
(tests/agents_toy.py, and modules written here) call no endpoint."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import alive

from rftpipe.agents import pool as agent_pool
from rftpipe.agents.pool import (
    AgentProcesses,
    AgentSpec,
    Failed,
    Finished,
    Started,
    isolated_sys_path,
)

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
URL = "http://127.0.0.1:9/v1"  # nothing listens: these agents call no endpoint
EVENT_S = 60.0
"""An upper bound on an agent process's start and end (openai alone imports in ~1 s)."""
GONE_S = 5.0
"""How long killed processes may take to disappear."""


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent processes import the agents from tests/ (they take the parent's sys.path).
    monkeypatch.syspath_prepend(str(TESTS))


def _collect(inbox: queue.Queue[Any], n: int) -> dict[int, Finished | Failed]:
    """The next `n` ends, by episode (one each); an agent that ran was `Started` first."""
    out: dict[int, Finished | Failed] = {}
    started: set[int] = set()
    deadline = time.monotonic() + EVENT_S
    while len(out) < n:
        event = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(event, Started):
            assert event.episode not in started | set(out), event
            started.add(event.episode)
            continue
        assert isinstance(event, Finished | Failed), event
        assert event.episode not in out, f"two events for episode {event.episode}"
        ran = isinstance(event, Finished) or event.kind in ("raised", "returned")
        assert not ran or event.episode in started, f"no Started before {event}"
        out[event.episode] = event
    return out


def _run(cases: dict[int, AgentSpec], task: dict[str, Any] | None = None) -> dict[int, Any]:
    """Each episode's event, its agent run with the spec given, all at once."""
    inbox: queue.Queue[Any] = queue.Queue()
    pools = [AgentProcesses(spec, inbox) for spec in cases.values()]
    try:
        for episode, pool in zip(cases, pools, strict=True):
            pool.start(episode, task or {"prompt_id": episode}, URL, "key", "policy")
        events = _collect(inbox, len(cases))
        for pool in pools:
            assert not pool.running()
    finally:
        for pool in pools:
            pool.close()
    assert set(events) == set(cases)
    return events


def _spec(name: str, **kwargs: Any) -> AgentSpec:
    return AgentSpec(path=f"agents_toy:{name}", kwargs=kwargs)


def _failed(event: Any, kind: str) -> str:
    assert isinstance(event, Failed), event
    assert event.kind == kind, event
    assert "\n" not in event.message
    return event.message


def _gone(pids: Sequence[int]) -> bool:
    deadline = time.monotonic() + GONE_S
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(pid_file: Path) -> dict[str, int]:
    deadline = time.monotonic() + EVENT_S
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.05)
    pids: dict[str, int] = json.loads(pid_file.read_text())
    assert all(alive(p) for p in pids.values()), pids
    return pids


def test_rewards_come_back_as_finished_by_episode() -> None:
    events = _run(
        {3: _spec("constant", reward=1.5), 4: _spec("echo"), 5: _spec("mapping")},
    )
    assert events[3] == Finished(episode=3, reward=1.5, info={})
    assert isinstance(events[4], Finished) and events[4].reward == 0.5
    assert events[5] == Finished(episode=5, reward=-2.0, info={"via": "mapping"})
    assert isinstance(events[5].reward, float)


def test_the_task_kwargs_and_client_reach_the_agent() -> None:
    task = {"prompt_id": 7, "messages": [{"role": "user", "content": "hi"}], "answer": None}
    kwargs = {"depth": 3, "tools": ["search"], "nested": {"a": 1.5}}
    (event,) = _run({0: _spec("echo", **kwargs)}, task=task).values()
    assert isinstance(event, Finished)
    assert event.info["task"] == task
    assert event.info["kwargs"] == kwargs
    assert event.info["model"] == "policy"
    # No retries of the client's own, no timeout: the stage bounds the agent's time.
    assert event.info["client"] == {
        "max_retries": 0,
        "timeout": None,
        "base_url": URL + "/",
        "api_key": "key",
    }


def test_an_agent_that_raises() -> None:
    (event,) = _run({0: _spec("raises")}).values()
    assert _failed(event, "raised") == "ValueError: no answer found"


def test_an_agent_that_returns_no_reward() -> None:
    events = _run(
        {
            0: _spec("returns", value="1.0"),
            1: _spec("returns", value=True),
            2: _spec("returns", value={"reward": 1, "score": 2}),
        }
    )
    assert _failed(events[0], "returned").startswith("returned str '1.0'")
    assert _failed(events[1], "returned").startswith("returned bool True")
    assert "'score'" in _failed(events[2], "returned")


def test_a_plain_function_is_refused_without_being_called(tmp_path: Path) -> None:
    marker = tmp_path / "called"
    (event,) = _run({0: _spec("not_async", marker=str(marker))}).values()
    assert "not an async function" in _failed(event, "not_async")
    assert not marker.exists()


def test_a_path_that_does_not_import() -> None:
    events = _run(
        {
            0: AgentSpec(path="agents_toy_nowhere:fn", kwargs={}),
            1: _spec("nowhere"),
            2: AgentSpec(path="agents_toy", kwargs={}),
        }
    )
    assert "No module named 'agents_toy_nowhere'" in _failed(events[0], "import")
    assert "has no attribute 'nowhere'" in _failed(events[1], "import")
    assert "module:function" in _failed(events[2], "import")


def test_an_agent_process_that_exits_died(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    events = _run({0: _spec("exits"), 1: _spec("forks_and_exits", pid_file=str(pid_file))})
    assert "exited with code 3" in _failed(events[0], "died")
    # A forked copy holding the agent process's pipes neither delays the report nor outlives
    # the episode.
    assert "exited with code 4" in _failed(events[1], "died")
    assert _gone([json.loads(pid_file.read_text())["copy"]])


def test_kill_takes_the_agents_children_along_and_sends_nothing(tmp_path: Path) -> None:
    inbox: queue.Queue[Any] = queue.Queue()
    waits = AgentProcesses(_spec("spawns_and_waits", pid_file=str(tmp_path / "0")), inbox)
    other = AgentProcesses(_spec("constant"), inbox)
    try:
        waits.start(0, {}, URL, "key", "policy")
        other.start(2, {}, URL, "key", "policy")
        pids = _pids(tmp_path / "0")
        assert waits.running() == {0}
        waits.kill(0)
        assert not waits.running()
        episode = [pids["agent"], pids["child"], pids["supervisor"]]
        assert _gone(episode), pids
        assert alive(pids["zygote"]) and alive(pids["keeper"])  # for the next episodes
        # The other episode's event comes; none for the killed one, then or later.
        assert _collect(inbox, 1) == {2: Finished(episode=2, reward=1.0, info={})}
        late = []  # the killed one's Started may come after the other's end
        with contextlib.suppress(queue.Empty):
            while True:
                late.append(inbox.get(timeout=0.5))
        assert late in ([], [Started(episode=0)]), late
        waits.kill(0)  # no longer running: nothing to do
    finally:
        waits.close()
        other.close()


def test_close_kills_every_agent_and_is_final(tmp_path: Path) -> None:
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(_spec("spawns_and_waits", pid_file=str(tmp_path / "1")), inbox)
    pool.start(1, {}, URL, "key", "policy")
    pids = _pids(tmp_path / "1")
    pool.close()
    assert _gone(list(pids.values())), pids
    pool.close()  # idempotent
    with pytest.raises(RuntimeError):
        pool.start(2, {}, URL, "key", "policy")
    assert inbox.get_nowait() == Started(episode=1) and inbox.empty()  # and no end


def test_a_sigkilled_run_takes_its_agents_and_their_children_along(tmp_path: Path) -> None:
    # The agent's module starts a process when imported (in the zygote): it goes too.
    (tmp_path / "agents_toy_spawns_at_import.py").write_text(
        f"""
import subprocess
from pathlib import Path
from agents_toy import spawns_and_waits
_child = subprocess.Popen(["sleep", "600"])
Path({str(tmp_path / "import_child")!r}).write_text(str(_child.pid))
"""
    )
    pid_file = tmp_path / "pids"
    run = f"""
import queue, sys, time
sys.path[:0] = [{str(TESTS)!r}, {str(tmp_path)!r}]
from rftpipe.agents.pool import AgentProcesses, AgentSpec
spec = AgentSpec(
    path="agents_toy_spawns_at_import:spawns_and_waits",
    kwargs={{"pid_file": {str(pid_file)!r}}},
)
AgentProcesses(spec, queue.Queue()).start(0, {{}}, {URL!r}, "key", "policy")
time.sleep(600)
"""
    parent = subprocess.Popen([sys.executable, "-c", run], cwd=ROOT)
    try:
        pids = _pids(pid_file)
        pids["import_child"] = int((tmp_path / "import_child").read_text())
        assert alive(pids["import_child"])
        assert parent.pid not in pids.values()
        assert len(set(pids.values())) == len(pids), pids
    finally:
        parent.kill()
        parent.wait()
    # The agent, its child, its supervisor, the zygote and its keeper, and what the
    # module's import started.
    assert _gone(list(pids.values())), pids


def _module(tmp_path: Path, name: str, source: str) -> str:
    """Write an agent module `name` into tmp_path, which the agent processes' path holds."""
    (tmp_path / f"{name}.py").write_text(source)
    return name


def test_episodes_fork_from_the_module_as_imported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    # Printed at import, and still in the zygote's buffer: each copy must not print it again.
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    name = _module(
        tmp_path,
        "agents_toy_prints_at_import",
        "print('imported agents_toy_prints_at_import')\nfrom agents_toy import scripted\n",
    )
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(AgentSpec(path=f"{name}:scripted", kwargs={}), inbox)
    try:
        for episode in range(3):
            pool.start(episode, {"prompt_id": episode}, URL, "key", "policy")
        events = _collect(inbox, 3)
        pool.start(3, {"prompt_id": 3}, URL, "key", "policy")  # after the others ended
        events |= _collect(inbox, 1)
    finally:
        pool.close()
    infos = [e.info for e in events.values() if isinstance(e, Finished)]
    assert len(infos) == 4, events
    # Imported once, by the zygote, which forked each episode's process ...
    (zygote,) = {info["imported_in"] for info in infos}
    assert zygote != os.getpid()
    assert all(info["pid"] != zygote for info in infos)
    assert len({info["pid"] for info in infos}) == 4
    # ... a copy of the module's state as imported: what one episode changed, no other saw.
    assert sorted(tuple(info["calls"]) for info in infos) == [(0,), (1,), (2,), (3,)]
    assert capfd.readouterr().out.count("imported agents_toy_prints_at_import") == 1


def test_a_module_that_does_not_import_fails_every_episode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    imports = tmp_path / "imports"
    name = _module(
        tmp_path,
        "agents_toy_broken",
        f"""
with open({str(imports)!r}, "a") as f:
    f.write("imported\\n")
raise RuntimeError("no config file")
""",
    )
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(AgentSpec(path=f"{name}:fn", kwargs={}), inbox)
    try:
        for episode in range(3):
            pool.start(episode, {}, URL, "key", "policy")
        events = _collect(inbox, 3)
        pool.start(3, {}, URL, "key", "policy")  # after the failure is known: at once
        events |= _collect(inbox, 1)
        assert not pool.running()
    finally:
        pool.close()
    for event in events.values():
        message = _failed(event, "import")
        assert message == f"cannot import {name}: RuntimeError: no config file"
    assert imports.read_text() == "imported\n"  # once, by the zygote


def test_a_module_that_starts_a_thread_is_imported_by_each_episode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process with threads cannot be forked safely: the zygote goes on without the module.
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _module(
        tmp_path,
        "agents_toy_thread",
        """
import os, threading, time
IMPORTED_IN = os.getpid()
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()

async def fn(task, client, model):
    return {"reward": 1.0, "info": {"imported_in": IMPORTED_IN, "pid": os.getpid()}}

def plain(task, client, model):
    return 1.0
""",
    )
    events = _run(
        {
            0: AgentSpec(path=f"{name}:fn", kwargs={}),
            1: AgentSpec(path=f"{name}:fn", kwargs={}),
            2: AgentSpec(path=f"{name}:plain", kwargs={}),
        }
    )
    for episode in (0, 1):
        event = events[episode]
        assert isinstance(event, Finished), event
        assert event.info["imported_in"] == event.info["pid"]  # imported by the episode
    assert "not an async function" in _failed(events[2], "not_async")


def test_a_kill_racing_the_agents_reply_puts_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reply is read; the episode is killed before its event is put.
    read, go = threading.Event(), threading.Event()
    replies: list[bytes | None] = []

    def held(reader: Any) -> bytes | None:
        replies.append(real(reader))
        read.set()
        assert go.wait(EVENT_S)
        return replies[-1]

    real = agent_pool._read_reply
    monkeypatch.setattr(agent_pool, "_read_reply", held)
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(_spec("mapping"), inbox)
    try:
        pool.start(0, {}, URL, "key", "policy")
        assert read.wait(EVENT_S)
        assert inbox.get_nowait() == Started(episode=0)
        assert replies[0] is not None and b"finished" in replies[0]
        assert pool.running() == {0}
        pool.kill(0)
        assert not pool.running()
        go.set()
        with pytest.raises(queue.Empty):
            inbox.get(timeout=0.5)
        # The pool goes on: the next episode's reply is its event.
        read.clear()
        pool.start(0, {}, URL, "key", "policy")
        assert _collect(inbox, 1) == {0: Finished(episode=0, reward=-2.0, info={"via": "mapping"})}
    finally:
        go.set()
        pool.close()


def test_a_dead_zygote_fails_its_episodes_and_another_one_starts(tmp_path: Path) -> None:
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(_spec("scripted"), inbox)
    try:
        pool.start(0, {"pid_file": str(tmp_path / "0"), "wait": True}, URL, "key", "policy")
        pids = _pids(tmp_path / "0")
        os.kill(pids["zygote"], signal.SIGKILL)
        (event,) = _collect(inbox, 1).values()
        assert "died without a result (its zygote exited)" in _failed(event, "died")
        assert not pool.running()
        assert _gone(list(pids.values())), pids
        pool.start(1, {"reward": 2.0}, URL, "key", "policy")
        (event,) = _collect(inbox, 1).values()
        assert isinstance(event, Finished) and event.reward == 2.0
        assert event.info["imported_in"] != pids["zygote"]
    finally:
        pool.close()


def test_another_interpreter_gets_none_of_the_trainers_packages(tmp_path: Path) -> None:
    # A bare venv (no pip, no openai): openai imports in the run, so it must not leak in.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    spec = AgentSpec(path="agents_toy:constant", kwargs={}, python=python)
    inbox: queue.Queue[Any] = queue.Queue()
    pool = AgentProcesses(spec, inbox)
    try:
        pool.start(0, {}, URL, "key", "policy")
        (event,) = _collect(inbox, 1).values()
    finally:
        pool.close()
    message = _failed(event, "import")
    assert message.startswith(f"openai does not import in the agent's interpreter {python} ")
    assert "No module named 'openai'" in message


def test_another_interpreters_path_leaves_out_installed_packages(tmp_path: Path) -> None:
    path = [
        "",
        "/home/u/project",
        "/venv/lib/python3.11/site-packages",
        "/venv/src/editable-dep",
        "/base/lib/python311.zip",
        "/base/lib/python3.11",
        "/usr/lib/python3/dist-packages",
        "/opt/other/site-packages/pkg.egg",
        "/home/u/project",
    ]
    assert isolated_sys_path(path, prefixes=["/venv", "/base"], package_root="/pkgroot") == [
        "",
        "/home/u/project",
        "/pkgroot",
    ]
    # This run's own path: its installations go, its user entries stay.
    own = isolated_sys_path(
        [*sys.path, str(TESTS)], prefixes=[sys.prefix, sys.base_prefix], package_root="/r"
    )
    assert str(TESTS) in own and own[-1] == "/r"
    assert not any("site-packages" in p or p.startswith(sys.base_prefix) for p in own if p)
