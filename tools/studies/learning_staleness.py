"""What staleness costs in learning: the default task at several `rollout.staleness` k and
run seeds, held-out greedy accuracy by evaluated step and the training accuracy by step.

    python -m tools.studies.learning_staleness --root runs/learning \
        --out docs/learning_staleness.json [--ks 0 1 2] [--seeds 0 1 2] \
        [--extra-k 4 --extra-seeds 0] [--plot docs/learning_staleness.png] \
        [--set train.lr_schedule=linear ...]

Each (k, seed) is a run directory under --root (`k<k>-s<seed>`), run one after another with
`python -m jobs.submit`; a directory that already finished is only read, one that stopped
resumes, so the tool can be stopped and started again. k >= 1 runs with `rollout.overlap`
(the same results as without it, sooner), each thread on one core (`launch.threads=1`);
k = 0 with both cores. `--set` overrides go to every run alike (the recipe the comparison
holds fixed; the JSON records them). Reads only each run's eval.json and trajectories.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_smollm2_addition.yaml"
GREEDY = "eval/greedy_accuracy"


def run_overrides(k: int, seed: int, recipe: Sequence[str] = ()) -> list[str]:
    out = [f"seed={seed}", f"rollout.staleness={k}", *recipe]
    if k >= 1:
        out += ["rollout.overlap=true", "launch.threads=1"]
    return out


def run_one(root: Path, k: int, seed: int, recipe: Sequence[str] = ()) -> Path:
    run = root / f"k{k}-s{seed}"
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(CONFIG)] if not (run / "config.yaml").exists() else []
    cmd += run_overrides(k, seed, recipe)
    log = root / f"k{k}-s{seed}.log"
    with log.open("ab") as sink:
        code = subprocess.run(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"{run}: jobs.submit exited {code}; see {log}")
    return run


def read_run(run: Path) -> dict:
    """Held-out greedy accuracy by evaluated step, and the training accuracy (mean of the
    accuracy reward over the step's samples) by step."""
    import pyarrow.dataset as ds

    steps = json.loads((run / "eval.json").read_text())["steps"]
    held = {int(s): m[GREEDY] for s, m in steps.items() if GREEDY in m}
    table = ds.dataset(run / "trajectories", format="parquet", partitioning="hive").to_table(
        columns=["step", "reward_accuracy"]
    )
    df = table.to_pandas()
    df["step"] = df["step"].astype(int)
    train = df.groupby("step")["reward_accuracy"].mean()
    return {
        "held_out_greedy": {str(s): held[s] for s in sorted(held)},
        "train_accuracy": {str(int(s)): round(float(v), 4) for s, v in train.items()},
    }


def summarize(runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per k: the mean over seeds of the held-out greedy accuracy at each evaluated step,
    and its difference from k = 0's mean at that step."""
    means: dict[str, dict[str, float]] = {}
    for k, by_seed in runs.items():
        steps = sorted({s for r in by_seed.values() for s in r["held_out_greedy"]}, key=int)
        means[k] = {
            s: round(statistics.fmean(r["held_out_greedy"][s] for r in by_seed.values()), 4)
            for s in steps
        }
    base = means.get("0", {})
    return {
        k: {
            "seeds": sorted(runs[k], key=int),
            "mean_held_out_greedy": m,
            "minus_k0": {s: round(v - base[s], 4) for s, v in m.items() if s in base},
        }
        for k, m in means.items()
    }


def plot(runs: dict[str, dict[str, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (k, by_seed) in enumerate(sorted(runs.items(), key=lambda kv: int(kv[0]))):
        color = f"C{i}"
        for j, (_seed, r) in enumerate(sorted(by_seed.items())):
            label = f"k={k}" if j == 0 else None
            xs = [int(s) for s in r["held_out_greedy"]]
            ax1.plot(
                xs, list(r["held_out_greedy"].values()), "o-", color=color, alpha=0.6, label=label
            )
            xt = [int(s) for s in r["train_accuracy"]]
            ax2.plot(
                xt, list(r["train_accuracy"].values()), "-", color=color, alpha=0.5, label=label
            )
    ax1.set(xlabel="step", ylabel="held-out greedy accuracy (31 problems)", ylim=(-0.02, 1.02))
    ax2.set(xlabel="step", ylabel="training accuracy (mean over samples)", ylim=(-0.02, 1.02))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("rollout.staleness k: the default task, one line per seed")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.studies.learning_staleness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", type=Path, required=True, help="where the run directories go")
    p.add_argument("--out", type=Path, required=True, help="the JSON of every run's curves")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--extra-k", type=int, nargs="*", default=[4], help="k run on --extra-seeds")
    p.add_argument("--extra-seeds", type=int, nargs="*", default=[0])
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument(
        "--set",
        dest="recipe",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override given to every run (repeat for more)",
    )
    args = p.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    grid = [(k, s) for s in args.seeds for k in args.ks]
    grid += [(k, s) for k in args.extra_k for s in args.extra_seeds]
    runs: dict[str, dict[str, dict]] = {}
    for k, seed in grid:
        run = run_one(args.root, k, seed, args.recipe)
        runs.setdefault(str(k), {})[str(seed)] = read_run(run)
        print(f"k={k} seed={seed}: {runs[str(k)][str(seed)]['held_out_greedy']}", flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "config": str(CONFIG.relative_to(ROOT)),
        "recipe": list(args.recipe),
        "overrides": {
            f"k{k}": run_overrides(k, 0, args.recipe)[1:] for k in sorted({k for k, _ in grid})
        },
        "summary": summarize(runs),
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot is not None:
        plot(runs, args.plot)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
