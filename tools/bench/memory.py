"""Peak memory and step time per training backend and memory feature (CPU or GPU).

    python -m tools.bench memory --shape 135m --out docs/bench_memory_135m.json
    python -m tools.bench memory --summarize docs/bench_memory_135m.json   # the README table

Each configuration is a fresh set of processes running `tools.bench mfu` (the real train stage on
a synthetic GRPO batch), so each peak is its own: host memory is the process's high-water
resident set (largest rank), GPU memory torch's peak allocation. Sharded backends run on
`--ranks` processes (gloo on CPU, one thread each); `single` on one process with as many
threads, so all rows use the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from tools.bench import Benchmark
from tools.bench.harness import (
    bench_cmd,
    fresh_ranks,
    markdown_row,
    markdown_table,
    parser,
    write_json,
)

#: (backend, label, extra `tools.bench mfu` flags)
CONFIGS: list[tuple[str, str, tuple[str, ...]]] = [
    ("single", "baseline", ()),
    ("single", "gradient checkpointing", ("--gradient-checkpointing",)),
    ("single", "token budget", ("--max-tokens-per-micro-batch", "{budget}")),
    ("fsdp2", "baseline", ()),
    ("fsdp2", "gradient checkpointing", ("--gradient-checkpointing",)),
    ("fsdp2", "CPU offload (all)", ("--cpu-offload", "all")),
    ("zero2", "baseline", ()),
    ("zero2", "gradient checkpointing", ("--gradient-checkpointing",)),
    ("zero2", "CPU offload (optimizer)", ("--cpu-offload", "optimizer")),
    ("zero3", "baseline", ()),
    ("zero3", "gradient checkpointing", ("--gradient-checkpointing",)),
    ("zero3", "CPU offload (all)", ("--cpu-offload", "all")),
]

#: `--lora`: full fine-tuning against LoRA (rank 16 on every linear layer), per backend.
LORA_CONFIGS: list[tuple[str, str, tuple[str, ...]]] = [
    (backend, label, flags)
    for backend in ("single", "fsdp2", "zero2", "zero3")
    for label, flags in (("full", ()), ("LoRA r=16", ("--lora", "16")))
]


def run_one(a: argparse.Namespace, backend: str, flags: tuple[str, ...], dtype: str) -> dict:
    """One configuration in fresh processes (its ranks): `tools.bench mfu`'s record of it,
    or why it was skipped (the last line of a failed rank's stderr)."""
    world = 1 if backend == "single" else a.ranks
    budget = str(a.micro_batch * (a.prompt_len + a.response_len) // 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = bench_cmd(
            "mfu",
            *("--shape", a.shape, "--backends", backend, "--dtype", dtype),
            *("--prompts", str(a.prompts), "--samples", str(a.samples)),
            *("--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len)),
            *("--micro-batch", str(a.micro_batch), "--steps", str(a.steps)),
            *("--warmup", str(a.warmup), "--out", str(out)),
            *(("--model", a.model) if a.model else ()),
            *(f.format(budget=budget) for f in flags),
        )
        ranks = fresh_ranks(
            cmd, world, threads=max(1, (os.cpu_count() or 1) // world), capture=True
        )
        if any(r.code for r in ranks) or not out.exists():
            tail = next((r.stderr for r in ranks if r.code), ranks[0].stderr)
            return {"backend": backend, "skipped": tail.strip().splitlines()[-1][:300]}
        return json.loads(out.read_text())[0]


def measure(a: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype in a.dtypes:
        for backend, label, flags in LORA_CONFIGS if a.lora else CONFIGS:
            if a.backends and backend not in a.backends:
                continue
            r = run_one(a, backend, flags, dtype)
            r["feature"] = label
            r["dtype"] = dtype
            rows.append(r)
            print(_line(r), flush=True)
    return rows


def _cells(r: dict, gpu: bool = True) -> list[str]:
    """A configuration's row of the table."""
    cells = [r["backend"], r["feature"], r["dtype"]]
    if "skipped" in r:
        return [*cells, f"skipped: {r['skipped']}"]
    cells += [f"{r['step_s']:.2f} s", f"{r['peak_rss_gib']:.2f}"]
    if gpu:
        cells.append(f"{r['peak_mem_gib']:.2f}" if r.get("peak_mem_gib") is not None else "-")
    return cells


def _line(r: dict, gpu: bool = True) -> str:
    return markdown_row(_cells(r, gpu))


def summarize(rows: list[dict]) -> str:
    """The Markdown table of `rows` (a GPU memory column when any has one)."""
    gpu = any(r.get("peak_mem_gib") is not None for r in rows)
    head = ["backend", "feature", "dtype", "step (median)", "peak host memory (GiB, max rank)"]
    if gpu:
        head.append("peak GPU memory (GiB)")
    return markdown_table(head, [_cells(r, gpu) for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = parser("memory", __doc__)
    p.add_argument("--shape", default="135m", help="`tools.bench mfu` shape: tiny, 135m, 0.5b")
    p.add_argument("--model", default="", help="a model.path value (real weights) instead")
    p.add_argument("--lora", action="store_true", help="full fine-tuning vs LoRA rows instead")
    p.add_argument("--backends", nargs="*", default=[], help="subset of single fsdp2 zero2 zero3")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--ranks", type=int, default=2, help="processes for the sharded backends")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--summarize", type=Path, default=None, help="print the table of a results file")
    a = p.parse_args(argv)
    if a.summarize:
        print(summarize(json.loads(a.summarize.read_text())))
        return 0
    rows = measure(a)
    if a.out:
        write_json(a.out, rows)
    print(summarize(rows))
    return 0


BENCHMARK = Benchmark(
    name="memory",
    runs="`tools.bench mfu` once per training backend and memory feature (gradient "
    "checkpointing, token budget, CPU offload; or full against LoRA), each in fresh processes",
    measures="median step seconds, peak host memory (largest rank) and peak GPU memory of "
    "each configuration, as a Markdown table",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
