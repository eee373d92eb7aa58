"""Peak memory and step time per training backend and memory feature (CPU or GPU).

    python -m tools.bench_memory --shape 135m --out docs/bench_memory_135m.json
    python -m tools.bench_memory --summarize docs/bench_memory_135m.json   # the README table

Each configuration is a fresh set of processes running `tools.mfu` (the real train stage on
a synthetic GRPO batch), so each peak is its own: host memory is the process's high-water
resident set (largest rank), GPU memory torch's peak allocation. Sharded backends run on
`--ranks` processes (gloo on CPU, one thread each); `single` on one process with as many
threads, so all rows use the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (backend, label, extra tools.mfu flags)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(a: argparse.Namespace, backend: str, flags: tuple[str, ...], dtype: str) -> dict:
    world = 1 if backend == "single" else a.ranks
    budget = str(a.micro_batch * (a.prompt_len + a.response_len) // 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [
            sys.executable,
            "-m",
            "tools.mfu",
            "--shape",
            a.shape,
            "--backends",
            backend,
            "--dtype",
            dtype,
            "--prompts",
            str(a.prompts),
            "--samples",
            str(a.samples),
            "--prompt-len",
            str(a.prompt_len),
            "--response-len",
            str(a.response_len),
            "--micro-batch",
            str(a.micro_batch),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--out",
            str(out),
            *(("--model", a.model) if a.model else ()),
            *(f.format(budget=budget) for f in flags),
        ]
        threads = max(1, (os.cpu_count() or 1) // world)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "OMP_NUM_THREADS": str(threads),
        }
        procs = [
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            tail = next((e for e, p in zip(errs, procs, strict=True) if p.returncode), errs[0])
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


def _line(r: dict, gpu: bool = True) -> str:
    if "skipped" in r:
        return f"| {r['backend']} | {r['feature']} | {r['dtype']} | skipped: {r['skipped']} |"
    line = (
        f"| {r['backend']} | {r['feature']} | {r['dtype']} | {r['step_s']:.2f} s | "
        f"{r['peak_rss_gib']:.2f} |"
    )
    if gpu:
        line += f" {r['peak_mem_gib']:.2f} |" if r.get("peak_mem_gib") is not None else " - |"
    return line


def summarize(rows: list[dict]) -> str:
    gpu = any(r.get("peak_mem_gib") is not None for r in rows)
    head = "| backend | feature | dtype | step (median) | peak host memory (GiB, max rank) |"
    rule = "|---|---|---|---|---|"
    if gpu:
        head, rule = head + " peak GPU memory (GiB) |", rule + "---|"
    return "\n".join([head, rule, *(_line(r, gpu) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_memory", description=__doc__)
    p.add_argument("--shape", default="135m", help="tools.mfu shape: tiny, 135m, 0.5b")
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
        a.out.write_text(json.dumps(rows, indent=1))
    print(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
