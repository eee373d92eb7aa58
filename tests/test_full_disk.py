"""A run driven into a full file system or a spent quota, for real (issue 51, item 1).

Each run lives on a small tmpfs in an unprivileged user and mount namespace
(tools/testing/small_fs.py), so this runs without root. A full disk is made by filling the
file system (a ballast file) while the target stage is stretched (`RFTPIPE_SLOW`), so its
next write finds no space; a quota (`EDQUOT`, which no file system here can be given without
root) by the fault point `RFTPIPE_FAULT_QUOTA` in the write helpers, which raises the real
OSError on the same path. At each: one line on stderr naming the path and the free bytes,
exit status 75, `rftpipe inspect RUN verify` clean, no temporary file left; then with the
space back, the same command resumes and ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import helpers
import pytest
import torch
from helpers import ROOT, TINY, final_weights, submit, trajectories
from safetensors.torch import load_file

from rftpipe.space import EXIT_NO_SPACE
from tools.testing.small_fs import BALLAST, SmallFS

pytestmark = [pytest.mark.slow]
STEPS = ("total_steps=4",)
SIZE = 64 << 20  # a tiny run writes about 4 MiB


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("full_disk_ref") / "run"
    out = submit(run, *STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFS]:
    with helpers.small_fs(tmp_path / "fs", SIZE) as fs:
        yield fs


def _submit(fs: SmallFS, run: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`jobs.submit` inside the namespace (its ranks too: no warm forks from outside it)."""
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(TINY), *STEPS, *extra]
    full = {**os.environ, "RFTPIPE_WORKER_VIA": "", **(env or {})}
    return fs.popen(
        cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _events(fs: SmallFS, run: Path) -> list[dict]:
    out = fs.run(["cat", str(run / "events.jsonl")])
    return [json.loads(x) for x in out.stdout.splitlines() if x.endswith("}")]


def _when_begun(
    fs: SmallFS, run: Path, step: int, stage: str, then: Callable[[], object]
) -> threading.Thread:
    """Call `then()` once `step`'s `stage` has begun (in a thread)."""

    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if any(
                e["event"] == "stage_begin" and (e["step"], e["stage"]) == (step, stage)
                for e in _events(fs, run)
            ):
                then()
                return
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _fill_when(fs: SmallFS, run: Path, step: int, stage: str, leave: int) -> threading.Thread:
    """Fill the file system (leaving `leave` bytes) once `step`'s `stage` has begun."""
    return _when_begun(fs, run, step, stage, lambda: fs.fill(leave))


def _stopped_for_space(proc: subprocess.Popen, *named: str) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_NO_SPACE, (proc.returncode, out[-2000:], err[-3000:])
    # wandb prints its own banner on stderr (`wandb: ...`); the run's own is one line.
    (line,) = [x for x in err.strip().splitlines() if not x.startswith("wandb: ")]
    assert line.startswith("rftpipe: error: ") and " bytes" in line and "free on its" in line
    for part in named:
        assert part in line, line
    return line


def _verify_clean(fs: SmallFS, run: Path) -> None:
    out = fs.run([sys.executable, "-m", "rftpipe.inspect", str(run), "verify"], cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    left = fs.run(["find", str(run), "-name", ".tmp-*", "-not", "-path", "*/checkpoints/*"])
    assert left.stdout.strip() == "", left.stdout


def _resumes_bitwise(fs: SmallFS, run: Path, reference: Path, tmp_path: Path) -> None:
    proc = _submit(fs, run)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    fs.copy_out(run, tmp_path / "copy")
    copy = tmp_path / "copy"
    assert trajectories(copy).equals(trajectories(reference))
    wa, wb = final_weights(reference), final_weights(copy)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.tier1
def test_a_full_disk_at_a_stage_shard_stops_with_one_line_and_resumes(
    small_fs: SmallFS, reference: Path, tmp_path: Path
) -> None:
    run = small_fs.mountpoint / "run"
    proc = _submit(small_fs, run, env={"RFTPIPE_SLOW": "score@2=4"})
    _fill_when(small_fs, run, 2, "score", leave=0)
    line = _stopped_for_space(proc, f"no space left on device writing {run}/stages/step=2/score")
    free = int(re.search(r": (\d+) bytes", line)[1])
    assert free < 1 << 20, line  # what the failed write gave back when it deleted its file
    _verify_clean(small_fs, run)
    manifest = run / "stages/step=2/score/MANIFEST.json"
    assert small_fs.run(["test", "-e", str(manifest)]).returncode == 1
    small_fs.empty_ballast()
    _resumes_bitwise(small_fs, run, reference, tmp_path)


@pytest.mark.parametrize(
    ("part", "named"),
    [
        ("step=3/rollout/MANIFEST.json", "stages/step=3/rollout/MANIFEST.json"),
        ("events.jsonl", "events.jsonl"),
        ("metrics.jsonl", "metrics.jsonl"),
        (".tmp-step=2", "checkpoints/.tmp-step=2/extra-r0.pt"),
        ("/.tmp-export", ".tmp-export"),
    ],
)
def test_a_spent_quota_stops_with_one_line_and_resumes(
    small_fs: SmallFS, reference: Path, tmp_path: Path, part: str, named: str
) -> None:
    """`EDQUOT` at the first write of `part`: a manifest, the event log (at the start),
    the metrics (after step 1), the first checkpoint (its extras), the export."""
    run = small_fs.mountpoint / "run"
    proc = _submit(small_fs, run, env={"RFTPIPE_FAULT_QUOTA": part})
    line = _stopped_for_space(proc, "disk quota exceeded writing", named)
    assert str(run) in line
    _verify_clean(small_fs, run)
    _resumes_bitwise(small_fs, run, reference, tmp_path)


def test_a_checkpoint_that_will_not_fit_stops_before_it_or_is_skipped(
    small_fs: SmallFS, reference: Path, tmp_path: Path
) -> None:
    """The first checkpoint (step 2) needs the state's 1.4 MiB; under 1 MiB is left while
    step 2 trains. `stop`: the run stops at the boundary naming the checkpoint, the free and
    the needed bytes, having written none of it. `skip`: the run goes on without it."""
    run = small_fs.mountpoint / "run"
    proc = _submit(small_fs, run, env={"RFTPIPE_SLOW": "train@2=4"})
    _fill_when(small_fs, run, 2, "train", leave=1 << 20)
    line = _stopped_for_space(proc, f"writing {run}/checkpoints/step=2", "needed")
    free, needed = (int(x) for x in re.findall(r"(\d+) bytes", line))
    assert free <= 1 << 20 < needed, line
    listed = small_fs.run(["ls", "-A", str(run / "checkpoints")]).stdout.split()
    assert listed == []
    _verify_clean(small_fs, run)
    skipped = _submit(small_fs, run, "checkpoint.on_no_space=skip")
    out, err = skipped.communicate(timeout=300)
    assert skipped.returncode == 0, err[-3000:]
    kinds = [e for e in _events(small_fs, run) if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in kinds] == [2, 4] and all(e["needed"] > e["free"] for e in kinds)
    lines = small_fs.run(["cat", str(run / "metrics.jsonl")]).stdout.splitlines()
    metrics = [json.loads(x) for x in lines]
    assert [m.get("checkpoint/skipped_no_space") for m in metrics if "step" in m][-2:] == [0.0, 1.0]
    small_fs.empty_ballast()
    fs_copy = tmp_path / "copy"
    small_fs.copy_out(run, fs_copy)
    assert trajectories(fs_copy).equals(trajectories(reference))
    wa, wb = final_weights(reference), final_weights(fs_copy)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_run_directory_turned_read_only_stops_with_one_line_and_resumes(
    small_fs: SmallFS, reference: Path, tmp_path: Path
) -> None:
    """The file system goes read-only while step 2 scores: its next write (the score
    shard) fails with EROFS; one line names it, exit 75; made writable, the run resumes."""
    run = small_fs.mountpoint / "run"
    proc = _submit(small_fs, run, env={"RFTPIPE_SLOW": "score@2=4"})
    _when_begun(small_fs, run, 2, "score", lambda: small_fs.read_only(run))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_NO_SPACE, (proc.returncode, err[-3000:])
    (line,) = err.strip().splitlines()
    assert line.startswith("rftpipe: error: read-only file system at ") and str(run) in line, line
    assert "make it writable" in line, line
    small_fs.read_only(run, on=False)
    _verify_clean(small_fs, run)
    _resumes_bitwise(small_fs, run, reference, tmp_path)


def test_inspect_html_onto_a_full_disk_fails_with_one_line_and_leaves_nothing(
    small_fs: SmallFS, reference: Path
) -> None:
    small_fs.fill(leave=0)
    page = small_fs.mountpoint / "pages" / "samples.html"
    cmd = [sys.executable, "-m", "rftpipe.inspect", str(reference), "html", "--out", str(page)]
    out = small_fs.run(cmd, cwd=ROOT)
    assert out.returncode == EXIT_NO_SPACE, out.stderr[-3000:]
    (line,) = out.stderr.strip().splitlines()
    assert f"no space left on device writing {page}" in line and "free on its" in line, line
    left = small_fs.run(["ls", "-A", str(page.parent)]).stdout.split()
    assert left == [], left  # no half page, no temporary file
    small_fs.empty_ballast()
    assert small_fs.run(cmd, cwd=ROOT).returncode == 0
    assert small_fs.run(["test", "-s", str(page)]).returncode == 0


BACKGROUND = ("__0_0.distcp", "COMMITTED.json", ".metadata")
"""Files the background checkpoint writes while the main thread goes on."""

MODES = ("quota", "full")
"""`EDQUOT` by its fault point, or the file system filled for real right before the write
(`RFTPIPE_FAULT_FULL`, rftpipe/space.py), which then meets the kernel's ENOSPC."""


def _fault(fs: SmallFS, mode: str, part: str) -> tuple[dict[str, str], str]:
    """The environment that makes the first write of `part` fail, and what the line says."""
    if mode == "quota":
        return {"RFTPIPE_FAULT_QUOTA": part}, "disk quota exceeded writing"
    ballast = str(fs.mountpoint / BALLAST)
    return {"RFTPIPE_FAULT_FULL": part, "RFTPIPE_FAULT_FULL_BALLAST": ballast}, (
        "no space left on device writing"
    )


def _freed(fs: SmallFS, mode: str) -> None:
    """Space back (the ballast deleted) after a stop in `mode`."""
    if mode == "full":
        fs.empty_ballast()


@pytest.mark.parametrize("mode", MODES)
def test_a_spent_quota_at_each_start_and_checkpoint_file_in_turn(
    small_fs: SmallFS, reference: Path, tmp_path: Path, mode: str
) -> None:
    """One run meets `EDQUOT` at one more write point each start: the fingerprints at its
    first start, the publication of step 1's rows, the first checkpoint's DCP data file, a resume's pending config, the
    checkpoint's manifest, DCP's metadata. Each start stops with one line naming the file,
    exit 75, verify clean; the last start, with the quota back, ends bitwise equal."""
    run = small_fs.mountpoint / "run"
    parts = ("run.json", ".staging", "__0_0.distcp", "config.next.yaml", "COMMITTED.json")
    for part in (*parts, ".metadata"):
        env, said = _fault(small_fs, mode, part)
        # A full file system stops the first write that needs a byte: publishing hard-links
        # the shards (no byte of tmpfs), so there it is the next write, the metrics; and
        # a checkpoint is written beside the next step's rollout, whose shard may come first.
        named = part
        if mode == "full" and part in (".staging", *BACKGROUND):
            named = str(run)
        line = _stopped_for_space(_submit(small_fs, run, env=env), said, named)
        assert str(run) in line
        if mode == "full":  # the file system was filled at that write, not before
            assert small_fs.run(["test", "-s", str(small_fs.mountpoint / BALLAST)]).returncode == 0
        _freed(small_fs, mode)
        _verify_clean(small_fs, run)
    _resumes_bitwise(small_fs, run, reference, tmp_path)


def _each_stops_then_ends(
    fs: SmallFS, overrides: tuple[str, ...], parts: list[tuple[str, str]], copy: Path
) -> Path:
    """A run on `fs` meets each (part, mode) of `parts` in turn, one start each: one line
    naming the part, exit 75, verify clean, space back; then a last start ends the run,
    which is copied out to `copy`."""
    run = fs.mountpoint / "run"
    for part, mode in parts:
        env, said = _fault(fs, mode, part)
        line = _stopped_for_space(_submit(fs, run, *overrides, env=env), said, part)
        assert str(run) in line
        _freed(fs, mode)
        _verify_clean(fs, run)
    proc = _submit(fs, run, *overrides)
    assert proc.communicate(timeout=300) and proc.returncode == 0
    fs.copy_out(run, copy)
    return copy


EVAL_EMA = ("eval.size=10", "eval.holdout_fraction=0.3", "eval.every=2", "eval.samples=2")
EVAL_EMA += ("eval.metric=dense_even_tokens", "eval.threshold=0.5", "train.ema_decay=0.9")


@pytest.mark.parametrize("mode", MODES)
def test_a_spent_quota_at_the_trackers_the_evaluations_and_the_average_export(
    small_fs: SmallFS, tmp_path: Path, mode: str
) -> None:
    """With evaluations and a parameter average: `EDQUOT` at TensorBoard's directory
    (step 1's metrics), then at eval.json and export_ema (the finished run's summary and
    its second export, each redone by the next start), each one line naming it, exit 75,
    verify clean; the last start ends bitwise equal to an uninterrupted run."""
    reference = tmp_path / "ref"
    assert submit(reference, *STEPS, *EVAL_EMA).returncode == 0
    parts = [(part, mode) for part in ("tensorboard", "eval.json", "export_ema")]
    fs_copy = _each_stops_then_ends(small_fs, EVAL_EMA, parts, tmp_path / "copy")
    assert trajectories(fs_copy).equals(trajectories(reference))
    for export in ("export", "export_ema"):
        a, b = (load_file(r / export / "model.safetensors") for r in (reference, fs_copy))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), export
    assert (fs_copy / "eval.json").read_bytes() == (reference / "eval.json").read_bytes()


LORA = ("model.lora={r: 4, alpha: 8, export_merged: true}", "logging.wandb=offline")


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_at_wandb_and_the_merged_export(
    small_fs: SmallFS, tmp_path: Path, mode: str
) -> None:
    """A LoRA run with its merged export and wandb offline: `EDQUOT` at wandb's directory
    (step 1's metrics; by the fault point only, see below), then `EDQUOT` or a full file
    system at `export_merged`, each one line naming it, exit 75, verify clean; the last
    start ends bitwise equal to an uninterrupted run. A real full file system under wandb
    is not caught here: wandb-core writes its files from a process of its own, after
    `wandb.log` has returned (docs/launching.md)."""
    reference = tmp_path / "ref"
    out = submit(reference, *STEPS, *LORA)
    assert out.returncode == 0, out.stderr[-3000:]
    parts = [("wandb", "quota"), ("export_merged", mode)]
    fs_copy = _each_stops_then_ends(small_fs, LORA, parts, tmp_path / "copy")
    assert trajectories(fs_copy).equals(trajectories(reference))
    for export in ("export", "export_merged"):
        names = {p.name for p in (reference / export).iterdir()}
        assert names == {p.name for p in (fs_copy / export).iterdir()}, export
        for name in names:
            if name.endswith(".safetensors"):
                a, b = (load_file(r / export / name) for r in (reference, fs_copy))
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
