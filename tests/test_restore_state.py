"""A resume restores the LR scheduler and the adaptive KL controller, not just the weights.

Each run is killed after step 4's train stage commits, before its checkpoint: the resume
loads the step-2 checkpoint, replays the train steps 3 and 4 from their committed rows and
then trains steps 5 and 6 anew. Every per-step metric and the final weights must equal an
uninterrupted run's. Without the scheduler state the replayed updates use the wrong
learning rates; without the controller state the new advantages (and, with kl.mode=loss,
the replayed losses) use the wrong KL coefficient. Both show in the metrics of steps 5 and 6
and in the final weights.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import events, final_weights, submit, trajectories

pytestmark = pytest.mark.slow

BASE = ("total_steps=6", "checkpoint.interval=2")
# 6 steps x 2 mini-batches = 12 updates: 4 of warm-up, then 8 of cosine decay, so the
# first update of every step has a different LR.
LR_SCHEDULE = ("train.lr_schedule=cosine", "train.warmup_steps=4")
# 16 samples per step against a 32-sample horizon: the coefficient moves by up to 10 % a
# step. Observed KL grows from ~0.002 to ~0.02 across this target, so it falls, then rises.
ADAPTIVE_KL = ("kl.controller={type: adaptive, target: 0.01, horizon: 32}", "kl.coef=0.1")
# stage_after_commit fires 5 times a step (rollout, score, advantage, train, sync); hit 19
# is step 4's train commit: the step-2 checkpoint is committed, step 4's is not yet.
KILL_AFTER_STEP_4_TRAIN = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "18"}


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return sorted((json.loads(x) for x in lines), key=lambda m: m["step"])


def _series(run: Path, key: str) -> list[float]:
    return [m[key] for m in _metrics(run)]


def _run_uninterrupted(run: Path, *overrides: str) -> Path:
    res = submit(run, *BASE, *overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def _run_killed_and_resumed(run: Path, *overrides: str) -> Path:
    killed = submit(run, *BASE, *overrides, env=KILL_AFTER_STEP_4_TRAIN)
    assert killed.returncode != 0, "the fault point was never reached"
    commits = [(e["step"], e["stage"]) for e in events(run) if e["event"] == "commit"]
    assert commits[-1] == (4, "train"), commits[-3:]
    resumed = submit(run, *BASE, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The resume restored the step-2 checkpoint and replayed exactly steps 3 and 4.
    replays = [e for e in events(run) if e["event"] == "replay"]
    assert [e["step"] for e in replays] == [3, 4]
    assert [m["step"] for m in _metrics(run)] == list(range(1, 7))
    return run


def _assert_replays_identical(run: Path) -> None:
    """Each replayed train step reproduced its committed metrics (train/lr included)."""
    replays = [e for e in events(run) if e["event"] == "replay"]
    assert all(e["identical"] for e in replays), [(e["step"], e["identical"]) for e in replays]


def _assert_same_weights(run: Path, reference: Path) -> None:
    a, b = final_weights(reference), final_weights(run)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"final weights differ from the uninterrupted run in {differ[:5]}"


def _assert_same_metrics(run: Path, reference: Path) -> None:
    """Every deterministic per-step metric is equal (perf/* are wall-clock times; resume/*
    describe the restart, logged by the resumed process alone, whose replays
    `_assert_replays_identical` checks)."""
    skip = ("perf/", "resume/")
    for a, b in zip(_metrics(reference), _metrics(run), strict=True):
        a = {k: v for k, v in a.items() if not k.startswith(skip)}
        b = {k: v for k, v in b.items() if not k.startswith(skip)}
        assert a == b, f"step {a['step']} metrics differ"


# -- LR scheduler -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def lr_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run_uninterrupted(tmp_path_factory.mktemp("lr") / "ref", *LR_SCHEDULE)


@pytest.mark.tier1
def test_lr_schedule_moves_in_the_reference_run(lr_reference: Path) -> None:
    lrs = _series(lr_reference, "train/lr")
    # First updates of steps 1..6 are updates 0, 2, ..., 10: warm-up (i+1)/4, then cosine
    # over the remaining 8 updates.
    lr = 3e-3  # configs/tiny_dense.yaml
    expected = [lr * f for f in (0.25, 0.75, 1.0)]
    expected += [lr * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in (2, 4, 6)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert len(set(lrs)) == 6


def test_resume_restores_lr_scheduler(lr_reference: Path, tmp_path: Path) -> None:
    run = _run_killed_and_resumed(tmp_path / "run", *LR_SCHEDULE)
    assert _series(run, "train/lr") == _series(lr_reference, "train/lr")
    _assert_same_metrics(run, lr_reference)
    _assert_same_weights(run, lr_reference)
    _assert_replays_identical(run)


# -- adaptive KL controller -------------------------------------------------------------


@pytest.fixture(scope="module", params=["loss", "reward"])
def kl_reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    mode = request.param
    overrides = (f"kl.mode={mode}", *ADAPTIVE_KL)
    run = _run_uninterrupted(tmp_path_factory.mktemp(f"kl-{mode}") / "ref", *overrides)
    return run, overrides


def test_adaptive_kl_coef_moves_in_the_reference_run(kl_reference) -> None:
    run, _ = kl_reference
    coefs = _series(run, "train/kl_coef")
    assert coefs[0] == 0.1
    assert all(a != b for a, b in itertools.pairwise(coefs)), coefs


def test_resume_restores_adaptive_kl_controller(kl_reference, tmp_path: Path) -> None:
    reference, overrides = kl_reference
    run = _run_killed_and_resumed(tmp_path / "run", *overrides)
    assert _series(run, "train/kl_coef") == _series(reference, "train/kl_coef")
    _assert_same_metrics(run, reference)
    _assert_same_weights(run, reference)
    _assert_replays_identical(run)


# -- offload between stages -------------------------------------------------------------


def test_resume_with_offload_between_stages(lr_reference: Path, tmp_path: Path) -> None:
    """`train.offload_between_stages`: the step-2 checkpoint is written from the host copy of
    the optimizer state, and the resume loads it, replays steps 3 and 4 (each train stage
    bringing the state back and offloading it again) and trains on. The run ends bitwise
    equal to an uninterrupted one with the option on, and to one with it off."""
    on = ("train.offload_between_stages=true", *LR_SCHEDULE)
    run = _run_killed_and_resumed(tmp_path / "run", *on)
    uninterrupted = _run_uninterrupted(tmp_path / "ref", *on)
    for reference in (uninterrupted, lr_reference):
        assert trajectories(run).equals(trajectories(reference))
        _assert_same_metrics(run, reference)
        _assert_same_weights(run, reference)
    _assert_replays_identical(run)
    # Every train stage moved the actor's AdamW state (2 moments + step per parameter).
    assert all(m["perf/offload_gib"] > 0 for m in _metrics(run))
    assert "perf/offload_gib" not in _metrics(lr_reference)[0]
