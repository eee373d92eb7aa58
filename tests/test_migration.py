"""Run directories written by an earlier rftpipe resume under the current one.

`tests/fixtures/run_v2_sapo` was made by the code of 2026-11-25 before the variant settings
moved under their variants (commit 483548b, run layout 2): the tiny dense config with
`train.policy_loss=sapo train.sapo_tau_pos=1.2 train.dual_clip=4.0 kl.mode=loss
kl.estimator=k2 kl.coef=0.05 total_steps=2`, SIGKILLed right after step 2's advantage
commit (`RFTPIPE_FAULT=stage_after_commit RFTPIPE_FAULT_SKIP=7`), with no checkpoint. Its
`config.yaml` is in the old format. Resuming it must migrate that config, recompute no
committed stage, and replay step 1's update to exactly its committed metrics, which holds
only if the migrated loss settings are the ones the run trained with.

The fixture was written on one machine's CPU kernels (AVX2); replayed on another (AVX-512,
or the scalar kernels of `ATEN_CPU_CAPABILITY=default`) the update's float32 sums round
differently, so the replay is compared with the committed metrics within `REPLAY_RTOL`,
while every committed file and every stage begin stay exact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rftpipe.engines.models import model_fingerprint
from tests.helpers import ROOT, events, submit

FIXTURE = ROOT / "tests" / "fixtures" / "run_v2_sapo"
MODEL = ROOT / "tests" / "fixtures" / "model_tiny_v2"
"""The `builtin:tiny` the fixture ran with, shipped: `prepare_tiny` initialises it with
torch's normal sampler, whose values depend on the CPU kernels (`ATEN_CPU_CAPABILITY`), so a
model cache built on another machine holds another tiny model and the resume is refused
("the model differs from the one this run started with")."""


@pytest.fixture
def shipped(tmp_path: Path) -> dict[str, str]:
    """An environment whose model cache holds the fixture's own tiny model."""
    cache = tmp_path / "cache"
    shutil.copytree(MODEL, cache / "models" / "tiny-v2")
    return {"RFTPIPE_CACHE": str(cache)}


def test_the_shipped_model_is_the_fixtures() -> None:
    recorded = json.loads((FIXTURE / "run.json").read_text())["model_fingerprint"]
    assert model_fingerprint(MODEL) == recorded


#: The largest relative difference of the replayed step's update metrics (loss, KL,
#: entropy, gradient norm, ratio: float32 sums over 128 tokens and 2 updates) from the
#: committed ones. Under the scalar kernels (`ATEN_CPU_CAPABILITY=default`) the fixture's
#: AVX2 step replays at 3.9e-7 (2026-11-27); 1e-5 (about 80 float32 ulps) leaves room for
#: other kernels, and a wrong setting is far above it: `train.sapo_tau_pos` 1.2 -> 1.1
#: (test below), 1.2 -> 1.0 gives 1.8, `sapo_tau_neg` 1.05 -> 1.0 gives 0.34 and the
#: learning rate 0.003 -> 0.00301 gives 3.3e-3.
REPLAY_RTOL = 1e-5


@pytest.mark.kernels
def test_old_run_directory_resumes_without_recomputing(
    tmp_path: Path, shipped: dict[str, str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    before = {
        p.relative_to(run): p.read_bytes() for p in (run / "stages").rglob("*") if p.is_file()
    }
    old_events = len(events(run))
    r = submit(run, config=None, env=shipped)
    assert r.returncode == 0, r.stderr[-2000:]
    # Every file committed before the resume is byte for byte as it was.
    for rel, data in before.items():
        assert (run / rel).read_bytes() == data, rel
    new = events(run)[old_events:]
    begun = sorted((e["step"], e["stage"]) for e in new if e["event"] == "stage_begin")
    assert begun == [(2, "sync"), (2, "train")], begun
    replays = [e for e in new if e["event"] == "replay"]
    assert [e["step"] for e in replays] == [1], replays
    assert replays[0]["max_rel_diff"] <= REPLAY_RTOL, replays
    # The fixture predates the recorded platform: unknown, not "unchanged".
    assert replays[0]["platform_changed"] is None
    assert (run / "stages" / "step=2" / "sync" / "MANIFEST.json").exists()


def test_a_wrong_migrated_setting_replays_beyond_the_tolerance(
    tmp_path: Path, shipped: dict[str, str]
) -> None:
    """What `REPLAY_RTOL` must still catch: a loss setting that migrated to another value
    (here the saved config edited, as a wrong migration would) replays far outside it."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    saved = (run / "config.yaml").read_text()
    assert saved.count("sapo_tau_pos: 1.2\n") == 1
    (run / "config.yaml").write_text(saved.replace("sapo_tau_pos: 1.2\n", "sapo_tau_pos: 1.1\n"))
    old_events = len(events(run))
    r = submit(run, config=None, env=shipped)
    assert r.returncode == 0, r.stderr[-2000:]
    replays = [e for e in events(run)[old_events:] if e["event"] == "replay"]
    assert [e["step"] for e in replays] == [1], replays
    assert replays[0]["max_rel_diff"] > 100 * REPLAY_RTOL, replays
