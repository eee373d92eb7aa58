"""Benchmark `rftpipe inspect RUN summary` on a synthetic run of realistic size.

    python -m tools.bench inspect [--steps 100] [--rows-per-step 10000] [--repeat 3]

Writes STEPS x ROWS trajectory rows (default 1,000,000) under a temporary RUN in /tmp, with
the list columns at realistic lengths (response tokens, logprobs and per-token advantages
200-400 entries, prompt tokens ~100), plus the minimal stage manifests summary needs; times
the in-process `summarize` call and prints the median; deletes the data afterwards.

Advantages are drawn per token (as GAE produces them), not one value per sequence (as
GRPO broadcasts it): incompressible floats are the worst case for the one list column that
summary has to decode.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rftpipe.inspect.summary import summarize
from tools.bench import Benchmark
from tools.bench.harness import parser

VOCAB = 151_936
STAGES = ("rollout", "score", "advantage", "train", "sync")


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def _list(values: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    # One offsets buffer for the whole column: no per-row Python objects are created.
    return pa.ListArray.from_arrays(pa.array(_offsets(lengths)), pa.array(values))


def _text(rng: np.random.Generator, lengths: np.ndarray) -> pa.StringArray:
    """Printable ASCII strings of the given lengths, built straight from Arrow buffers."""
    data = rng.integers(32, 127, int(lengths.sum()), dtype=np.uint8)
    offsets = _offsets(lengths)
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets), pa.py_buffer(data))


def make_step(rng: np.random.Generator, step: int, n: int) -> pa.Table:
    resp_len = rng.integers(200, 401, n).astype(np.int32)
    prompt_len = rng.integers(80, 121, n).astype(np.int32)
    tokens = int(resp_len.sum())
    finish = pc.take(pa.array(["stop", "length"]), pa.array(rng.random(n) < 0.1, pa.int8()))
    acc = (rng.random(n) < 0.4).astype(np.float64)
    fmt = rng.random(n)
    group = 8  # samples per prompt
    return pa.table(
        {
            "prompt_id": pa.array(step * n // group + np.arange(n) // group, pa.int64()),
            "sample_idx": pa.array(np.arange(n) % group, pa.int32()),
            "rank": pa.array(np.zeros(n, np.int32)),
            "prompt": _text(rng, prompt_len * 4),
            "prompt_token_ids": _list(
                rng.integers(0, VOCAB, int(prompt_len.sum()), dtype=np.int32), prompt_len
            ),
            "response": _text(rng, resp_len * 4),
            "response_token_ids": _list(rng.integers(0, VOCAB, tokens, dtype=np.int32), resp_len),
            "response_length": pa.array(resp_len),
            "finish_reason": finish,
            "logprobs": _list(-rng.exponential(1.0, tokens).astype(np.float32), resp_len),
            "answer": pc.take(pa.array([str(i) for i in range(100)]), rng.integers(0, 100, n)),
            "metadata": pa.array(np.full(n, '{"source_dataset": "synthetic"}', dtype=object)),
            "weight_version": pa.array(np.full(n, step - 1, np.int64)),
            "reward_accuracy": pa.array(acc),
            "reward_format": pa.array(fmt),
            "reward": pa.array(acc + 0.1 * fmt),
            "advantages": _list(rng.standard_normal(tokens).astype(np.float32), resp_len),
        }
    )


def write_run(root: Path, steps: int, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        d = root / "trajectories" / f"step={step}"
        d.mkdir(parents=True)
        # zstd, one file per rank, default row groups: what the pipeline's sync stage writes.
        pq.write_table(make_step(rng, step, rows), d / "part-r0.parquet", compression="zstd")
        for stage in STAGES:
            m: dict[str, object] = {"step": step, "stage": stage, "seconds": float(rng.random())}
            if stage == "train":
                names = ("kl", "clip_frac", "entropy", "pg_loss", "grad_norm")
                m["metrics"] = {f"train/{k}": float(rng.random()) for k in names}
            sd = root / "stages" / f"step={step}" / stage
            sd.mkdir(parents=True)
            (sd / "MANIFEST.json").write_text(json.dumps(m))


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = parser("inspect", __doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rows-per-step", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="summary threads (default: cores)")
    p.add_argument("--keep", action="store_true", help="leave the dataset in place")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-inspect-", dir="/tmp")) / "run"
    try:
        t0 = time.perf_counter()
        write_run(root, args.steps, args.rows_per_step)
        size = du(root / "trajectories")
        print(
            f"wrote {args.steps * args.rows_per_step:,} rows, {size / 2**30:.2f} GiB "
            f"in {time.perf_counter() - t0:.1f} s: {root}"
        )
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            rows = summarize(root, threads=args.threads)
            times.append(time.perf_counter() - t)
        assert len(rows) == args.steps and rows[0]["rollout/samples"] == args.rows_per_step
        runs = ", ".join(f"{t:.2f}" for t in times)
        print(f"summary: median {statistics.median(times):.2f} s over {args.repeat} runs ({runs})")
    finally:
        if not args.keep:
            shutil.rmtree(root.parent, ignore_errors=True)
    return 0


BENCHMARK = Benchmark(
    name="inspect",
    runs="`rftpipe inspect RUN summary` (in process) on a synthetic run of realistic size "
    "written to /tmp (1,000,000 trajectory rows by default), then deleted",
    measures="median seconds of the summary over --repeat runs",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
