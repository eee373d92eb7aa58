"""`rftpipe.faults.slow`, the stretched stages the Slurm tests aim their preemptions with."""

from __future__ import annotations

import pytest

from rftpipe import faults


@pytest.fixture
def slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    out: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", out.append)
    for key in ("RFTPIPE_SLOW", "RFTPIPE_SLOW_ALLOCATIONS", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    return out


def test_a_step_of_its_own_before_every_step(
    slept: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFTPIPE_SLOW", "score=3,score@2=7,train_replay@1=6")
    for stage, step in [("score", 1), ("score", 2), ("train", 2), ("train_replay", 1)]:
        faults.slow(stage, step)
    faults.slow("train_replay", 2)
    faults.slow("score")
    assert slept == [3.0, 7.0, 6.0, 3.0]


def test_only_the_first_allocations_are_stretched(
    slept: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RFTPIPE_SLOW", "rollout=9")
    monkeypatch.setenv("RFTPIPE_SLOW_ALLOCATIONS", "1")
    faults.slow("rollout", 1)  # no SLURM_RESTART_COUNT: the first allocation
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    faults.slow("rollout", 1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    faults.slow("rollout", 1)
    monkeypatch.setenv("RFTPIPE_SLOW_ALLOCATIONS", "2")
    faults.slow("rollout", 1)
    assert slept == [9.0, 9.0, 9.0]
