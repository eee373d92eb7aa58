"""rftpipe.run.roles: each role's busy and idle seconds between two logged steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rftpipe.run import roles


def test_stages_count_for_their_role() -> None:
    assert roles.role_of("rollout") == roles.role_of("score.r1") == "generation"
    assert roles.role_of("rollout.t2") == "generation"
    assert {roles.role_of(s) for s in ("advantage", "train", "sync", "eval")} == {"training"}


def test_busy_and_idle_in_this_process() -> None:
    """A 0.2 s interval in which training computed 0.05 s: 0.15 s idle; generation
    computed nothing: idle the whole interval."""
    view = roles.Roles(None)
    time.sleep(0.2)
    roles.clock().add("train", 0.05)
    f = view.step_figures()
    assert f["perf/training_busy_s"] == pytest.approx(0.05)
    assert f["perf/training_idle_s"] == pytest.approx(f["perf/generation_idle_s"] - 0.05)
    assert f["perf/generation_busy_s"] == 0.0 and f["perf/generation_idle_s"] >= 0.2


def test_generation_on_other_ranks_is_read_from_their_clock_file(tmp_path: Path) -> None:
    (tmp_path / roles.CLOCK_FILE).write_text(json.dumps({"busy_s": 10.0, "t": 100.0}))
    view = roles.Roles(tmp_path)
    (tmp_path / roles.CLOCK_FILE).write_text(json.dumps({"busy_s": 13.0, "t": 104.0}))
    f = view.step_figures()
    assert f["perf/generation_busy_s"] == 3.0 and f["perf/generation_idle_s"] == 1.0
    # Unreadable (mid-replace on a shared file system): nothing grew.
    (tmp_path / roles.CLOCK_FILE).unlink()
    f = view.step_figures()
    assert f["perf/generation_busy_s"] == 0.0 and f["perf/generation_idle_s"] == 0.0
