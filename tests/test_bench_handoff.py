"""tools.bench handoff: both ways of handing weights to a rollout rank, on the tiny shape."""

from __future__ import annotations

from pathlib import Path

from tools.bench.handoff import run


def test_both_handoffs_leave_the_rollout_rank_with_the_trainers_weights(tmp_path: Path):
    """Two real gloo processes: the rollout rank starts from other weights (seed 0 against
    the trainer's seed 1), so `equal` holds only if each way moved every tensor, the tied
    lm_head included."""
    result = run("tiny", reps=1, root=tmp_path)
    for way in ("directory", "broadcast"):
        assert result[way]["equal"] is True, way
        assert len(result[way]["seconds"]) == 1 and result[way]["median_s"] > 0
    assert result["parameters"] > 0 and result["megabytes"] > 0
    assert not any(tmp_path.iterdir()), "the directory way leaves its versions behind"
