"""The step driver in-process on the tiny model: the stages it runs, in order, and the
rollout engine put to sleep for every stage that does not generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import submit

from rftpipe.config.loader import load_config
from rftpipe.config.schema import RunConfig
from rftpipe.dist import Dist
from rftpipe.run import driver, executor
from rftpipe.run.runtime import build
from rftpipe.storage.layout import RunDir


class RecordingEngine:
    """The run's own rollout engine, with its sleep/wake calls written down."""

    def __init__(self, inner: Any, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls

    def sleep(self) -> None:
        self._calls.append("sleep")
        self._inner.sleep()

    def wake(self) -> None:
        self._calls.append("wake")
        self._inner.wake()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("dynamic", [False, True])
def test_engine_sleeps_outside_generation(
    dynamic: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ("rollout.dynamic_sampling.enabled=true",) if dynamic else ()
    run = RunDir(tmp_path / "run")
    ev = (
        "eval.size=4",
        "eval.every=1",
        "eval.holdout_fraction=0.2",
        "eval.metric=dense_even_tokens",
    )
    res = submit(run.root, *ev, *extra, extra=("--create-only",))
    assert res.returncode == 0, res.stderr
    rt = build(load_config(RunConfig, run.config_path), run, Dist())
    calls: list[str] = []
    rt.rollout_engine = RecordingEngine(rt.rollout_engine, calls)
    real = executor.execute

    def execute(rt, plan, stage, state) -> None:
        calls.append(stage.name)
        real(rt, plan, stage, state)

    monkeypatch.setattr(driver, "execute", execute)
    driver.run_step(rt, 1, {})
    # The dense reward varies in every group: one generation round even when dynamic.
    assert calls == [
        *("wake", "rollout", "sleep", "score"),
        *("sleep", "advantage", "sleep", "train", "wake", "sync", "wake", "eval"),
    ]
