"""Environments in worker processes (`rollout.env.workers`): the same answers as in the
rollout process, a call past its timeout really stopped (its worker killed and the other
environments rebuilt by replay), and no worker outliving the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from envs_toy import EvenChars
from helpers import ROOT, alive

from rftpipe.config.schema import EnvConfig
from rftpipe.envs.base import StepResult, Task
from rftpipe.envs.pool import EnvPool, EnvTimeout, step_all

TASK = Task(prompt_id=1, messages=[{"role": "user", "content": "go"}])

# Timeouts of 2-3 s, and worker deaths within seconds: one at a time.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def _tests_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers import the environments from tests/ (they take the parent's sys.path).
    monkeypatch.syspath_prepend(str(ROOT / "tests"))


def _as_result(answer: object) -> StepResult:
    assert isinstance(answer, dict), answer
    return StepResult(**answer)


def test_workers_answer_as_the_rollout_process_does() -> None:
    pool = EnvPool(EnvConfig(path="envs_toy:EvenChars"), workers=2, timeout_s=30)
    try:
        remote = [pool.make() for _ in range(4)]
        local = [EvenChars() for _ in range(4)]
        for i, (r, loc) in enumerate(zip(remote, local, strict=True)):
            assert r.reset(TASK, i) == tuple(loc.reset(TASK, i))
        for turn in range(3):
            actions = [f"abc{turn}{i}" for i in range(4)]
            got = step_all([(r, a) for r, a in zip(remote, actions, strict=True)])
            want = step_all([(loc, a) for loc, a in zip(local, actions, strict=True)])
            assert [_as_result(g) for g in got] == want
        assert len({pool.records[r.env_id].worker for r in remote}) == 2  # spread out
        for r in remote:
            r.close()
        assert not pool.records
    finally:
        pool.close()


@pytest.mark.slow
def test_a_call_past_its_timeout_is_stopped_and_the_others_rebuilt() -> None:
    pool = EnvPool(EnvConfig(path="envs_toy:HangsOnEvenSeeds"), workers=1, timeout_s=3)
    try:
        envs = [pool.make() for _ in range(3)]
        for seed, env in enumerate(envs):  # seeds 0 and 2 hang on their second step
            env.reset(TASK, seed)
        first = step_all([(env, "aaaa") for env in envs])
        assert all(isinstance(a, dict) for a in first)
        pid = pool.workers[0].proc.pid
        t0 = time.monotonic()
        second = step_all([(env, "bbbb") for env in envs])
        took = time.monotonic() - t0
        assert isinstance(second[0], EnvTimeout) and "timeout_s=3" in str(second[0])
        # Seed 1 ran in the replacement worker, rebuilt by replaying its first step; then
        # seed 2 timed out there too: two timeouts of 3 s, not 600.
        assert _as_result(second[1]).info == {"turn": 2}
        assert isinstance(second[2], EnvTimeout)
        assert took < 60, took
        assert pool.workers[0].proc.pid != pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # A lost environment stays lost; the rebuilt one goes on from its state.
        third = step_all([(envs[0], "c"), (envs[1], "c")])
        assert isinstance(third[0], EnvTimeout)
        assert _as_result(third[1]).info == {"turn": 3}
    finally:
        pool.close()


@pytest.mark.slow
def test_a_rows_environment_is_made_and_rebuilt_as_its_own() -> None:
    """Environments a row's `env_class` names live in the pool beside its own; one rebuilt
    after another's timeout is rebuilt as the class it was made as, not the pool's."""
    pool = EnvPool(EnvConfig(path="envs_toy:EvenChars"), workers=1, timeout_s=2)
    try:
        stops = pool.make(EnvConfig(path="envs_toy:StopsOnA"))
        hangs = pool.make(EnvConfig(path="envs_toy:HangsOnEvenSeeds"))
        assert (stops.class_name, hangs.class_name) == ("StopsOnA", "HangsOnEvenSeeds")
        stops.reset(TASK, 1)
        hangs.reset(TASK, 0)  # an even seed: its second step hangs
        assert all(isinstance(a, dict) for a in step_all([(stops, "xyz"), (hangs, "xyz")]))
        lost, rebuilt = step_all([(hangs, "b"), (stops, "a")])
        assert isinstance(lost, EnvTimeout)
        # Rebuilt in the new worker as StopsOnA (replaying its first step): an `a` ends it.
        assert _as_result(rebuilt) == StepResult(
            observations=[], reward=1.0, done=True, info={"turn": 2}
        )
    finally:
        pool.close()


SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from rftpipe.config.schema import EnvConfig
from rftpipe.envs.pool import EnvPool
pool = EnvPool(EnvConfig(path="envs_toy:EvenChars"), workers=2, timeout_s=30)
print(*[w.proc.pid for w in pool.workers], flush=True)
os.kill(os.getpid(), 9)
"""


def test_no_worker_outlives_a_killed_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    left = pids
    while left and time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        time.sleep(0.1)
    assert not left, left
