"""Seconds per offload and per reload of an actor's optimizer state
(`train.offload_between_stages`), on one device with the `single` backend.

    python -m tools.bench offload [--model builtin:smollm2-135m-instruct] [--repeats 7]
                                  [--threads 1]

Builds the engine, gives AdamW its state with one real update (one row through the actor's
forward and backward), then offloads and reloads it `--repeats` times and prints the bytes
moved and the median, min and max seconds of each direction as JSON. On a CPU-only machine
both directions are host-to-host copies into fresh memory.
"""

from __future__ import annotations

import json
import statistics

import torch

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, resolve_model_path
from rftpipe.engines.train import TRAIN_ENGINES
from tools.bench import Benchmark
from tools.bench.harness import parser


def main(argv: list[str] | None = None) -> int:
    ap = parser("offload", __doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(offload_between_stages=True)
    model = load_causal_lm(resolve_model_path(args.model), "float32")
    engine = TRAIN_ENGINES["single"](model, cfg, Dist(), total_updates=1)
    with engine.train_mode():  # one update: AdamW's state exists as in a run
        lp, _ = engine.forward([[1, 2, 3]], [[4, 5]], 1.0, with_entropy=False)
        engine.backward(-lp.sum())
        engine.optimizer_step()
    offload, reload = [], []
    for _ in range(args.repeats):
        engine.reload()
        reload.append(engine.offload_record.reload_s)
        engine.offload()
        offload.append(engine.offload_record.offload_s)

    def summary(xs: list[float]) -> dict[str, float]:
        return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}

    print(
        json.dumps(
            {
                "model": args.model,
                "threads": args.threads,
                "repeats": args.repeats,
                "gib": engine.offload_record.bytes / 2**30,
                "offload": summary(offload),
                "reload": summary(reload),
            },
            indent=1,
        )
    )
    return 0


BENCHMARK = Benchmark(
    name="offload",
    runs="an actor's optimizer state (AdamW after one real update, single backend) offloaded "
    "and reloaded --repeats times (train.offload_between_stages)",
    measures="bytes moved and the median, min and max seconds of each direction",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
