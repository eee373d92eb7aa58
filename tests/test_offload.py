"""`train.offload_between_stages` on every backend: the optimizer state really moves to a
separate host copy and back (new storage each way, the replaced tensors freed), and the
next train steps are bitwise those without offload, also after a checkpoint state read
while offloaded is loaded into an offloaded engine (`tests/offload_worker.py`). The SIGKILL
resume with the option on is in `tests/test_restore_state.py`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import launch_ranks
from offload_worker import config, run

from rftpipe.dist import Dist

ALL_TRUE = {
    "metrics_equal": True,
    "loaded_step_equal": True,
    "weights_equal": True,
    "loaded_weights_equal": True,
    "moved_weights": True,
}
MOVED = {
    "new_storage_on_reload": True,
    "new_storage_on_offload": True,
    "device_copies_freed": True,
    "values_equal": True,
}


def _check(result: dict) -> None:
    moved = result.pop("movement")
    assert result == ALL_TRUE, result
    assert {k: moved[k] for k in MOVED} == MOVED, moved
    # Every moved tensor counted: the recorded bytes are the state's, and not nothing.
    assert moved["bytes"] == moved["expected_bytes"] > 0, moved


def test_single_offload_moves_the_state_and_trains_bitwise() -> None:
    result = run(config({"backend": "single"}), Dist())
    # AdamW's exp_avg, exp_avg_sq and step for each of the tiny model's 20 parameters.
    assert result["movement"]["tensors"] == 60
    _check(result)


SHARDED = ["backend=fsdp2"]
if importlib.util.find_spec("deepspeed") is not None:  # installed by tools/setup.sh
    SHARDED += ["backend=deepspeed,zero_stage=2", "backend=deepspeed,zero_stage=3"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_offload_moves_the_state_and_trains_bitwise(tmp_path: Path) -> None:
    """FSDP2 (AdamW's DTensor shards) and DeepSpeed ZeRO-2/3 (the fp32 master partitions
    and their AdamW state) on 2 gloo ranks, in one pair of processes."""
    launch_ranks("offload_worker.py", 2, str(tmp_path), *SHARDED, timeout=500)
    results = json.loads((tmp_path / "result.json").read_text())
    assert sorted(results) == sorted(SHARDED)
    for spec in SHARDED:
        _check(results[spec])
