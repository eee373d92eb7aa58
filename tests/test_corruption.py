"""Corrupt committed files: the newest stage is redone identically; older ones refuse or repair."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import ROOT, events, final_weights, submit, trajectories

from rftpipe.space import EXIT_NO_SPACE

pytestmark = pytest.mark.slow
STEPS = ("total_steps=4",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("corrupt") / "ref"
    assert submit(run, *STEPS).returncode == 0
    return run


def _same_as_reference(run: Path, reference: Path) -> None:
    assert trajectories(run).equals(trajectories(reference))
    a, b = final_weights(run), final_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_newest_stage_is_redone_with_identical_rows(
    reference: Path, tmp_path: Path, damage: str
) -> None:
    run = tmp_path / "run"
    # stage_after_commit hit 7 is the score stage of step 2: kill right after it commits.
    res = submit(
        run, *STEPS, env={"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "6"}
    )
    assert res.returncode != 0
    shard = run / "stages" / "step=2" / "score" / "part-r0.parquet"
    original = pq.read_table(shard)
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 3])
    else:
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(flipped))
    res = submit(run, *STEPS)
    assert res.returncode == 0, res.stderr
    redo = [e for e in events(run) if e["event"] == "redo_corrupt_stage"]
    assert [(e["step"], e["stage"]) for e in redo] == [(2, "score")]
    assert pq.read_table(shard).equals(original)
    _same_as_reference(run, reference)


def test_corrupt_older_stage_repair_rolls_back_and_recomputes(
    reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    # Without the step-4 checkpoint, the restart replays steps 3-4 from their advantage rows.
    shutil.rmtree(run / "checkpoints" / "step=4")
    shard = run / "stages" / "step=3" / "advantage" / "part-r0.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    refused = submit(run, config=None)
    assert refused.returncode == 2 and str(shard) in refused.stderr
    # A spent quota (issue 51) stops the repair with one line naming the quarantine,
    # before it has moved anything (a full file system cannot stop it: renames and a
    # tmpfs's directories take no space).
    spent = submit(run, config=None, extra=("--repair",), env={"RFTPIPE_FAULT_QUOTA": "quarantine"})
    assert spent.returncode == EXIT_NO_SPACE, spent.stderr[-3000:]
    (line,) = spent.stderr.strip().splitlines()
    assert f"disk quota exceeded writing {run}/quarantine/" in line, line
    assert shard.exists() and not list((run / "quarantine").glob("*/*"))
    repaired = submit(run, config=None, extra=("--repair",))
    assert repaired.returncode == 0, repaired.stderr
    assert any(e["event"] == "repair" and e["from_step"] == 3 for e in events(run))
    assert list((run / "quarantine").glob("*/stages/step=3"))
    _same_as_reference(run, reference)


def test_restart_reads_no_stage_before_its_checkpoint_and_verify_finds_it(
    reference: Path, tmp_path: Path
) -> None:
    """Restart work does not grow with the run: a corrupt stage older than the checkpoint is
    never read by it; `rftpipe.inspect verify` (off the critical path) reports it."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shard = run / "stages" / "step=1" / "rollout" / "part-r0.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    res = submit(run, "total_steps=5", config=None)
    assert res.returncode == 0, res.stderr
    verify = _inspect_verify(run)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert str(shard) in verify.stdout
    shard.unlink()
    shutil.copy2(reference / "stages" / "step=1" / "rollout" / "part-r0.parquet", shard)
    clean = _inspect_verify(run)
    assert clean.returncode == 0, clean.stdout + clean.stderr


def _inspect_verify(run: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rftpipe.inspect", str(run), "verify"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)


@pytest.mark.tier1
def test_corrupt_newest_checkpoint_falls_back_and_replays(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = sorted((run / "checkpoints").glob("step=*"))[-1]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    (run / "export").rename(run / "export-old")
    res = submit(run, config=None)
    assert res.returncode == 0, res.stderr
    ev = events(run)
    assert any(e["event"] == "corrupt_checkpoint" for e in ev)
    assert any(e["event"] == "replay" for e in ev)
    _same_as_reference(run, reference)


def test_checkpoint_past_total_steps_without_its_stages_is_refused(
    reference: Path, tmp_path: Path
) -> None:
    """Lost stage files hide the committed steps from the `total_steps` check; the step-4
    checkpoint still shows them, and a run to 3 steps has nothing left to do."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "stages")
    refused = submit(run, "total_steps=3")
    assert refused.returncode == 2, refused.stderr
    assert "total_steps: 3 is below the checkpoint of step 4" in refused.stderr
