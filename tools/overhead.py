"""Share of step time spent committing (shards, manifests, publish) and checkpointing.

    python -m tools.overhead RUN_DIR

Checkpoint time is amortised over its interval by summing it over all steps. Reads
RUN/metrics.jsonl, whose perf/* fields are measured by the driver around each stage.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

STAGE_KEYS = ("perf/rollout_s", "perf/score_s", "perf/advantage_s", "perf/train_s", "perf/sync_s")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    lines = (Path(args[0]) / "metrics.jsonl").read_text().splitlines()
    # Step 0 is the evaluation of the initial weights alone; evaluations are compute.
    rows = [r for r in map(json.loads, lines) if r["step"] >= 1]
    compute = sum(sum(r[k] for k in STAGE_KEYS) + r.get("perf/eval_s", 0.0) for r in rows)
    commit = sum(r.get("perf/commit_s", 0.0) for r in rows)
    ckpt = sum(r.get("perf/checkpoint_s", 0.0) for r in rows)
    total = compute + commit + ckpt
    steps = [
        sum(r[k] for k in STAGE_KEYS)
        + r.get("perf/eval_s", 0.0)
        + r.get("perf/commit_s", 0.0)
        + r.get("perf/checkpoint_s", 0.0)
        for r in rows
    ]
    print(f"steps: {len(rows)}  median step: {statistics.median(steps):.2f} s")
    print(
        f"commit share: {100 * commit / total:.2f} %  (median per step {statistics.median(r.get('perf/commit_s', 0.0) for r in rows) * 1000:.1f} ms)"
    )
    print(f"checkpoint share (amortised): {100 * ckpt / total:.2f} %")
    print(f"durability total: {100 * (commit + ckpt) / total:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
