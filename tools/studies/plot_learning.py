"""Plot a run's learning curve from its committed trajectory Parquet.

    python -m tools.studies.plot_learning RUN_DIR [--out curve.png]

Reads only RUN/trajectories (plain Parquet), so it works on a live or preempted run, and,
when the run evaluates held-out problems, RUN/eval.json: greedy accuracy (and, for
episodes, first-try accuracy) by evaluated step, dashed, beside the training rewards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.studies.plot_learning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument(
        "--out", type=Path, default=None, help="PNG path (default RUN/learning_curve.png)"
    )
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow.dataset as ds

    table = ds.dataset(args.run_dir / "trajectories", format="parquet", partitioning="hive")
    import pyarrow as pa

    # Numeric components only (`reward_status` and `reward_error` are text).
    rewards = [
        f.name
        for f in table.schema
        if f.name.startswith("reward_") and pa.types.is_floating(f.type)
    ]
    # A multi-turn run (trajectory schema version 2): turns per episode beside the length.
    turns = ["num_turns"] if "num_turns" in table.schema.names else []
    cols = [*rewards, *turns, "response_length", "step"]
    df = table.to_table(columns=cols).to_pandas()
    df["step"] = df["step"].astype(int)
    per_step = df.groupby("step").mean()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for c in per_step.columns:
        if c.startswith("reward_"):
            ax1.plot(per_step.index, per_step[c], marker="o", ms=3, label=c.removeprefix("reward_"))
    held = _held_out(args.run_dir / "eval.json")
    for key, label in (
        ("eval/greedy_accuracy", "held-out greedy accuracy"),
        ("eval/greedy_first_turn_accuracy", "held-out greedy, first try"),
    ):
        points = [(s, m[key]) for s, m in held if key in m]
        if points:
            xs, ys = zip(*points, strict=True)
            ax1.plot(xs, ys, ls="--", marker="s", ms=4, label=label)
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean over samples")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(per_step.index, per_step["response_length"], marker="o", ms=3, color="tab:gray")
    ax2.set_xlabel("step")
    ax2.set_ylabel("response length (tokens)")
    if turns:
        ax3 = ax2.twinx()
        ax3.plot(per_step.index, per_step["num_turns"], marker="s", ms=3, color="tab:red")
        ax3.set_ylabel("turns per episode", color="tab:red")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{args.run_dir.name}: reward components and response length")
    fig.tight_layout()
    out = args.out or args.run_dir / "learning_curve.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


def _held_out(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, eval/* metrics) of every committed evaluation, by step (none: no file)."""
    if not path.exists():
        return []
    steps = json.loads(path.read_text())["steps"]
    return sorted((int(s), m) for s, m in steps.items())


if __name__ == "__main__":
    sys.exit(main())
