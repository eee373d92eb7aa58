"""Two configs' learning curves side by side, over seeds, from their runs' committed files.

    python -m tools.studies.compare_learning --a "MoE" RUN_A0 RUN_A1 ... \\
        --b "dense" RUN_B0 RUN_B1 ... [--out curves.png]

Each run's training accuracy per step (the mean `reward_accuracy` of its committed
trajectory rows) is a thin line; each side's mean over its runs a thick one; held-out greedy
accuracy (`metrics.jsonl`'s `eval/greedy_accuracy` at its evaluated steps) is in a second
panel, per run as dots and as the side's mean. Prints the held-out values per run and the
means per evaluated step as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _train_accuracy(run: Path) -> dict[int, float]:
    import pyarrow.dataset as ds

    table = ds.dataset(run / "trajectories", format="parquet", partitioning="hive").to_table(
        columns=["step", "reward_accuracy"]
    )
    by_step: dict[int, list[float]] = {}
    for step, acc in zip(
        table.column("step").to_pylist(), table.column("reward_accuracy").to_pylist(), strict=True
    ):
        by_step.setdefault(int(step), []).append(float(acc))
    return {s: statistics.mean(v) for s, v in sorted(by_step.items())}


def _held_out(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "eval/greedy_accuracy" in m:
            out[int(m["step"])] = float(m["eval/greedy_accuracy"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.studies.compare_learning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--a", nargs="+", required=True, metavar=("NAME", "RUN"))
    p.add_argument("--b", nargs="+", required=True, metavar=("NAME", "RUN"))
    p.add_argument("--out", type=Path, default=Path("curves.png"))
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    report: dict[str, dict] = {}
    for (name, *runs), color in ((args.a, "tab:orange"), (args.b, "tab:blue")):
        train = [_train_accuracy(Path(r)) for r in runs]
        held = [_held_out(Path(r)) for r in runs]
        steps = sorted(set.intersection(*(set(t) for t in train)))
        for t in train:
            top.plot(list(t), list(t.values()), color=color, alpha=0.3, linewidth=0.8)
        top.plot(steps, [statistics.mean(t[s] for t in train) for s in steps], color=color,
                 linewidth=2, label=f"{name} (mean of {len(runs)})")  # fmt: skip
        evals = sorted(set.intersection(*(set(h) for h in held)))
        means = {s: statistics.mean(h[s] for h in held) for s in evals}
        for h in held:
            bottom.plot(list(h), list(h.values()), "o", color=color, alpha=0.4)
        bottom.plot(evals, [means[s] for s in evals], "-o", color=color, linewidth=2, label=name)
        report[name] = {"runs": {r: h for r, h in zip(runs, held, strict=True)}, "mean": means}
    top.set_ylabel("training accuracy")
    bottom.set_ylabel("held-out greedy accuracy")
    bottom.set_xlabel("step")
    top.legend()
    bottom.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
