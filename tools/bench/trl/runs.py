"""The TRL comparison's measurements, as the parent starts them: rftpipe's runs through
`jobs.submit` (with their checkpoints' cost and a restart), and the TRL and floor children.
Each is a fresh process (`tools.bench.harness`)."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tools.bench.harness import Session, bench_cmd, fresh_process
from tools.bench.trl.options import CONFIG, SHARED, config_interval, overrides, side_name


def submit_cmd(a: argparse.Namespace, run_dir: Path, steps: int, engine: str) -> list[str]:
    """`jobs.submit` of rftpipe's side: `steps` steps in `run_dir` on engine `engine`."""
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run_dir)]
    return [*cmd, "--config", str(CONFIG), *overrides(a, steps, engine)]


def sync_times(run_dir: Path) -> tuple[list[float], dict[int, float]]:
    """Wall seconds between consecutive step commits, and rollout-begin times by step."""
    ev = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    syncs = [e["t"] for e in ev if e["event"] == "commit" and e["stage"] == "sync"]
    begins = {
        e["step"]: e["t"] for e in ev if e["event"] == "stage_begin" and e["stage"] == "rollout"
    }
    return [b - a for a, b in zip(syncs, syncs[1:], strict=False)], begins


def stage_times(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-step stage seconds of steps 2..N (rollout, train, sync, commit)."""
    return {
        f"{k}_steps": [r[f"perf/{k}_s"] for r in rows[1:]]
        for k in ("rollout", "train", "sync", "commit")
    }


def bench_rftpipe(a: argparse.Namespace, work: Path, i: int, engine: str = "hf") -> dict[str, Any]:
    """rftpipe's run of pair `i` (durability on): its step and stage seconds; with
    `--ckpt-every`, its step time with each checkpoint's cost amortised over the default
    config's interval, and the restart to its first new rollout."""
    run_dir = work / f"{side_name('rftpipe', engine)}-{i}"
    gaps, rows, common = measure_run(a, run_dir, engine)
    if not a.ckpt_every:
        # No checkpoint inside the measured steps, no restart measured.
        shutil.rmtree(run_dir)
        return {**common, "step_s": statistics.mean(gaps)}
    plain, ckpt_steps, ckpt_cost = checkpoint_costs(a, run_dir, gaps, rows)
    by_step = {r["step"]: r for r in rows}
    resume_s = time_resume(a, run_dir, engine)
    shutil.rmtree(run_dir)  # ~3 GB of checkpoints per run; keep one run's worth at a time
    cost = statistics.median(ckpt_cost)
    interval = config_interval(a, cost, statistics.mean(plain), common["train_s"])
    return {
        **common,
        # Plain steps at their mean, checkpoints at their measured cost over the interval.
        "step_s": statistics.mean(plain) + cost / interval,
        "checkpoint_interval": interval,
        "checkpoint_cost_s": cost,
        "checkpoint_block_s": [by_step[c]["perf/checkpoint_s"] for c in ckpt_steps],
        "checkpoint_wait_s": [
            by_step[c + 1].get("perf/checkpoint_wait_s", 0.0) for c in ckpt_steps
        ],
        "resume_s": resume_s,
    }


def measure_run(
    a: argparse.Namespace, run_dir: Path, engine: str
) -> tuple[list[float], list[dict[str, Any]], dict[str, Any]]:
    """Run rftpipe's side to the end in a fresh process: (seconds between its step
    commits, its metrics rows, the figures every run reports)."""
    t_start = time.time()
    child = fresh_process(submit_cmd(a, run_dir, a.steps, engine))
    if child.code:
        raise SystemExit(f"rftpipe run {run_dir} failed with exit code {child.code}")
    gaps, begins = sync_times(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        gaps,
        rows,
        {
            "engine": engine,
            "raw_step_s": statistics.mean(gaps),
            "median_step_s": statistics.median(gaps),
            "steps": gaps,
            **stage_times(rows),
            "peak_rss_gib": child.peak_rss_gib,
            "wall_s": child.wall_s,
            "commit_s": statistics.median(r["perf/commit_s"] for r in rows[1:]),
            "train_s": statistics.median(r["perf/train_s"] for r in rows[1:]),
            "cold_start_s": begins[1] - t_start,
        },
    )


def checkpoint_costs(
    a: argparse.Namespace, run_dir: Path, gaps: list[float], rows: list[dict[str, Any]]
) -> tuple[list[float], list[int], list[float]]:
    """(the plain steps' seconds, the steps that checkpointed inside the measured ones,
    each checkpoint's cost): a checkpoint after step c blocks briefly, then is written while
    step c+1 rolls out; its whole cost is how much longer step c+1 took than the median
    plain step. gaps[k] is step k+2 (sync to sync)."""
    ckpt_steps = [r["step"] for r in rows if r["perf/checkpoint_s"] > 0 and r["step"] < a.steps]
    after = {c + 1 for c in ckpt_steps}
    plain = [g for k, g in enumerate(gaps) if k + 2 not in after]
    ckpt_cost = [max(0.0, gaps[c - 1] - statistics.median(plain)) for c in ckpt_steps]
    if not ckpt_cost:
        raise SystemExit(f"no checkpoint overlapped a measured step in {run_dir}")
    return plain, ckpt_steps, ckpt_cost


def time_resume(a: argparse.Namespace, run_dir: Path, engine: str) -> float | None:
    """The restart: one more step on the finished run, timed from the spawn to its first
    new rollout (None if it ended before one), then killed with all it started."""
    session = Session(submit_cmd(a, run_dir, a.steps + 1, engine))

    def rollout_begun() -> float | None:
        begin = sync_times(run_dir)[1].get(a.steps + 1)
        return None if begin is None else begin - session.t0

    try:
        return session.wait_for(rollout_begun, interval=0.05, timeout=math.inf)
    finally:
        session.kill()


def bench_child(
    kind: str, a: argparse.Namespace, work: Path, i: int, engine: str = "hf"
) -> dict[str, Any]:
    """One TRL or floor run in a fresh process. TRL with vLLM may fail on this machine (its
    colocate mode is written for GPUs): its error is recorded, not raised."""
    out = work / f"{side_name(kind, engine)}-{i}.json"
    flags = [f"--child={kind}", f"--child-out={out}", f"--child-engine={engine}"]
    flags += [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in SHARED and v is not None
    ]
    child = fresh_process(bench_cmd("trl", *flags))
    tolerated = kind == "trl" and engine != "hf"
    if child.code and not tolerated:
        raise SystemExit(f"{side_name(kind, engine)} run failed with exit code {child.code}")
    res = json.loads(out.read_text()) if out.exists() else {"error": f"exit code {child.code}"}
    res.update(peak_rss_gib=child.peak_rss_gib, wall_s=child.wall_s, engine=engine)
    return res
