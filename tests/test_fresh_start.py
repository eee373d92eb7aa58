"""A run directory that committed nothing takes the next command's config, model and data
(a start refused at load, or killed before its first commit, blocks nothing); one with any
committed stage, trajectory or checkpoint, or with a live worker, is refused as before."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY, committed_hash, events, submit, trajectories

pytestmark = pytest.mark.slow


def _dataset(path: Path, offset: int) -> Path:
    """Twelve addition prompts in a `question` column (not the default `prompt`)."""
    rows = [{"question": f"{i + offset} + 1 =", "answer": str(i + offset + 1)} for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _on(data: Path, column: str = "question") -> tuple[str, ...]:
    return (
        "total_steps=1",
        "data.source=datasets",
        f"data.datasets=[{{path: {data}, prompt_column: {column}}}]",
    )


def _one_line(res: subprocess.CompletedProcess, *needles: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr[-3000:])
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def _started_once(run: Path) -> None:
    """The run's event log is the new run's alone: one start, no earlier refusal or kill."""
    names = [e["event"] for e in events(run)]
    assert names.count("start") == 1 and "user_error" not in names and "fault" not in names


def test_a_refused_start_does_not_block_the_corrected_command(tmp_path: Path) -> None:
    data = _dataset(tmp_path / "data.jsonl", 0)
    run = tmp_path / "run"
    _one_line(submit(run, *_on(data, "prompt")), "'prompt'")
    assert (run / "config.yaml").exists() and (run / "events.jsonl").exists()

    out = submit(run, *_on(data))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "prompt_column: question" in (run / "config.yaml").read_text()
    assert {r["prompt"] for r in trajectories(run).to_pylist()} <= {f"{i} + 1 =" for i in range(12)}
    _started_once(run)
    # The refused start's files are kept aside for diagnosis, and nothing reads them.
    (earlier,) = (run / "superseded").iterdir()
    assert "prompt_column: prompt" in (earlier / "config.yaml").read_text()
    assert "user_error" in (earlier / "events.jsonl").read_text()


def test_a_start_killed_before_its_first_commit_takes_the_new_data(tmp_path: Path) -> None:
    """The kill leaves run.json with the first data's fingerprint; the same command on
    corrected data (the same config: a restart, its event log kept) records the new data
    instead of refusing it as changed."""
    data = _dataset(tmp_path / "data.jsonl", 0)
    run = tmp_path / "run"
    killed = submit(run, *_on(data), env={"RFTPIPE_FAULT": "shard_after_rename"})
    assert killed.returncode != 0 and (run / "run.json").exists()
    assert not list((run / "stages").glob("*/*/MANIFEST.json"))
    before = json.loads((run / "run.json").read_text())["data_fingerprint"]

    _dataset(data, 100)
    out = submit(run, *_on(data))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "run.json").read_text())["data_fingerprint"] != before
    assert {r["prompt"] for r in trajectories(run).to_pylist()} <= {
        f"{i} + 1 =" for i in range(100, 112)
    }
    replaced = [e["keys"] for e in events(run) if e["event"] == "fingerprints_replaced"]
    assert replaced == [["data_fingerprint"]]


def _stage(run: Path) -> None:
    # A real one: tests/test_reward_e2e.py::test_how_hard_scoring_tries_may_change_on_resume
    # kills a run right after its first commit and is refused a changed url.
    (run / "stages" / "step=1" / "rollout").mkdir(parents=True)
    (run / "stages" / "step=1" / "rollout" / "MANIFEST.json").write_text("{}")


def _checkpoint(run: Path) -> None:
    (run / "checkpoints" / "step=1").mkdir(parents=True)


def _trajectory(run: Path) -> None:
    (run / "trajectories" / "step=1").mkdir(parents=True)


def _quarantine(run: Path) -> None:
    (run / "quarantine" / "20261127-120000" / "stages" / "step=1").mkdir(parents=True)


def _older_spelling(run: Path) -> None:
    # Run layout 1 spelled steps three ways; its commits must count too.
    (run / "stages" / "step_0001" / "rollout").mkdir(parents=True)
    (run / "stages" / "step_0001" / "rollout" / "MANIFEST.json").write_text("{}")


def _older_layout(run: Path) -> None:
    (run / "run.json").write_text(json.dumps({"schema_version": 1}))


@pytest.mark.tier1
def test_any_committed_work_keeps_the_config_check(tmp_path: Path) -> None:
    """Which directories count as holding work, told by `jobs.submit` alone (it writes the
    config and exits with --create-only): the directory without a mark takes the changed
    config, and each mark alone makes it refuse as a resume."""
    made = tmp_path / "made"
    assert submit(made, extra=("--create-only",)).returncode == 0
    before = (made / "config.yaml").read_bytes()
    for mark in (_stage, _checkpoint, _trajectory, _quarantine, _older_spelling, _older_layout):
        run = tmp_path / mark.__name__
        shutil.copytree(made, run)
        mark(run)
        res = submit(run, "rollout.n=8", config=None, extra=("--create-only",))
        _one_line(res, "different config", "rollout.n")
        assert (run / "config.yaml").read_bytes() == before, mark.__name__
    res = submit(made, "rollout.n=8", config=None, extra=("--create-only",))
    assert res.returncode == 0, res.stderr
    assert "\n  n: 8\n" in (made / "config.yaml").read_text()


def test_a_live_run_is_not_started_afresh_under_it(tmp_path: Path) -> None:
    """A worker in its first rollout has committed nothing yet; a second command on its
    directory must not move its files."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    with (tmp_path / "live.log").open("wb") as sink:
        live = subprocess.Popen(
            [*cmd, "--config", str(TINY), "total_steps=1"],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RFTPIPE_SLOW": "rollout=60"},
        )
    try:
        deadline = time.time() + 120
        while not any(e["event"] == "start" for e in events(run)):
            assert live.poll() is None and time.time() < deadline, "the worker never started"
            time.sleep(0.1)
        before = [(run / n).read_bytes() for n in ("config.yaml", "run.json")]
        _one_line(submit(run, "rollout.n=8"), "a run is live", str(run))
        assert [(run / n).read_bytes() for n in ("config.yaml", "run.json")] == before
        assert not (run / "superseded").exists() and live.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(live.pid, signal.SIGKILL)
        live.wait()


def test_a_run_directory_inside_another_run_or_on_a_file_is_refused(tmp_path: Path) -> None:
    """Inside a run, the run's next start would sweep the new one away; a file is no
    directory. Each is one line, exit 2, and the run around it is untouched."""
    run = tmp_path / "run"
    assert submit(run, "total_steps=1").returncode == 0
    before = committed_hash(run)
    for bad, said in (
        (run / "stages" / "nested", f"is inside the run directory {run}"),
        (run / "config.yaml", "is a file, not a directory"),
    ):
        line = _one_line(submit(bad, "total_steps=1"), f"--run-dir: {bad} {said}")
        assert line.startswith("rftpipe: error: "), line
    assert committed_hash(run) == before
    assert not (run / "stages" / "nested").exists()
