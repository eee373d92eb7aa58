"""Run directories written by an earlier rftpipe resume under the current one.

`tests/fixtures/run_v2_sapo` was made by the code of 2026-11-25 before the variant settings
moved under their variants (commit 483548b, run layout 2): the tiny dense config with
`train.policy_loss=sapo train.sapo_tau_pos=1.2 train.dual_clip=4.0 kl.mode=loss
kl.estimator=k2 kl.coef=0.05 total_steps=2`, SIGKILLed right after step 2's advantage
commit (`RFTPIPE_FAULT=stage_after_commit RFTPIPE_FAULT_SKIP=7`), with no checkpoint. Its
`config.yaml` is in the old format. Resuming it must migrate that config, recompute no
committed stage, and replay step 1's update to exactly its committed metrics, which holds
only if the migrated loss settings are the ones the run trained with.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers import ROOT, events, submit

FIXTURE = ROOT / "tests" / "fixtures" / "run_v2_sapo"


def test_old_run_directory_resumes_without_recomputing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    before = {
        p.relative_to(run): p.read_bytes() for p in (run / "stages").rglob("*") if p.is_file()
    }
    old_events = len(events(run))
    r = submit(run, config=None)
    assert r.returncode == 0, r.stderr[-2000:]
    # Every file committed before the resume is byte for byte as it was.
    for rel, data in before.items():
        assert (run / rel).read_bytes() == data, rel
    new = events(run)[old_events:]
    begun = sorted((e["step"], e["stage"]) for e in new if e["event"] == "stage_begin")
    assert begun == [(2, "sync"), (2, "train")], begun
    replays = [e for e in new if e["event"] == "replay"]
    assert [(e["step"], e["identical"]) for e in replays] == [(1, True)], replays
    assert (run / "stages" / "step=2" / "sync" / "MANIFEST.json").exists()
