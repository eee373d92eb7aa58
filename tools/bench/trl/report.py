"""The TRL comparison's summary (medians over runs and pairs, the engines' table, the
durability figures) and its printed report."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from tools.bench.harness import pooled_median
from tools.bench.trl.options import LABELS, SIDE_ORDER, checkpoint_policy, config_interval, settings

Results = dict[str, list[dict[str, Any]]]


def summarize(a: argparse.Namespace, results: Results) -> dict[str, Any]:
    """bench.json's `summary` of the runs in `results` (side -> its runs, in pair order)."""
    med = statistics.median
    out: dict[str, Any] = {"settings": settings(a)}
    for side in SIDE_ORDER:
        runs = results.get(side, [])
        ok = [r for r in runs if "error" not in r]
        if runs and not ok:
            out[side] = {"error": runs[0]["error"], "traceback": runs[0].get("traceback")}
        elif ok:
            out[side] = side_summary(a, ok)
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
        if results.get(kind):
            out[kind] = floor_summary(results[kind])
    rf = results.get("rftpipe", [])
    if "floor" in out and rf:
        out["overhead_above_floor"] = out["rftpipe"]["step_s"] / out["floor"]["floor_s"] - 1
    if rf and all("checkpoint_cost_s" in r for r in rf):
        out["durability"] = durability(a, rf, out["rftpipe"]["step_s"], out.get("floor"))
    return out


def side_summary(a: argparse.Namespace, ok: list[dict[str, Any]]) -> dict[str, Any]:
    """A side's figures over its runs that did not fail: the median of their step times,
    per-step medians pooled over all of them, throughput, peak memory."""
    per_step = a.prompts * a.n
    step = statistics.median(r["step_s"] for r in ok)
    return {
        "step_s": step,
        "median_step_s": pooled_median(ok, "steps"),
        "rollout_s": pooled_median(ok, "rollout_steps"),
        "train_s": pooled_median(ok, "train_steps"),
        "sync_s": pooled_median(ok, "sync_steps"),
        "completions_per_s": per_step / step,
        "tokens_per_s": per_step * a.tokens / step,
        "peak_rss_gib": max(r["peak_rss_gib"] for r in ok),
        "runs_step_s": [round(r["step_s"], 3) for r in ok],
        "runs_median_step_s": [round(statistics.median(r["steps"]), 3) for r in ok],
    }


def floor_summary(fl: list[dict[str, Any]]) -> dict[str, Any]:
    """The floor's medians over its runs; generate + train is the floor."""
    med = statistics.median
    gen = med(r["generate_s"] for r in fl)
    train = med(r["train_s"] for r in fl)
    out = {
        "generate_s": gen,
        "train_s": train,
        "fwd_bwd_s": med(r["fwd_bwd_s"] for r in fl),
        "sync_s": med(r.get("sync_s", 0.0) for r in fl),
        "floor_s": gen + train,
    }
    naive = [r["naive_fwd_bwd_s"] for r in fl if r.get("naive_fwd_bwd_s") is not None]
    if naive:
        out["naive_fwd_bwd_s"] = med(naive)
    return out


def engine_table(results: Results, out: dict[str, Any]) -> list[dict[str, Any]]:
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
    """What durability costs rftpipe's runs `rf`: the commit's and the amortised
    checkpoints' share of step time `step`, the replay a preemption costs on average, and
    the restart to the first new rollout against a cold start."""
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


def reamortise(a: argparse.Namespace, results: Results) -> None:
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
    """The engines' table of summary `s` (and the floors), column-aligned."""
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
    """Summary `s` as printed: rftpipe and TRL side by side, the floor and durability
    (the engines' table alone when TRL, the floor or the checkpoints were not measured)."""
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
