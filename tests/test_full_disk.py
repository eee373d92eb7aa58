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
from tools.testing.small_fs import BALLAST, SmallFS, Unavailable, as_plain_user

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
    with helpers.small_fs(tmp_path / "fs", SIZE, warm=True) as fs:
        yield fs


def _submit(fs: SmallFS, run: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`jobs.submit` inside the namespace, it and its ranks forks of the warm interpreter
    there (`helpers.warm_forks`)."""
    cmd, full = helpers.namespace_submit(fs, run, *STEPS, *extra, env=env)
    return fs.popen(
        cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _events(fs: SmallFS, run: Path) -> list[dict]:
    return _records(fs.run(["cat", str(run / "events.jsonl")]).stdout)


def _records(text: str) -> list[dict]:
    """An event log's records (a line still being written left out)."""
    return [json.loads(x) for x in text.splitlines() if x.endswith("}")]


def _wait_begun(read: Callable[[], list[dict]], step: int, stage: str) -> None:
    """Return once `step`'s `stage` has begun, by the events `read` gives."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if any(
            e["event"] == "stage_begin" and (e["step"], e["stage"]) == (step, stage) for e in read()
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step}'s {stage} did not begin within 240 s")


def _when_begun(
    fs: SmallFS, run: Path, step: int, stage: str, then: Callable[[], object]
) -> threading.Thread:
    """Call `then()` once `step`'s `stage` has begun (in a thread)."""

    def watch() -> None:
        _wait_begun(lambda: _events(fs, run), step, stage)
        then()

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
    (line,) = helpers.run_lines(err)
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
    """The file system filled for real while step 2 scores: the score shard's write meets
    ENOSPC; one line names it, exit 75, verify clean, the stage not committed; the file
    system grown in place (`mount -o remount,size=`), the same command resumes bitwise."""
    run = small_fs.mountpoint / "run"
    proc = _submit(small_fs, run, env={"RFTPIPE_SLOW": "score@2=4"})
    _fill_when(small_fs, run, 2, "score", leave=0)
    line = _stopped_for_space(proc, f"no space left on device writing {run}/stages/step=2/score")
    free = int(re.search(r": (\d+) bytes", line)[1])
    assert free < 1 << 20, line  # what the failed write gave back when it deleted its file
    _verify_clean(small_fs, run)
    manifest = run / "stages/step=2/score/MANIFEST.json"
    assert small_fs.run(["test", "-e", str(manifest)]).returncode == 1
    # Space back as an admin gives it: the file system grown in place, the ballast kept.
    small_fs.grow(2 * SIZE)
    assert small_fs.free() > SIZE // 2
    _resumes_bitwise(small_fs, run, reference, tmp_path)


def test_a_spent_quota_at_the_event_log_metrics_checkpoint_manifest_and_export_in_turn(
    small_fs: SmallFS, reference: Path, tmp_path: Path
) -> None:
    """One run meets `EDQUOT` at one more write each start: the event log (at the start),
    the metrics (after step 1), the first checkpoint's extras (step 2), step 3's rollout
    manifest, the export. Each start stops with one line naming the file, exit 75, verify
    clean; the last start, with the quota back, ends bitwise equal."""
    parts = [
        ("events.jsonl", "events.jsonl"),
        ("metrics.jsonl", "metrics.jsonl"),
        (".tmp-step=2", "checkpoints/.tmp-step=2/extra-r0.pt"),
        ("step=3/rollout/MANIFEST.json", "stages/step=3/rollout/MANIFEST.json"),
        ("/.tmp-export", ".tmp-export"),
    ]
    run = small_fs.mountpoint / "run"
    for part, named in parts:
        proc = _submit(small_fs, run, env={"RFTPIPE_FAULT_QUOTA": part})
        _stopped_for_space(proc, f"disk quota exceeded writing {run}/{named}")
        _verify_clean(small_fs, run)
    _resumes_bitwise(small_fs, run, reference, tmp_path)


def test_a_spent_quota_on_one_rank_of_two_stops_both_with_one_line(tmp_path: Path) -> None:
    """Two ranks; only rank 1's score shard meets `EDQUOT`. Both ranks stop, exit 75, and the
    run says one line, naming rank 1's shard (rank 0 alone would otherwise have died in the
    next collective with a lost peer's traceback); verify clean."""
    run = tmp_path / "run"
    out = submit(
        run,
        "train.backend=fsdp2",
        "total_steps=2",
        env={"RFTPIPE_FAULT_QUOTA": "step=1/score/part-r1"},
        extra=("--tasks-per-node", "2"),
    )
    assert out.returncode == EXIT_NO_SPACE, out.stderr[-3000:]
    (line,) = helpers.run_lines(out.stderr)
    assert f"disk quota exceeded writing {run}/stages/step=1/score/part-r1.parquet" in line, line
    cmd = [sys.executable, "-m", "rftpipe.inspect", str(run), "verify"]
    verify = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]


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


def test_a_file_that_loses_its_write_permission_stops_with_one_line_and_resumes(
    reference: Path, tmp_path: Path
) -> None:
    """`metrics.jsonl` loses its write bit (chmod 444) while step 2 scores: the next append
    fails with EACCES; one line names the file, exit 75; given it back, the run resumes
    bitwise. The run goes as a user without root's power over permissions
    (`as_plain_user`: the tests may run as root, which no mode bit stops)."""
    try:
        plain = as_plain_user([sys.executable, "-m", "jobs.submit", "--cluster", "local"])
    except Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set and no user namespace can be made here: {exc}")
        pytest.skip(str(exc))
    run = tmp_path / "run"
    cmd = [*plain, "--run-dir", str(run), "--config", str(TINY), *STEPS]
    env = {**os.environ, "RFTPIPE_WORKER_VIA": ""}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**env, "RFTPIPE_SLOW": "score@2=4"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run / "metrics.jsonl"
    log = run / "events.jsonl"
    _wait_begun(lambda: _records(log.read_text() if log.exists() else ""), 2, "score")
    metrics.chmod(0o444)
    line = _stopped_for_space(proc)
    assert f"permission denied at {metrics}: " in line and "make it writable" in line, line
    metrics.chmod(0o644)
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert trajectories(run).equals(trajectories(reference))
    wa, wb = final_weights(reference), final_weights(run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_inspect_html_onto_a_full_disk_fails_with_one_line_and_leaves_nothing(
    reference: Path, tmp_path: Path
) -> None:
    with helpers.small_fs(tmp_path / "fs", SIZE) as fs:  # no run here: no warm interpreter
        _inspect_html_onto(fs, reference)


def _inspect_html_onto(small_fs: SmallFS, reference: Path) -> None:
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


def _fault(fs: SmallFS, mode: str, part: str) -> tuple[dict[str, str], str]:
    """The environment that makes the first write of `part` fail, and what the line says."""
    return helpers.fault_env(fs, mode, part), helpers.FAULT_SAYS[mode]


def _freed(fs: SmallFS, mode: str) -> None:
    """Space back (the ballast deleted) after a stop in `mode`."""
    if mode == "full":
        fs.empty_ballast()


@pytest.mark.parametrize("mode", helpers.FAULT_MODES)
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


def test_a_full_disk_at_the_trackers_the_evaluations_and_the_average_export(
    small_fs: SmallFS, tmp_path: Path
) -> None:
    """With evaluations and a parameter average: `EDQUOT`, then a full file system, at
    TensorBoard's directory (step 1's metrics), at eval.json and at export_ema (the
    finished run's summary and its second export, each redone by the next start), each one
    line naming it, exit 75, verify clean; the last start ends bitwise equal to an
    uninterrupted run."""
    reference = tmp_path / "ref"
    assert submit(reference, *STEPS, *EVAL_EMA).returncode == 0
    parts = [
        (part, mode)
        for part in ("tensorboard", "eval.json", "export_ema")
        for mode in helpers.FAULT_MODES
    ]
    fs_copy = _each_stops_then_ends(small_fs, EVAL_EMA, parts, tmp_path / "copy")
    assert trajectories(fs_copy).equals(trajectories(reference))
    for export in ("export", "export_ema"):
        a, b = (load_file(r / export / "model.safetensors") for r in (reference, fs_copy))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), export
    assert (fs_copy / "eval.json").read_bytes() == (reference / "eval.json").read_bytes()


LORA = ("model.lora={r: 4, alpha: 8, export_merged: true}", "logging.wandb=offline")


def test_a_full_disk_at_wandb_and_the_merged_export(small_fs: SmallFS, tmp_path: Path) -> None:
    """A LoRA run with its merged export and wandb offline: `EDQUOT` at wandb's directory
    (step 1's metrics; by the fault point only, see below), then `EDQUOT` and a full file
    system at `export_merged`, each one line naming it, exit 75, verify clean; the last
    start ends bitwise equal to an uninterrupted run. A real full file system under wandb
    is not caught here: wandb-core writes its files from a process of its own, after
    `wandb.log` has returned (docs/launching.md)."""
    reference = tmp_path / "ref"
    out = submit(reference, *STEPS, *LORA)
    assert out.returncode == 0, out.stderr[-3000:]
    parts = [("wandb", "quota"), *(("export_merged", mode) for mode in helpers.FAULT_MODES)]
    fs_copy = _each_stops_then_ends(small_fs, LORA, parts, tmp_path / "copy")
    assert trajectories(fs_copy).equals(trajectories(reference))
    for export in ("export", "export_merged"):
        names = {p.name for p in (reference / export).iterdir()}
        assert names == {p.name for p in (fs_copy / export).iterdir()}, export
        for name in names:
            if name.endswith(".safetensors"):
                a, b = (load_file(r / export / name) for r in (reference, fs_copy))
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
