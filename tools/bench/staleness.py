"""Throughput of off-policy steps (`rollout.staleness`, `rollout.overlap`) on this machine.

    python -m tools.bench staleness [--steps 6] [--fixed-length | --long-tail]
                                    [--variants k0,k1,k1-overlap,...] [--out FILE.json]

Runs the default task (`configs/grpo_smollm2_addition.yaml`, SmolLM2-135M-Instruct, no
evaluation) through `jobs.submit` once per variant, one after another, and reads each run's
event log. The responses are as the model writes them (mostly a few tokens, up to 16);
`--fixed-length` makes every one exactly 16 tokens (EOS masked until then), so every
variant does the same work whatever its weights sample; `--long-tail` lets them run to
96 tokens without the system prompt that asks for one number, so their lengths spread
out and a step waits on its longest.

Variants (`launch.threads` is the intra-op threads of each thread that computes; a
background generation thread and the trainer each get it, so 1 gives each a core of two):

- `k0`: the synchronous run, every stage on both cores in turn (threads 2);
- `k1`, `k2`: stale rollouts in the sequential order (threads 2);
- `k1-overlap`, `k2-overlap`: generation beside training, a core each (threads 1);
- `k1-overlap-t2`: the same with both threads asking for both cores (threads 2);
- `k1-overlap-rollout`: `k1-overlap` with `train.old_logprobs=rollout` (PPO's ratio
  against the sampling policy: no recomputation of the proximal logprobs);
- `k0-t1`: the synchronous run on one core (with `k0`, what `tools.studies.simulate_staleness`
  is calibrated on);
- `k1-disagg`, `k2-disagg`: two processes, one only generating (`launch.rollout_ranks=1`),
  a core each.

Figures per variant: the span from the first stage's begin to the last commit; the
steady step time, the median over steps 2.. of the time between consecutive sync
commits; completions (samples) per second at that rate; and per role, generation
(rollout, score) and training (advantage, train, sync), its busy seconds over the span
(the union of its stages' begin-commit intervals) and a time-line of 60 columns
(`g` generating, `t` training, `#` both, `.` neither); and each stage's median seconds
over steps 2.. (`stage_s`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from rftpipe.config.loader import load_config
from rftpipe.config.schema import RunConfig
from rftpipe.stages import GENERATION, chain_position
from tools.bench import Benchmark
from tools.bench.harness import ROOT, fresh_process, parser, write_json

CONFIG = ROOT / "configs" / "grpo_smollm2_addition.yaml"

VARIANTS: dict[str, tuple[str, ...]] = {
    "k0": ("launch.threads=2",),
    "k1": ("launch.threads=2", "rollout.staleness=1"),
    "k2": ("launch.threads=2", "rollout.staleness=2"),
    "k1-overlap": ("launch.threads=1", "rollout.staleness=1", "rollout.overlap=true"),
    "k2-overlap": ("launch.threads=1", "rollout.staleness=2", "rollout.overlap=true"),
    "k1-overlap-t2": ("launch.threads=2", "rollout.staleness=1", "rollout.overlap=true"),
    "k1-overlap-rollout": (
        "launch.threads=1",
        "rollout.staleness=1",
        "rollout.overlap=true",
        "train.old_logprobs=rollout",
    ),
    # The synchronous run on one core: with `k0`, the simulator's calibration.
    "k0-t1": ("launch.threads=1",),
    # Two processes (`launch.rollout_ranks`), a core each.
    "k1-disagg": ("launch.threads=1", "rollout.staleness=1", "launch.rollout_ranks=1"),
    "k2-disagg": ("launch.threads=1", "rollout.staleness=2", "launch.rollout_ranks=1"),
}
RANKS: dict[str, int] = {"k1-disagg": 2, "k2-disagg": 2}
"""Local ranks of the variants that need more than one."""
STAGES = ("rollout", "score", "advantage", "train", "sync")
LONG_TAIL = ("rollout.max_new_tokens=96", "data.system_prompt=null")
FIXED_LENGTH = ("rollout.min_new_tokens=16",)


def _intervals(events: list[dict[str, Any]], stages: tuple[str, ...]) -> list[tuple[float, float]]:
    """(begin, commit) times of the stages named `stages` (generation rounds too): the
    first rank's begin to the commit (separate rollout ranks generate on other ranks)."""
    begun: dict[tuple[int, str], float] = {}
    out = []
    for e in events:
        if e["event"] not in ("stage_begin", "commit"):
            continue
        # Chain stages only: not an episode's turn commits (`rollout.tN`) nor `eval`.
        if chain_position(e["stage"]) is None or e["stage"].split(".")[0] not in stages:
            continue
        key = (e["step"], e["stage"])
        if e["event"] == "stage_begin":
            begun.setdefault(key, e["t"])
        elif key in begun:
            out.append((begun.pop(key), e["t"]))
    return out


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _timeline(gen: list, train: list, t0: float, t1: float, width: int = 60) -> str:
    def on(ivs: list, t: float) -> bool:
        return any(a <= t < b for a, b in ivs)

    cells = []
    for i in range(width):
        t = t0 + (i + 0.5) * (t1 - t0) / width
        g, tr = on(gen, t), on(train, t)
        cells.append("#" if g and tr else "g" if g else "t" if tr else ".")
    return "".join(cells)


def measure(run: Path, samples_per_step: int) -> dict[str, Any]:
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    gen = _intervals(events, GENERATION)
    train = _intervals(events, ("advantage", "train", "sync"))
    # Each stage once, from its first begin to its first commit on any rank: another
    # rank's commit of the same stage (every rank commits it) is not a later stage.
    t0, t1 = min(a for a, _ in gen + train), max(b for _, b in gen + train)
    syncs = sorted(b for _, b in _intervals(events, ("sync",)))
    steps = [b - a for a, b in pairwise(syncs)]
    steady = statistics.median(steps)
    return {
        "span_s": round(t1 - t0, 2),
        "step_s": [round(s, 2) for s in steps],
        "steady_step_s": round(steady, 2),
        "completions_per_s": round(samples_per_step / steady, 3),
        "generation_busy_s": round(_busy(gen), 2),
        "training_busy_s": round(_busy(train), 2),
        "timeline": _timeline(gen, train, t0, t1),
        "stage_s": stage_seconds(run),
    }


def stage_seconds(run: Path) -> dict[str, float]:
    """Median seconds of each chain stage over steps 2.. (its manifest's `seconds`: the
    compute of the stage on its rank 0, without the commit)."""
    out = {}
    for stage in STAGES:
        seconds = [
            json.loads(p.read_text())["seconds"]
            for p in sorted(run.glob(f"stages/step=*/{stage}/MANIFEST.json"))
            if int(p.parts[-3].removeprefix("step=")) >= 2
        ]
        if seconds:  # a run too short for steps 2.. (or a synthetic event log) has none
            out[stage] = round(statistics.median(seconds), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser("staleness", __doc__)
    p.add_argument("--steps", type=int, default=6)
    length_args = p.add_mutually_exclusive_group()
    length_args.add_argument("--fixed-length", action="store_true")
    length_args.add_argument("--long-tail", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    lengths = LONG_TAIL if a.long_tail else FIXED_LENGTH if a.fixed_length else ()
    common = (f"total_steps={a.steps}", "eval.size=0", *lengths)
    cfg = load_config(RunConfig, CONFIG, common)
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    results: dict[str, Any] = {}
    # One run per variant, one after another (not alternated: a run takes minutes, and its
    # figures are read off its own event log's time-line).
    with tempfile.TemporaryDirectory(prefix="bench-staleness-") as tmp:
        for name in names:
            results[name] = run_variant(Path(tmp) / name, name, common, samples)
    base = results.get("k0")
    if base:
        for r in results.values():
            r["speedup_vs_k0"] = round(base["steady_step_s"] / r["steady_step_s"], 3)
    if a.out:
        record = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPUs",
            "command": "python -m tools.bench staleness " + " ".join(argv or sys.argv[1:]),
            "lengths": "long tail" if a.long_tail else "fixed" if a.fixed_length else "natural",
            "steps": a.steps,
            "results": results,
        }
        write_json(a.out, record)
    return 0


def run_variant(run: Path, name: str, common: tuple[str, ...], samples: int) -> dict[str, Any]:
    """Variant `name`'s run through `jobs.submit` in a fresh process, and its figures
    (printed as they come). A run that fails ends the benchmark with its exit code."""
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--tasks-per-node", str(RANKS.get(name, 1))]
    cmd += ["--config", str(CONFIG), *common, *VARIANTS[name]]
    child = fresh_process(cmd, capture=True)
    if child.code != 0:
        print(child.stderr[-3000:], file=sys.stderr)
        raise SystemExit(child.code)
    r = {"wall_s": round(child.wall_s, 1), **measure(run, samples)}
    print(
        f"{name:20s} span {r['span_s']:6.1f} s  steady step {r['steady_step_s']:5.2f} s  "
        f"{r['completions_per_s']:5.2f} completions/s  busy gen {r['generation_busy_s']:5.1f}"
        f" s train {r['training_busy_s']:5.1f} s",
        flush=True,
    )
    print(f"{'':20s} {r['timeline']}", flush=True)
    return r


BENCHMARK = Benchmark(
    name="staleness",
    runs="the default task through jobs.submit once per variant: synchronous (k0), stale "
    "rollouts (k1, k2), generation beside training (-overlap), separate rollout ranks "
    "(-disagg)",
    measures="steady step seconds, completions/s and speedup over k0; generation and "
    "training busy seconds and their time-line; each stage's median seconds",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
