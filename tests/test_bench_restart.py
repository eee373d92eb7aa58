"""tools.bench restart: its helpers, and one tiny end-to-end run of the tool."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.restart import first_event, parse_steps, read_events, report, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_parse_steps_sorts_and_rejects_bad_lists():
    assert parse_steps("1000,10,100,10") == [10, 100, 1000]
    for bad in ("", "0,5", "ten"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_steps(bad)


def test_read_events_from_offset_skips_a_torn_line(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1.0, "event": "start"}\n')
    offset = path.stat().st_size
    with open(path, "a") as f:
        f.write(
            '{"t": 2.0, "event": "start"}\n{"t": 3.0, "event": "stage_begin", "step": 5, "stage": "rollout"}\n'
        )
        f.write('{"t": 4.0, "event": "stage_be')
    new = read_events(path, offset)
    assert [e["t"] for e in new] == [2.0, 3.0]
    assert first_event(new, "start") == 2.0
    assert first_event(new, "stage_begin", 5, stage="rollout") == 3.0
    assert first_event(new, "stage_begin", 5, stage="score") is None
    assert first_event(new, "stage_begin", 6, stage="rollout") is None
    assert read_events(tmp_path / "missing.jsonl") == []


def test_summarize_pairs_each_round_with_its_cold_start():
    builds = {10: {"files": 146, "bytes": 2_000_000, "build_s": 7.0}}
    cold = [{"to_rollout_s": 5.0, "to_start_s": 4.5}, {"to_rollout_s": 6.0, "to_start_s": 5.5}]
    restarts = {
        10: [{"to_rollout_s": 6.0, "to_start_s": 5.8}, {"to_rollout_s": 9.0, "to_start_s": 8.6}]
    }
    s = summarize(builds, cold, restarts)
    r = s["restart"]["10"]
    assert s["cold_start_s"] == 5.5
    assert r["restart_s"] == 7.5
    assert r["overhead_s"] == pytest.approx(2.0)  # median of 1.0 and 3.0
    assert r["ratio_to_cold"] == pytest.approx((6 / 5 + 9 / 6) / 2)
    assert r["start_to_rollout_s"] == pytest.approx(0.3)
    assert "146" in report(s)


@pytest.mark.slow
def test_tool_end_to_end(tmp_path: Path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "tools.bench", "restart", "--steps", "2", "--repeats", "1"]
        + ["--no-drop-caches", "--out", str(out), "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["settings"]["steps"] == [2]
    assert data["settings"]["drop_caches"] is False
    s = data["summary"]
    assert s["cold_start_s"] > 0
    r = s["restart"]["2"]
    for key in ("restart_s", "to_start_s", "ratio_to_cold", "overhead_s", "build_s", "files"):
        assert key in r
    assert r["restart_s"] >= r["to_start_s"] > 0
    assert data["builds"]["2"]["steps"] == 2
    assert len(data["runs"]["restart"]["2"]) == 1
    # The built runs and per-repeat copies are gone unless --keep-runs.
    assert not (out / "runs").exists() and not (out / "scratch").exists()
    assert "restart/cold" in res.stdout
    assert "restart/cold" in (tmp_path / "r.md").read_text()  # the report beside the JSON
