"""Multi-process SPMD on CPU (gloo): data-parallel equivalence, collective skip, resharding."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    ROOT,
    events,
    final_weights,
    script_command,
    submit,
    trajectories,
    weights_rel_diff,
)
from safetensors.torch import load_file

from jobs.submit import local_rank_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.forward import build_micro_batch, response_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# A KL term in the loss puts the sharded reference role through the pipeline too. Two
# groups share each (padded) generate call, and ranks get whole calls: 4 ranks, 1 call each.
FSDP = (
    "train.backend=fsdp2",
    "total_steps=3",
    "kl.mode=loss",
    "kl.coef=0.1",
    "data.prompts_per_step=8",
    "rollout.groups_per_call=2",
)


def _train_metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _fsdp_run(base: Path, world: int) -> Path:
    run = base / f"w{world}"
    out = submit(run, *FSDP, extra=("--tasks-per-node", str(world)), timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FSDP2 run on one rank: its committed advantages are the fixed train inputs of
    the tests below that need no other world size."""
    return _fsdp_run(tmp_path_factory.mktemp("dp1"), 1)


@pytest.fixture(scope="module")
def dp_runs(one_rank_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("dp")
    return {1: one_rank_run, 2: _fsdp_run(base, 2), 4: _fsdp_run(base, 4)}


def test_pipeline_is_world_size_independent(dp_runs: dict[int, Path]) -> None:
    ref = dp_runs[1]
    cols = ["prompt_id", "sample_idx", "response_token_ids", "reward"]
    for world in (2, 4):
        run = dp_runs[world]
        assert trajectories(run).select(cols).equals(trajectories(ref).select(cols)), world
        ranks = set(trajectories(run).column("rank").to_pylist())
        assert ranks == set(range(world))
        for a, b in zip(_train_metrics(ref), _train_metrics(run), strict=True):
            assert a["train/pg_loss"] == pytest.approx(b["train/pg_loss"], rel=1e-4, abs=1e-6)
            assert a["train/entropy"] == pytest.approx(b["train/entropy"], rel=1e-5)
        assert weights_rel_diff(final_weights(ref), final_weights(run)) < 1e-5


def test_fsdp2_matches_single_device(dp_runs: dict[int, Path], tmp_path: Path) -> None:
    run = tmp_path / "single"
    assert submit(run, *FSDP[1:]).returncode == 0  # everything but the backend
    assert weights_rel_diff(final_weights(run), final_weights(dp_runs[1])) < 1e-5


def _train_alone(table: Path, out: Path, world: int, nan_rank: int = -1) -> dict:
    with local_rank_env(world) as env:
        env["PYTHONPATH"] = str(ROOT)
        procs = [
            subprocess.Popen(
                script_command(
                    ROOT / "tests" / "dp_train_worker.py", str(table), str(out), str(nan_rank)
                ),
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(world)
        ]
        assert [p.wait(timeout=300) for p in procs] == [0] * world
    return {
        "metrics": json.loads((out / "metrics.json").read_text()),
        "weights": load_file(out / "weights.safetensors"),
    }


def test_train_stage_alone_on_fixed_inputs(one_rank_run: Path, tmp_path: Path) -> None:
    table = one_rank_run / "stages" / "step=1" / "advantage" / "part-r0.parquet"
    res = {w: _train_alone(table, tmp_path / f"w{w}", w) for w in (1, 2, 4)}
    for w in (2, 4):
        for a, b in zip(res[1]["metrics"], res[w]["metrics"], strict=True):
            for key in (
                "train/pg_loss",
                "train/kl",
                "train/entropy",
                "train/clip_frac",
                "train/grad_norm",
            ):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (w, key)
        assert weights_rel_diff(res[1]["weights"], res[w]["weights"]) < 1e-5
    initial = load_file(prepare_tiny() / "model.safetensors")
    # The updates really moved the weights (the saved ones also name the tied lm_head).
    assert weights_rel_diff(initial, {k: res[1]["weights"][k] for k in initial}) > 1e-3


def test_sharded_reference_with_uneven_rows(one_rank_run: Path, tmp_path: Path) -> None:
    table = one_rank_run / "stages" / "step=1" / "advantage" / "part-r0.parquet"
    _train_alone(table, tmp_path, 2)
    model = load_causal_lm(prepare_tiny(), "float32")
    rows = pq.read_table(table).to_pylist()
    for rank, n in ((0, 2), (1, 5)):
        got = json.loads((tmp_path / f"ref-r{rank}.json").read_text())
        mb = build_micro_batch(
            [r["prompt_token_ids"] for r in rows[:n]],
            [r["response_token_ids"] for r in rows[:n]],
            0,
        )
        with torch.no_grad():
            want, _ = response_logprobs(model, mb, 0.7, with_entropy=False)
        assert len(got) == n
        for i, row in enumerate(got):
            assert torch.allclose(torch.tensor(row), want[i, : len(row)], atol=1e-5), (rank, i)


@pytest.mark.tier1
def test_invalid_batch_on_one_rank_is_skipped_by_all(one_rank_run: Path, tmp_path: Path) -> None:
    table = one_rank_run / "stages" / "step=1" / "advantage" / "part-r0.parquet"
    res = _train_alone(table, tmp_path / "nan", 2, nan_rank=1)
    skipped = [m["train/skipped_micro_batches"] for m in res["metrics"]]
    assert all(s > 0 for s in skipped), skipped
    assert all(torch.isfinite(w).all() for w in res["weights"].values())


def test_kill_at_world_4_resume_at_world_2(tmp_path: Path) -> None:
    steps = ("train.backend=fsdp2", "total_steps=4")
    switched = tmp_path / "switched"  # ran steps 1-2 on 4 ranks, then 3-4 on 2, no kill
    assert (
        submit(
            switched, "train.backend=fsdp2", "total_steps=2", extra=("--tasks-per-node", "4")
        ).returncode
        == 0
    )
    assert submit(switched, *steps, config=None, extra=("--tasks-per-node", "2")).returncode == 0

    killed = tmp_path / "killed"
    # stage_after_commit hit 14 is step 3's train commit. The step-2 checkpoint is written
    # in the background during step 3's rollout and is committed before its train starts.
    res = submit(
        killed,
        *steps,
        extra=("--tasks-per-node", "4"),
        env={"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "13"},
    )
    assert res.returncode != 0
    assert submit(killed, *steps, config=None, extra=("--tasks-per-node", "2")).returncode == 0

    a, b = trajectories(switched), trajectories(killed)
    assert a.drop_columns(["rank"]).equals(b.drop_columns(["rank"]))
    wa, wb = final_weights(switched), final_weights(killed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    t = b.to_pandas()
    order = [p for s in range(1, 5) for p in sorted(t[t.step.astype(int) == s].prompt_id.unique())]
    assert sorted(order) == sorted(set(order)) and len(order) == 16  # 16 of 20 prompts, once each
    step3 = set(t[t.step.astype(int) == 3]["rank"])
    assert step3 == {0, 1, 2, 3}  # rolled out on 4 ranks, replayed and published on 2
    replays = [e for e in events(killed) if e["event"] == "replay"]
    assert {e["step"] for e in replays} == {3}  # only the train step after the checkpoint
