"""Restart time against run length: spawn to the first new rollout, N committed steps vs none.

    python -m tools.bench restart [--steps 10,100,1000] [--repeats 3] [--out runs/bench-restart]
                                  [--json FILE] [--drop-caches | --no-drop-caches]
                                  [--keep-runs] [--override KEY=VALUE ...]

Method. For each N in --steps, a real run of the tiny config (configs/tiny_dense.yaml) with
N committed steps is built through `jobs.submit`, with overrides that make a step cheap
(`BUILD_OVERRIDES`: one prompt x two samples of two tokens, one mini-batch, no eval, no
wandb) and a checkpoint interval longer than any run, so the only checkpoint is the one the
final step always writes (`driver.maybe_checkpoint`): the restart loads it and replays no
train step. A step still commits all five stages (12 shard and manifest files plus a
published trajectory file), which is what a restart's checks walk over. The tiny data set
(20 prompts) is enough at any N: the sampler wraps into new epochs (`rftpipe.data.sampler`). The
tiny model's checkpoint is about 1 MB, so what grows with N here is the per-step part of a
restart; reading a real model's checkpoint adds a constant, independent of N (the `trl`
benchmark times a SmolLM2 restart).

Each measurement spawns `python -m jobs.submit` in a new session and takes the wall time
`t` of the worker's `stage_begin` event of the rollout stage (written just before the first stage it
computes) minus the spawn time; `start` (written after the restart's cleanup and file
checks, before the checkpoint restore) splits it into "to start" and the rest. Then the
whole process group is killed.
- Restart: `total_steps=N+1` on a fresh copy of the N-step run, timed to step N+1's
  rollout `stage_begin`. A copy per repeat, not the built run itself: the restart changes the run
  as soon as it starts (promotes the new config, rewrites metrics.jsonl, appends events)
  and the tiny step N+1 may commit before the kill lands, so reusing one directory would
  make every repeat restart a different run. The copy is made (and synced) before the
  clock starts and deleted afterwards.
- Cold start: `total_steps=1` on an empty run directory, timed to step 1's
  rollout `stage_begin`. It includes the same interpreter, torch and model start-up, so
  restart - cold is the cost of resuming, and restart / cold the ratio.
Repeats are interleaved (cold, then every N, per round) so drift on the machine falls on
all alike. The table reports medians over repeats; restart/cold and restart-cold are the
medians of each round's restart against that round's cold start.

--drop-caches (default: on when /proc/sys/vm/drop_caches is writable, i.e. as root) runs
`sync` and drops the page cache before every measurement. It matters because a restart
after a preemption or requeue usually lands on another node, whose cache holds none of
the run's files: every shard a restart checks, and the checkpoint it loads, is then read
from disk (or a network filesystem), not from memory, and the copy made for the repeat
would otherwise sit in the cache. With the cache dropped the interpreter, torch and the
model load cold too, for restart and cold start alike. Dropping the cache affects the whole
machine (other processes' reads get slower for a while).

Output: a table on stdout and JSON (--json, default OUT/bench_restart.json) with the
settings, the build of each run (seconds, files, bytes) and each measurement; the table
again beside the JSON, as Markdown (bench_restart.md).
--keep-runs keeps the built runs under OUT/runs and reuses a complete one with the same
overrides on the next invocation (to compare two code versions on identical runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.bench import Benchmark
from tools.bench.harness import ROOT, Session, alternate, fenced, parser, write_report

CONFIG = ROOT / "configs" / "tiny_dense.yaml"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")

#: What makes a tiny step cheap while keeping every stage, commit and the final checkpoint.
BUILD_OVERRIDES: tuple[str, ...] = (
    "data.prompts_per_step=1",
    "rollout.n=2",
    "rollout.max_new_tokens=2",
    "train.mini_batches=1",
    "train.micro_batch_size=2",
    # Only the final step checkpoints (it always does), so the restart replays nothing.
    "checkpoint.interval=1000000000",
    "checkpoint.keep_last=1",
    "eval.size=0",
    "logging.wandb=off",
    "logging.progress=false",
)


# ------------------------------------------------------------------------------- helpers


def parse_steps(text: str) -> list[int]:
    """'10,100,1000' -> [10, 100, 1000] (sorted, deduplicated, each >= 1)."""
    try:
        steps = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--steps: not a list of integers: {text!r}") from exc
    if not steps or steps[0] < 1:
        raise argparse.ArgumentTypeError(f"--steps: need integers >= 1, got {text!r}")
    return steps


def submit_cmd(run_dir: Path, total_steps: int, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jobs.submit",
        "--cluster",
        "local",
        "--config",
        str(CONFIG),
        "--run-dir",
        str(run_dir),
        f"total_steps={total_steps}",
        *overrides,
    ]


def read_events(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """Complete event lines from byte `offset` on (a line still being written is skipped)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    out = []
    for line in data.split(b"\n"):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def first_event(
    events: list[dict[str, Any]], name: str, step: int | None = None, stage: str | None = None
) -> float | None:
    for e in events:
        if (
            e.get("event") == name
            and (step is None or e.get("step") == step)
            and (stage is None or e.get("stage") == stage)
        ):
            return e["t"]
    return None


def tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under `root`."""
    files = size = 0
    for p in root.rglob("*"):
        if p.is_file():
            files += 1
            size += p.stat().st_size
    return files, size


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


def caches_droppable() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{rev}{'-dirty' if dirty else ''}" if rev else "unknown"


def summarize(
    builds: dict[int, dict[str, Any]],
    cold: list[dict[str, float]],
    restarts: dict[int, list[dict[str, float]]],
) -> dict[str, Any]:
    """Medians per N and against the cold start (the JSON's `summary`)."""
    med = statistics.median
    cold_s = med(r["to_rollout_s"] for r in cold)
    out: dict[str, Any] = {
        "cold_start_s": cold_s,
        "cold_to_start_s": med(r["to_start_s"] for r in cold),
        "restart": {},
    }
    for n, runs in sorted(restarts.items()):
        restart_s = med(r["to_rollout_s"] for r in runs)
        # Paired with the cold start of the same round, so drift between rounds cancels.
        pairs = list(zip(runs, cold, strict=True))
        out["restart"][str(n)] = {
            "steps": n,
            "files": builds[n]["files"],
            "bytes": builds[n]["bytes"],
            "build_s": builds[n]["build_s"],
            "restart_s": restart_s,
            "to_start_s": med(r["to_start_s"] for r in runs),
            "start_to_rollout_s": med(r["to_rollout_s"] - r["to_start_s"] for r in runs),
            "ratio_to_cold": med(r["to_rollout_s"] / c["to_rollout_s"] for r, c in pairs),
            "overhead_s": med(r["to_rollout_s"] - c["to_rollout_s"] for r, c in pairs),
            "runs_s": [round(r["to_rollout_s"], 3) for r in runs],
        }
    return out


def report(summary: dict[str, Any]) -> str:
    head = (
        f"{'steps':>7}{'files':>8}{'MB':>8}{'build s':>9}{'restart s':>11}{'to start':>10}"
        f"{'cold s':>8}{'restart/cold':>14}{'restart-cold s':>16}"
    )
    lines = [head]
    cold = summary["cold_start_s"]
    for r in summary["restart"].values():
        lines.append(
            f"{r['steps']:>7}{r['files']:>8}{r['bytes'] / 1e6:>8.1f}{r['build_s']:>9.1f}"
            f"{r['restart_s']:>11.2f}{r['to_start_s']:>10.2f}{cold:>8.2f}"
            f"{r['ratio_to_cold']:>13.2f}x{r['overhead_s']:>16.2f}"
        )
    lines += [
        f"cold start: {cold:.2f} s from spawn to step 1's rollout stage_begin "
        f"({summary['cold_to_start_s']:.2f} s to 'start')",
        "restart: spawn to step N+1's rollout stage_begin; to start: to the 'start' event (after the",
        "restart's file checks); medians over repeats, the last two paired per round",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- processes


def time_to_rollout(
    cmd: list[str], run_dir: Path, step: int, log: Path, timeout: float
) -> dict[str, float]:
    """Spawn `cmd`, wait for rollout `stage_begin` of `step` in the run's new events, kill it."""
    events_path = run_dir / "events.jsonl"
    offset = events_path.stat().st_size if events_path.exists() else 0
    sp = Session(cmd, log)

    def reached() -> dict[str, float] | None:
        new = read_events(events_path, offset)
        t_roll = first_event(new, "stage_begin", step, stage="rollout")
        if t_roll is None:
            return None
        t_start = first_event(new, "start")
        return {
            "to_rollout_s": t_roll - sp.t0,
            "to_start_s": (t_start if t_start is not None else t_roll) - sp.t0,
        }

    try:
        got = sp.wait_for(reached, interval=0.02, timeout=timeout)
        if got is None and sp.proc.poll() is not None:
            raise SystemExit(
                f"{' '.join(cmd)} exited with {sp.proc.returncode} before step {step}'s "
                f"rollout began:\n{sp.tail()}"
            )
        if got is None:
            raise SystemExit(
                f"no rollout stage_begin for step {step} after {timeout} s:\n{sp.tail()}"
            )
        return got
    finally:
        sp.kill()


# ---------------------------------------------------------------------------------- build


def build_run(runs: Path, n: int, overrides: list[str], reuse: bool) -> dict[str, Any]:
    """The N-step run under `runs`, built through jobs.submit (or reused, see --keep-runs)."""
    run_dir = runs / f"steps-{n}"
    record = runs / f"steps-{n}.build.json"
    if reuse and record.exists() and run_dir.exists():
        info = json.loads(record.read_text())
        if info.get("overrides") == overrides and complete(run_dir, n):
            print(f"reusing {run_dir} (built in {info['build_s']:.1f} s)", flush=True)
            return {**info, "reused": True}
    shutil.rmtree(run_dir, ignore_errors=True)
    log = runs / f"steps-{n}.build.log"
    t0 = time.time()
    with open(log, "wb") as f:
        code = subprocess.run(
            submit_cmd(run_dir, n, overrides), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    build_s = time.time() - t0
    if code or not complete(run_dir, n):
        raise SystemExit(
            f"building {run_dir} failed (exit {code}):\n{log.read_text(errors='replace')[-2000:]}"
        )
    files, size = tree_size(run_dir)
    info = {"steps": n, "build_s": build_s, "files": files, "bytes": size, "overrides": overrides}
    record.write_text(json.dumps(info, indent=1))
    print(f"built {n} steps in {build_s:.1f} s ({files} files, {size / 1e6:.1f} MB)", flush=True)
    return {**info, "reused": False}


def complete(run_dir: Path, n: int) -> bool:
    """N committed steps, nothing beyond, and a committed checkpoint at step N."""
    from rftpipe.checkpoint.folder import committed_checkpoints
    from rftpipe.stages import FINAL
    from rftpipe.storage.layout import RunDir
    from rftpipe.storage.stage_store import StageStore

    run = RunDir(run_dir)
    ckpts = committed_checkpoints(run.checkpoints)
    return StageStore(run).newest_complete_step(FINAL) == n and bool(ckpts) and ckpts[-1][0] == n


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    drop = caches_droppable() if a.drop_caches is None else a.drop_caches
    if drop and not caches_droppable():
        raise SystemExit(f"--drop-caches: {DROP_CACHES} is not writable (run as root)")
    out = Path(a.out).resolve()
    runs = out / "runs"
    for d in (runs, out / "logs"):
        d.mkdir(parents=True, exist_ok=True)
    overrides = [*BUILD_OVERRIDES, *a.override]

    builds = {n: build_run(runs, n, overrides, a.keep_runs) for n in a.steps}
    cold, restarts = measure_rounds(a, out, overrides, drop)
    shutil.rmtree(out / "scratch", ignore_errors=True)
    if not a.keep_runs:
        shutil.rmtree(runs)

    summary = summarize(builds, cold, restarts)
    result = {
        "settings": {
            "steps": a.steps,
            "repeats": a.repeats,
            "drop_caches": drop,
            "config": str(CONFIG.relative_to(ROOT)),
            "overrides": overrides,
            "git": git_revision(),
            "cpus": os.cpu_count(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "summary": summary,
        "builds": {str(n): b for n, b in builds.items()},
        "runs": {"cold": cold, "restart": {str(n): r for n, r in restarts.items()}},
    }
    json_path = Path(a.json) if a.json else out / "bench_restart.json"
    text = report(summary)
    md = write_report(json_path, result, fenced(text), "Restart time against run length")
    print(text)
    print(f"json: {json_path}\nreport: {md}")
    return 0


def measure_rounds(
    a: argparse.Namespace, out: Path, overrides: list[str], drop: bool
) -> tuple[list[dict[str, float]], dict[int, list[dict[str, float]]]]:
    """`--repeats` rounds, each a cold start and then a restart of every N (no warm-up:
    each is a fresh process), so drift on the machine falls on all alike: (the cold
    starts, each N's restarts), in round order."""
    scratch, logs, runs = out / "scratch", out / "logs", out / "runs"
    now = {"round": 0}

    def measure(cmd: list[str], run_dir: Path, step: int, log: str) -> dict[str, float]:
        if drop:
            drop_caches()
        return time_to_rollout(cmd, run_dir, step, logs / f"{log}-{now['round']}.log", a.timeout)

    def cold() -> dict[str, float]:
        shutil.rmtree(scratch, ignore_errors=True)  # what the round before left
        cold_dir = scratch / "cold"
        res = measure(submit_cmd(cold_dir, 1, overrides), cold_dir, 1, "cold")
        shutil.rmtree(cold_dir)
        return res

    def restart(n: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            # A fresh copy per repeat: the restart changes the run it starts on.
            copy = scratch / f"restart-{n}"
            shutil.copytree(runs / f"steps-{n}", copy, symlinks=True)
            res = measure(submit_cmd(copy, n + 1, overrides), copy, n + 1, f"restart-{n}")
            shutil.rmtree(copy)
            return res

        return run

    def progress(i: int, res: dict[str, dict[str, float]]) -> None:
        line = [f"round {i + 1}/{a.repeats}: cold {res['cold']['to_rollout_s']:.2f} s"]
        line += [f"{n} steps {res[str(n)]['to_rollout_s']:.2f} s" for n in a.steps]
        print(", ".join(line), flush=True)
        now["round"] = i + 1

    sides = {"cold": cold, **{str(n): restart(n) for n in a.steps}}
    rounds = alternate(sides, a.repeats, warmup=0, after_round=progress)
    return rounds.runs["cold"], {n: rounds.runs[str(n)] for n in a.steps}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("restart", __doc__)
    p.add_argument(
        "--steps",
        type=parse_steps,
        default=parse_steps("10,100,1000"),
        help="run lengths N, comma-separated (default 10,100,1000)",
    )
    p.add_argument("--repeats", type=int, default=3, help="measurements per N and cold starts")
    p.add_argument("--out", default="runs/bench-restart", help="work directory (runs, logs)")
    p.add_argument("--json", default=None, help="JSON result (default OUT/bench_restart.json)")
    p.add_argument(
        "--drop-caches",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sync and drop the page cache before each measurement "
        "(default: on when /proc/sys/vm/drop_caches is writable)",
    )
    p.add_argument(
        "--keep-runs",
        action="store_true",
        help="keep the built runs under OUT/runs and reuse complete ones with the same overrides",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (after BUILD_OVERRIDES)",
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds a measurement may take to its rollout"
    )
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


BENCHMARK = Benchmark(
    name="restart",
    runs="tiny-config runs of N committed steps (10, 100, 1000), each restarted for one more "
    "step in a fresh process, alternating with cold starts of an empty run",
    measures="seconds from spawn to the restart's first new rollout against a cold start's, "
    "per N: whether a restart's cost grows with the run's length",
    main=main,
)

if __name__ == "__main__":
    sys.exit(main())
