"""Share of step time spent committing (shards, manifests, publish) and checkpointing.

    python -m tools.bench overhead RUN_DIR

Checkpoint time is amortised over its interval by summing it over all steps. Reads
RUN/metrics.jsonl, whose perf/* fields are measured by the driver around each stage.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from tools.bench import Benchmark
from tools.bench.harness import parser

STAGE_KEYS = ("perf/rollout_s", "perf/score_s", "perf/advantage_s", "perf/train_s", "perf/sync_s")


def main(argv: list[str] | None = None) -> int:
    p = parser("overhead", __doc__)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory")
    a = p.parse_args(argv)
    lines = (a.run_dir / "metrics.jsonl").read_text().splitlines()
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


BENCHMARK = Benchmark(
    name="overhead",
    runs="nothing new: it reads a finished run's metrics.jsonl (RUN_DIR), as the driver "
    "measured each stage, commit and checkpoint",
    measures="the share of step time spent committing and checkpointing (amortised), and "
    "their total: the run's durability overhead",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
