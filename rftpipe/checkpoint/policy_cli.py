"""``python -m rftpipe.checkpoint.policy_cli``: the Young/Daly interval and its expected costs
for measured step, train and checkpoint seconds, next to fixed intervals
(`rftpipe.checkpoint.policy` is the library)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rftpipe.checkpoint import policy
from rftpipe.checkpoint.policy import HOUR_S, interval_costs, young_daly_interval


def main(argv: Sequence[str] | None = None) -> int:
    """The interval and its costs for measured figures, printed as a table."""
    p = argparse.ArgumentParser(
        prog="python -m rftpipe.checkpoint.policy_cli", description=policy.__doc__
    )
    p.add_argument("--step-s", type=float, required=True, help="seconds per plain step")
    p.add_argument("--train-s", type=float, required=True, help="train-stage seconds")
    p.add_argument("--ckpt-cost-s", type=float, required=True, help="seconds a checkpoint adds")
    p.add_argument("--commit-s", type=float, default=0.0, help="commit seconds per step")
    p.add_argument("--mtbf-hours", type=float, nargs="+", default=[4.0, 1.0])
    p.add_argument("--interval", type=int, nargs="*", default=[20], help="fixed intervals to cost")
    a = p.parse_args(argv)
    print(
        f"step {a.step_s} s, train {a.train_s} s, checkpoint {a.ckpt_cost_s} s, "
        f"commit {1000 * a.commit_s:.0f} ms"
    )
    print(
        f"{'MTBF':>6} {'rule':<20} {'k':>4} {'ckpt %':>7} {'durab %':>8} "
        f"{'replay s':>9} {'replay %':>9} {'total %':>8}"
    )
    for hours in a.mtbf_hours:
        m = hours * HOUR_S
        rules = [
            ("young sqrt(2CM)", young_daly_interval(a.ckpt_cost_s, a.step_s, m, order="young")),
            ("daly", young_daly_interval(a.ckpt_cost_s, a.step_s, m)),
            (
                "daly, replay-aware",
                young_daly_interval(a.ckpt_cost_s, a.step_s, m, replay_step_s=a.train_s),
            ),
            *((f"fixed {k}", k) for k in a.interval),
        ]
        for name, k in rules:
            c = interval_costs(
                k,
                ckpt_cost_s=a.ckpt_cost_s,
                step_s=a.step_s,
                replay_step_s=a.train_s,
                mtbf_s=m,
                commit_s=a.commit_s,
            )
            print(
                f"{hours:>5}h {name:<20} {k:>4} {100 * c.checkpoint_share:>7.2f} "
                f"{100 * c.durability_share:>8.2f} {c.replay_s:>9.1f} "
                f"{100 * c.replay_share:>9.2f} {100 * c.total_share:>8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
