"""End-to-end runs of the real entry point on the tiny model with a dense synthetic reward."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ROOT, TINY, events, final_weights, submit, trajectories
from safetensors.torch import load_file

from rftpipe.checkpoint import writer
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.forward import build_micro_batch, response_logprobs
from rftpipe.stages import ORDER

pytestmark = pytest.mark.slow

REQUIRED = {
    "step",
    "prompt_id",
    "sample_idx",
    "rank",
    "prompt",
    "response",
    "prompt_token_ids",
    "response_token_ids",
    "response_length",
    "finish_reason",
    "logprobs",
    "reward",
    "advantages",
    "weight_version",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tiny") / "run"
    out = submit(run, "train.weight_decay=0.01", "checkpoint.interval=1", "checkpoint.keep_last=10")
    assert out.returncode == 0, out.stderr
    return run


@pytest.mark.tier1
def test_advantages_and_weights_move(tiny_run: Path) -> None:
    t = trajectories(tiny_run).to_pandas()
    for step, rows in t.groupby("step"):
        adv = pd.Series([a for row in rows["advantages"] for a in row])
        assert adv.std() > 0.1, f"step {step}: advantages did not vary"
    w0 = load_file(prepare_tiny() / "model.safetensors")
    wT = final_weights(tiny_run)
    delta = sum(float((wT[k] - w0[k]).pow(2).sum()) for k in w0) ** 0.5
    norm0 = sum(float(w0[k].pow(2).sum()) for k in w0) ** 0.5
    # AdamW's decoupled decay alone would shrink weights by at most (1 - lr*wd) per update.
    updates, lr, wd = 6 * 2, 3e-3, 0.01
    decay_only = norm0 * (1 - (1 - lr * wd) ** updates)
    assert delta > 20 * decay_only, (delta, decay_only)


def test_dense_reward_rises(tiny_run: Path) -> None:
    t = trajectories(tiny_run).to_pandas()
    by_step = t.groupby("step")["reward"].mean()
    assert by_step.loc[[5, 6]].mean() > by_step.loc[[1, 2]].mean() + 0.05, by_step.to_dict()


@pytest.mark.tier1
def test_trajectory_schema_and_readers(tiny_run: Path) -> None:
    files = sorted((tiny_run / "trajectories").glob("step=*/part-r*.parquet"))
    assert len(files) == 6
    meta = pq.read_schema(files[0]).metadata
    assert meta[b"rftpipe.schema_version"] == b"1"
    table = trajectories(tiny_run)
    assert set(table.column_names) >= REQUIRED
    assert "reward_dense_even_tokens" in table.column_names
    assert "step" not in pq.read_schema(files[0]).names  # it is the hive partition key
    df = pd.read_parquet(tiny_run / "trajectories")
    assert sorted(df["step"].astype(int).unique()) == list(range(1, 7))
    glob = str(tiny_run / "trajectories" / "*" / "*.parquet")
    n = duckdb.sql(f"select count(*), count(distinct step) from read_parquet('{glob}')").fetchall()[
        0
    ]
    assert len(df) == n[0] == table.num_rows == 6 * 4 * 4 and n[1] == 6
    # logprobs and advantages line up with the response tokens, row by row
    assert all(
        len(a) == len(b) == n_
        for a, b, n_ in zip(df["logprobs"], df["advantages"], df["response_length"], strict=True)
    )


def test_sync_rollout_logprobs_match_trained_weights(tiny_run: Path, tmp_path: Path) -> None:
    """Step s+1's sampling logprobs equal the step-s trained weights' logprobs."""
    from rftpipe.config.schema import TrainConfig
    from rftpipe.dist import Dist
    from rftpipe.engines.train.single import SingleDeviceEngine

    engine = SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), TrainConfig(), Dist())
    model = engine.model
    ckpts = {c.step: c for c in writer.list_committed(tiny_run / "checkpoints")}
    t = trajectories(tiny_run).to_pandas()
    for s in (2, 4):
        writer.load(ckpts[s], {"engine": engine})
        rows = t[t.step == s + 1]
        assert (rows.weight_version == s).all()
        mb = build_micro_batch(list(rows.prompt_token_ids), list(rows.response_token_ids), pad_id=0)
        with torch.no_grad():
            lp, _ = response_logprobs(model, mb, 1.0, with_entropy=False)
        recorded = torch.zeros_like(lp)
        for i, row in enumerate(rows.logprobs):
            recorded[i, : len(row)] = torch.tensor(row)
        diff = ((lp - recorded).abs() * mb.response_mask).max().item()
        assert diff < 1e-5, diff


# A single-turn run's metric names (trajectory schema version 1), frozen on 2026-11-25 when
# multi-turn runs gained episode/*: a new name for these runs is a deliberate change here.
SINGLE_TURN_METRICS = {
    "step",
    *(f"advantage/{k}" for k in ("mean", "std")),
    *(f"perf/{s}_{k}" for s in ORDER for k in ("s", "mem_peak_gib", "mem_increment_gib")),
    *(f"perf/{k}" for k in ("checkpoint_interval", "checkpoint_s", "checkpoint_wait_s")),
    # 2026-12-02: 1 where checkpoint.on_no_space=skip skipped the step's checkpoint
    "checkpoint/skipped_no_space",
    *("perf/commit_s", "perf/train_tflops", "perf/train_tokens_per_s"),
    "perf/run_mem_peak_gib",  # 2026-11-27: the process tree's peak so far
    *(f"rollout/{k}" for k in ("response_length", "stop_frac", "reward_mean", "reward_std")),
    *(f"rollout/reward_{k}" for k in ("dense_even_tokens", "errors", "timeouts")),
    # 2026-11-28: which weights sampled the step, and their lag (rollout.staleness)
    *("rollout/weight_version", "rollout/staleness"),
    # 2026-12-02: the HF loop's decode forwards and rows fed (rollout.compact_decode)
    *(f"rollout/decode_{k}" for k in ("forwards", "row_steps", "static_row_steps")),
    *(f"train/{k}" for k in ("clip_frac", "dual_clip_frac", "entropy", "grad_norm", "kl")),
    *(f"train/{k}" for k in ("kl_coef", "lr", "pg_loss", "ratio_mean", "tokens", "updates")),
    "train/skipped_micro_batches",
    # 2026-12-02: rows of all-alike groups left out of the update (train.skip_zero_advantage)
    "train/skipped_rows",
    "train/skipped_tokens",
    # 2026-11-28: each role's busy and idle seconds over the step (rftpipe.run.roles)
    *(f"perf/{r}_{k}_s" for r in ("generation", "training") for k in ("busy", "idle")),
}


def test_metrics_jsonl_one_line_per_step(tiny_run: Path) -> None:
    lines = [json.loads(x) for x in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 7))
    assert all("train/grad_norm" in m and "perf/rollout_s" in m for m in lines)
    # Only a GPU adds its memory peaks and MFU.
    for m in lines:
        names = {k for k in m if "_gpu_" not in k and k != "perf/mfu"}
        assert names == SINGLE_TURN_METRICS, names ^ SINGLE_TURN_METRICS


def test_resume_of_finished_run_is_a_noop_and_more_steps_extend(
    tiny_run: Path, tmp_path: Path
) -> None:
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(tiny_run, run)
    changed = submit(run)  # the tiny config without this run's weight_decay override
    assert changed.returncode == 2 and "train.weight_decay" in changed.stderr
    out = submit(run, config=None)
    assert out.returncode == 0 and "already complete" in out.stdout
    lower = submit(run, "total_steps=4", config=None)
    assert lower.returncode == 2 and "total_steps" in lower.stderr
    more = submit(run, "total_steps=8", config=None)
    assert more.returncode == 0, more.stderr
    assert sorted(trajectories(run).to_pandas().step.unique()) == list(range(1, 9))


def test_live_glob_never_sees_uncommitted_rows(tmp_path: Path) -> None:
    """Poll DuckDB over the dataset while a run writes it: every visible step is complete."""
    run = tmp_path / "live"
    cmd = [
        sys.executable,
        "-m",
        "jobs.submit",
        "--cluster",
        "local",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
        "total_steps=8",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    glob = str(run / "trajectories" / "*" / "*.parquet")
    while proc.poll() is None:
        if list((run / "trajectories").glob("*/*.parquet")):
            try:
                rows = duckdb.sql(
                    f"select step, count(*) from read_parquet('{glob}') group by step"
                ).fetchall()
            except duckdb.IOException:
                continue  # the glob matched a directory renamed away mid-listing: not a partial read
            for step, n in rows:
                assert n == 16, f"step {step} visible with {n} of 16 rows"
                seen.add(step)
        time.sleep(0.01)
    assert proc.returncode == 0
    assert len(seen) >= 3, seen  # the poll really overlapped the run


def _update_metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the machine's timings and the restart's own figures
    (`resume/*`: only a resumed process logs them; its replays are checked by event)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(("perf/", "resume/"))} for m in lines]


def test_actor_old_logprobs_with_tis_exact_under_replay(tmp_path: Path) -> None:
    """`train.old_logprobs=actor`: the advantage stage commits the actor's logprobs, which on
    the HF engine (same weights, same module) match the rollout's to float noise, so TIS
    weights are ~1. A kill after step 4's rollout commit makes the restart replay step 3's
    train (the checkpoint is step 2's) before step 4's advantage stage asks the actor: the
    run still ends identical to an uninterrupted one."""
    overrides = ("total_steps=4", "train.old_logprobs=actor", "train.rollout_correction=tis")
    ref = tmp_path / "ref"
    out = submit(ref, *overrides)
    assert out.returncode == 0, out.stderr
    t = trajectories(ref).to_pandas()
    assert "old_logprobs" in t.columns
    assert all(
        len(o) == len(r) == n
        for o, r, n in zip(t["old_logprobs"], t["logprobs"], t["response_length"], strict=True)
    )
    diff = max(
        abs(a - b)
        for o, r in zip(t["old_logprobs"], t["logprobs"], strict=True)
        for a, b in zip(o, r, strict=True)
    )
    metrics = _update_metrics(ref)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert max(m["rollout/logprob_abs_diff_max"] for m in metrics) == pytest.approx(diff)
    for m in metrics:
        assert 0 <= m["rollout/logprob_abs_diff_mean"] <= m["rollout/logprob_abs_diff_max"] < 1e-4
        assert abs(m["train/correction_weight_mean"] - 1) < 1e-4, m
        assert m["train/correction_masked_frac"] == 0.0, m

    run = tmp_path / "killed"
    # stage_after_commit: 5 per step, so the 16th is step 4's rollout.
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "15"}
    killed = submit(run, *overrides, env=env)
    assert killed.returncode != 0, killed.stdout[-2000:]
    out = submit(run, *overrides)
    assert out.returncode == 0, out.stderr
    replays = [e for e in events(run) if e["event"] == "replay"]
    assert [(e["step"], e["identical"]) for e in replays] == [(3, True)], replays
    assert trajectories(run).equals(trajectories(ref))
    assert _update_metrics(run) == metrics


def test_a_replay_on_other_cpu_kernels_is_reported(tmp_path: Path) -> None:
    """A run killed after step 1's train commit (no checkpoint yet) and resumed on other
    CPU kernels (`ATEN_CPU_CAPABILITY=default`, the scalar ones, as a node with another
    CPU would pick) replays step 1 on another platform: the replay event names what
    changed, step 1's metrics (the first the resumed process logs) carry `resume/*`, and
    `rftpipe status` says so."""
    run = tmp_path / "run"
    steps = ("total_steps=1",)
    # stage_after_commit: rollout, score, advantage, train; the 4th is step 1's train.
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "3"}
    assert submit(run, *steps, env=env).returncode != 0
    manifest = json.loads((run / "stages" / "step=1" / "train" / "MANIFEST.json").read_text())
    recorded = manifest["platform"]
    assert recorded["torch"] == torch.__version__ and recorded["threads"] == 1
    if recorded["aten_cpu_capability"] == "DEFAULT":
        pytest.skip("this machine's ATen CPU kernels are the scalar ones only")
    out = submit(run, *steps, config=None, env={"ATEN_CPU_CAPABILITY": "default"})
    assert out.returncode == 0, out.stderr[-3000:]
    replays = [e for e in events(run) if e["event"] == "replay"]
    assert len(replays) == 1 and replays[0]["step"] == 1, replays
    changed = {"aten_cpu_capability": [recorded["aten_cpu_capability"], "DEFAULT"]}
    assert replays[0]["platform_changed"] == changed, replays
    m = {x["step"]: x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert list(m) == [1]
    assert m[1]["resume/platform_changed"] == 1.0
    assert m[1]["resume/replay_identical"] == float(replays[0]["identical"])
    assert m[1]["resume/replay_max_rel_diff"] == replays[0]["max_rel_diff"] < 1e-4
    status = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(run)], capture_output=True, text=True, cwd=ROOT
    )
    assert status.returncode == 0, status.stderr
    line = [x for x in status.stdout.splitlines() if x.startswith("replay:")]
    assert len(line) == 1 and "step 1" in line[0], status.stdout
    assert f"aten_cpu_capability {recorded['aten_cpu_capability']} -> DEFAULT" in line[0], line


def test_remax_greedy_baseline_rows(tmp_path: Path) -> None:
    """`advantage.estimator=remax`: the rollout commits one greedy row per prompt
    (sample_idx n, `is_baseline`), the score stage scores it, its reward is the baseline of
    the group's advantages, and neither the train stage nor the reward metrics see it."""
    run = tmp_path / "run"
    out = submit(run, "total_steps=2", "advantage.estimator=remax")
    assert out.returncode == 0, out.stderr
    t = trajectories(run).to_pandas()
    greedy = t[t["is_baseline"]]
    samples = t[~t["is_baseline"]]
    assert len(greedy) == 2 * 4 and len(samples) == 2 * 4 * 4
    assert set(greedy["sample_idx"]) == {4}
    assert all(a == 0.0 for row in greedy["advantages"] for a in row)
    for (step, pid), rows in samples.groupby(["step", "prompt_id"]):
        (b,) = greedy[(greedy["step"] == step) & (greedy["prompt_id"] == pid)]["reward"]
        for adv, r in zip(rows["advantages"], rows["reward"], strict=True):
            # float32 column: r - b to float32 precision on every token
            assert all(abs(a - (r - b)) < 1e-6 for a in adv)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        step_samples = samples[samples["step"] == m["step"]]
        assert m["train/tokens"] == step_samples["response_length"].sum()  # one epoch
        assert abs(m["rollout/reward_mean"] - step_samples["reward"].mean()) < 1e-9
        step_greedy = greedy[greedy["step"] == m["step"]]
        assert abs(m["rollout/baseline_reward_mean"] - step_greedy["reward"].mean()) < 1e-9
    # The run-directory tool leaves them out of its statistics too.
    r = subprocess.run(
        [sys.executable, "-m", "rftpipe.inspect", str(run), "summary", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for row in json.loads(r.stdout):
        step_samples = samples[samples["step"] == row["step"]]
        assert abs(row["rollout/reward_mean"] - step_samples["reward"].mean()) < 1e-9
