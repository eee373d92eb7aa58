"""Where a run stands: ``python -m jobs.status RUN_DIR``.

Progress comes from the run directory (commit markers, checkpoints, the event log); the
job's state from `squeue`/`scontrol`, never `sacct` (which is off without slurmdbd and can
hang), so this always answers promptly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobs import slurm
from rftpipe.config.loader import load_config
from rftpipe.config.schema import RunConfig, skip_blockers
from rftpipe.stages import FINAL, chain_position
from rftpipe.stages.generation import ahead_line, generated_ahead
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore


def describe(run_dir: Path) -> dict:
    run = RunDir(run_dir)
    if not run.config_path.exists():
        raise SystemExit(f"rftpipe: error: run_dir: {run.root} has no config.yaml")
    cfg = load_config(RunConfig, run.active_config_path(), saved=True)
    store = StageStore(run)
    done = store.newest_complete_step(FINAL)
    last = store.newest_commit(chain_position)
    jobs_file = run.root / "slurm" / "jobs.txt"
    job_ids = jobs_file.read_text().split() if jobs_file.exists() else []
    events = []
    if run.events_path.exists():
        events = [json.loads(x) for x in run.events_path.read_text().splitlines()[-200:]]
    interesting = {
        "start",
        "stop",
        "requeue_decision",
        "requeue_failed",
        "idle_requeues",
        "no_space",
        "checkpoint_skipped",
        "user_error",
        "checkpoint",
        "repair",
    }
    return {
        "run_dir": str(run.root),
        "steps_committed": done,
        "total_steps": cfg.total_steps,
        "last_commit": list(last) if last else None,
        # rollout.staleness >= 1 commits later steps' generation before they train.
        "staleness": cfg.rollout.staleness,
        "generated_ahead": {str(k): v for k, v in generated_ahead(store).items()},
        "finished": done >= cfg.total_steps,
        "jobs": {j: slurm.job_state(j) for j in job_ids},
        "recent_events": [e for e in events if e.get("event") in interesting][-5:],
        "replays_to_note": replays_to_note(run),
        # The one line a run that ran out of space or quota stopped with (exit 75).
        "no_space": next(
            (e["message"] for e in reversed(events) if e.get("event") == "no_space"), None
        ),
        # Why the job ended FAILED instead of requeueing (launch.max_idle_requeues).
        "idle_requeues": next(
            (e["message"] for e in reversed(events) if e.get("event") == "idle_requeues"), None
        ),
        # train.skip_zero_advantage=auto that cannot skip here, and why.
        "skip_blocked": (
            list(skip_blockers(cfg).values()) if cfg.train.skip_zero_advantage == "auto" else []
        ),
    }


def replays_to_note(run: RunDir) -> list[dict]:
    """Every train step a resume replayed unlike its committed update, or on another
    platform than it was committed on (rank 0's events, the whole log: such a run is no
    longer bitwise an uninterrupted one, however long ago it happened)."""
    if not run.events_path.exists():
        return []
    out = []
    with open(run.events_path, encoding="utf-8") as f:
        for line in f:
            if '"replay"' not in line:  # parse only the few candidate lines of a long log
                continue
            e = json.loads(line)
            if e.get("event") != "replay" or e.get("rank", 0) != 0:
                continue
            if not e["identical"] or e.get("platform_changed"):
                out.append(
                    {
                        k: e.get(k)
                        for k in ("t", "step", "identical", "max_rel_diff", "platform_changed")
                    }
                )
    return out


def replay_line(r: dict) -> str:
    if r["identical"]:
        how = "identical to its committed update"
    else:
        diff = r["max_rel_diff"]
        what = "unknown" if diff is None else f"{diff:.3g}"
        how = f"unlike its committed update (largest relative difference {what})"
    changed = r["platform_changed"]
    if changed is None:
        platform = "the platform it was committed on is not recorded"
    elif not changed:
        platform = "on the platform it was committed on"
    else:
        platform = "on another platform: " + ", ".join(
            f"{k} {a} -> {b}" for k, (a, b) in changed.items()
        )
    return f"replay: step {r['step']} replayed {how}, {platform}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.status", description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    info = describe(args.run_dir)
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"run: {info['run_dir']}")
    state = "finished" if info["finished"] else "in progress"
    print(f"steps: {info['steps_committed']}/{info['total_steps']} committed ({state})")
    if info["last_commit"]:
        print(f"last commit: step {info['last_commit'][0]} {info['last_commit'][1]}")
    if info["generated_ahead"]:
        print(
            f"generated, not yet trained (rollout.staleness={info['staleness']}): "
            f"{ahead_line(info['generated_ahead'])}"
        )
    for job, st in info["jobs"].items():
        print(f"slurm job {job}: {st}")
    if info["no_space"] and not info["finished"]:
        print(f"stopped: {info['no_space']}")
    if info["idle_requeues"] and not info["finished"]:
        print(f"not requeued: {info['idle_requeues']}")
    for why in info["skip_blocked"]:
        print(f"train.skip_zero_advantage=auto does not skip all-alike groups: {why}")
    for r in info["replays_to_note"][-5:]:
        print(replay_line(r))
    for e in info["recent_events"]:
        fields = {k: v for k, v in e.items() if k not in ("t", "pid", "event")}
        print(f"event {e['event']}: {fields}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
