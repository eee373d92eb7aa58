"""Tracking across kills: one wandb run id, and every step exactly once in wandb, TensorBoard
and the JSONL file, whatever the kills cost the trackers' buffers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import submit

from rftpipe.observe.wandb_log import history, run_id

pytestmark = pytest.mark.slow
TRACK = ("logging.wandb=offline", "logging.tensorboard=true")


def test_killed_run_keeps_one_wandb_run_and_every_tracker_logs_each_step_once(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    # A clean start that ends after 2 steps, so the first wandb folder really holds steps.
    assert submit(run, "total_steps=2", *TRACK).returncode == 0
    # Then two SIGKILLs: stage_after_commit fires 5 times a step, and a restarted process
    # resumes at step 3 (hit 7 = step 4's score), then at step 4's advantage (hit 5 = step
    # 5's score). Each killed process logged a step that wandb-core had not yet written.
    for skip in ("6", "4"):
        env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": skip}
        assert submit(run, "total_steps=6", *TRACK, env=env).returncode != 0
    assert submit(run, "total_steps=6", *TRACK).returncode == 0

    jsonl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in jsonl] == [1, 2, 3, 4, 5, 6]
    want = {m["step"]: m for m in jsonl}

    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 4  # one folder per process start, all under the run's one id
    the_id = (run / "wandb_id").read_text().strip()
    assert {f.name.rsplit("-", 1)[1] for f in folders} == {the_id}
    files = [next(f.glob(f"run-{the_id}.wandb")) for f in folders]
    assert run_id(files[0]) == run_id(files[-1]) == the_id
    per_folder = [[int(r["_step"]) for r in history(f)] for f in files]
    print("wandb steps per folder:", per_folder)
    assert per_folder[0] == [1, 2]
    # Across the folders, each step exactly once, in order, with the JSONL values.
    assert [s for steps in per_folder for s in steps] == [1, 2, 3, 4, 5, 6], per_folder
    for f in files:
        for r in history(f):
            for key in ("rollout/reward_mean", "train/pg_loss", "perf/commit_s"):
                assert r[key] == pytest.approx(want[r["_step"]][key]), (r["_step"], key)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    for e in events:
        assert e.value == pytest.approx(want[e.step]["rollout/reward_mean"], rel=1e-6)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 4


@pytest.mark.tier1
@pytest.mark.parametrize(
    ("kl", "label"),
    [
        ([], "drift"),
        (["kl.mode=loss", "kl.coef=0.1"], "kl"),
        (["kl.mode=reward", "kl.coef=0.1"], "kl"),
    ],
)
def test_progress_bar_names_train_kl_by_what_it_measures(kl: list[str], label: str) -> None:
    """Without a reference `train/kl` is the drift from the old policy, not a KL penalty."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig
    from rftpipe.run.loop import bar_update, drift_label

    class Bar:
        def set_postfix(self, postfix: dict, refresh: bool) -> None:
            self.postfix = postfix

        def update(self, n: int) -> None:
            pass

    bar = Bar()
    m = {"rollout/reward_mean": 0.5, "perf/rollout_s": 1.0, "perf/train_s": 2.0}
    bar_update(bar, m, {"train/kl": 3e-4}, drift_label(load_config(RunConfig, None, kl)))
    assert bar.postfix[label] == "3.00e-04"
    assert ({"kl", "drift"} - {label}).isdisjoint(bar.postfix)
