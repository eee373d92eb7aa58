"""tools.bench: the engine comparison's summary and report from synthetic runs (no model)."""

from __future__ import annotations

from tools.bench import overrides, parse, report, side_name, summarize


def _run(steps: list[float], rollout: float, train: float, sync: float) -> dict:
    n = len(steps)
    return {
        "step_s": sum(steps) / n,
        "raw_step_s": sum(steps) / n,
        "steps": steps,
        "rollout_steps": [rollout] * n,
        "train_steps": [train] * n,
        "sync_steps": [sync] * n,
        "peak_rss_gib": 3.0,
    }


def test_engine_overrides_and_side_names():
    a = parse(["--engine", "both", "--ckpt-every", "0", "--steps", "4"])
    assert "rollout.engine=vllm" in overrides(a, a.steps, "vllm")
    # No checkpoint inside the measured steps: the interval lies past the run.
    assert "checkpoint.interval=5" in overrides(a, a.steps)
    assert side_name("rftpipe", "hf") == "rftpipe"
    assert side_name("floor", "vllm") == "floor-vllm"


def test_summary_reports_each_engine_against_the_hf_loop():
    a = parse(["--engine", "both", "--trl", "both", "--ckpt-every", "0", "--steps", "4"])
    results = {
        "rftpipe": [_run([4.0, 4.0, 4.2], 1.8, 2.0, 0.02), _run([5.0, 5.0, 5.0], 2, 2.5, 0.02)],
        "rftpipe-vllm": [_run([2.0, 2.0, 2.0], 0.5, 1.0, 0.5), _run([3.0] * 3, 1, 1.5, 0.5)],
        "trl": [_run([8.0] * 3, 4, 4, 0), _run([9.0] * 3, 4, 5, 0)],
        "trl-vllm": [{"error": "AttributeError: no weight_loader", "peak_rss_gib": 1.0}],
        "floor-vllm": [
            {"generate_s": 0.4, "train_s": 1.0, "fwd_bwd_s": 0.9, "sync_s": 0.3},
            {"generate_s": 0.5, "train_s": 1.1, "fwd_bwd_s": 1.0, "sync_s": 0.5},
        ],
    }
    s = summarize(a, results)
    rows = {r["side"]: r for r in s["engines"]}
    assert rows["rftpipe"]["ratio_vs_hf"] == 1.0
    # Per pair: 2/4 and 3/5, median 0.55.
    assert abs(rows["rftpipe-vllm"]["ratio_vs_hf"] - 0.55) < 1e-9
    assert rows["rftpipe-vllm"]["update_weights_s"] == 0.4
    assert rows["rftpipe-vllm"]["rollout_s"] == 0.75
    assert rows["trl-vllm"]["error"].startswith("AttributeError")
    assert "durability" not in s  # no checkpoints measured
    text = report(s)
    assert "rftpipe + vLLM" in text and "failed: AttributeError" in text
