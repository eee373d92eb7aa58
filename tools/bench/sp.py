"""Sequence parallelism on one long row: per-rank peak memory and step time, sp 1 vs 2.

    MALLOC_MMAP_THRESHOLD_=65536 python -m tools.bench sp [--tokens 4096 8192] [--sp 1 2]
                                                          [--runs 3]

For each sp size, sp gloo ranks (one thread each) build the FSDP2 engine on builtin:tiny
with `train.sp_size=sp` and run one warm-up then `--runs` forward+backward steps of a
single row of N tokens (a 16-token prompt, the rest response; the loss is the mean
response logprob). Each step's peak resident memory above the resident memory just before
it is read from /proc/self/status after resetting the high-water mark through
/proc/self/clear_refs. Prints, per sp size and length, the median step seconds of rank 0
and the median (over steps) of the largest peak over ranks. Run it with the malloc
setting above, so that freed large blocks leave the resident set.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from tools.bench import Benchmark
from tools.bench.harness import (
    bench_cmd,
    fresh_ranks,
    markdown_row,
    markdown_table,
    parser,
    reset_rss_peak,
    rss_peak_since,
)


def worker(out: Path, sp: int, lengths: list[int], runs: int) -> None:
    import torch

    from rftpipe.config.schema import TrainConfig
    from rftpipe.dist import init_from_env
    from rftpipe.engines.models import load_causal_lm, prepare_tiny
    from rftpipe.engines.train import TRAIN_ENGINES

    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    cfg = TrainConfig(backend="fsdp2", sp_size=sp, packing=False)
    engine = TRAIN_ENGINES["fsdp2"](load_causal_lm(prepare_tiny(), "float32"), cfg, dist)
    rng = random.Random(0)
    results: dict[int, list[dict[str, float]]] = {}
    for n in lengths:
        prompt = [rng.randrange(5, 200) for _ in range(16)]
        response = [rng.randrange(5, 200) for _ in range(n - 16)]
        results[n] = []
        for i in range(runs + 1):
            torch.distributed.barrier()
            before = reset_rss_peak()
            t0 = time.perf_counter()
            with engine.train_mode():
                lp, _ = engine.forward([prompt], [response], 1.0, with_entropy=False)
                engine.backward(-lp.sum() / len(response))
            seconds = time.perf_counter() - t0
            peak = rss_peak_since(before) / 2**20
            engine.optimizer.zero_grad(set_to_none=True)
            if i:  # the first is the warm-up
                results[n].append({"seconds": seconds, "peak_mib": peak})
    (out / f"rank{dist.rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()


def launch(sp: int, lengths: list[int], runs: int) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = bench_cmd("sp", "--worker", tmp, "--sp", str(sp), "--runs", str(runs))
        cmd += ["--tokens", *map(str, lengths)]
        if any(r.code for r in fresh_ranks(cmd, sp, threads=1)):
            raise SystemExit(f"sp={sp}: a rank failed")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(sp)]
    out = {}
    for n in lengths:
        steps = list(zip(*(rank[str(n)] for rank in ranks), strict=True))
        out[n] = {
            "seconds": statistics.median(s[0]["seconds"] for s in steps),
            "peak_mib": statistics.median(max(r["peak_mib"] for r in s) for s in steps),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser("sp", __doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.sp[0], args.tokens, args.runs)
        return 0
    head = ["tokens", "sp", "peak above start per rank (MiB)", "step seconds (median)"]
    print(markdown_table(head))
    for sp in args.sp:
        for n, r in launch(sp, args.tokens, args.runs).items():
            print(markdown_row([n, sp, f"{r['peak_mib']:.1f}", f"{r['seconds']:.2f}"]), flush=True)
    return 0


BENCHMARK = Benchmark(
    name="sp",
    runs="sequence parallelism on one long row: sp gloo ranks of the FSDP2 engine on "
    "builtin:tiny (train.sp_size=sp), a warm-up then --runs forward+backward steps, per length",
    measures="per sp size and length, rank 0's median step seconds and the median over steps "
    "of the largest per-rank peak resident memory above its start",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
