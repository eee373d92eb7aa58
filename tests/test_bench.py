"""tools.bench trl: the engine comparison's summary and report from synthetic runs (no
model), TRL's reward through rftpipe's score stage, and a tiny-model run of both sides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rftpipe.config.schema import RewardConfig
from rftpipe.rewards import resolve_all
from tools.bench.harness import ROOT
from tools.bench.trl.children import trl_reward
from tools.bench.trl.options import overrides, parse, side_name
from tools.bench.trl.report import report, summarize

FIELDS = ROOT / "tests" / "fixtures" / "bench_json_fields.json"
"""The key tree of the smoke run's bench.json, recorded before tools/bench.py was split."""


def key_tree(x: object) -> object:
    """`x`'s keys only: a value is None, a list of values [], a list of objects its first
    element's keys (the fixture's form)."""
    if isinstance(x, dict):
        return {k: key_tree(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        return [key_tree(x[0])] if x and isinstance(x[0], dict | list) else []
    return None


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


def test_summary_of_runs_with_the_recorded_fields_has_the_recorded_fields():
    """The summary half of the fields check, without a model: runs with the fields the
    fixture records for each side (every figure 1.0) summarize to the recorded summary."""
    fixture = json.loads(FIELDS.read_text())
    a = parse(fixture["command"].split()[3:])

    def filled(tree: dict) -> dict:
        return {k: [1.0, 1.0] if v == [] else 1.0 for k, v in tree.items()} | {"engine": "hf"}

    results = {side: [filled(runs[0])] for side, runs in fixture["fields"]["runs"].items()}
    assert key_tree(summarize(a, results)) == fixture["fields"]["summary"]


def test_trl_reward_scores_like_rftpipes_score_stage():
    """TRL's side gets rftpipe's weighted sum: accuracy needs a stop (an EOS last), format
    a stop and a number; a completion cut at the length limit earns neither."""
    cfg = RewardConfig(
        functions=("accuracy", "format"), weights=(1.0, 0.2), extractor="last_number"
    )
    eos = 2
    reward = trl_reward(cfg, resolve_all(cfg, None, 16), {eos})
    got = reward(
        prompts=[[{"role": "user", "content": "3 + 4 ="}]] * 3,
        completions=[[{"role": "assistant", "content": c}] for c in ("7", "8", "7")],
        completion_ids=[[55, eos], [56, eos], [55, 55]],
        answer=["7"] * 3,
        metadata=["{}"] * 3,
        prompt_id=[5, 5, 5],
        data_source=[""] * 3,
        trainer_state=SimpleNamespace(global_step=0),
    )
    assert got == pytest.approx([1.2, 0.2, 0.0])


@pytest.mark.slow
def test_bench_runs_both_sides_on_the_tiny_model(tmp_path: Path):
    """`python -m tools.bench` end to end, rftpipe (with a checkpoint and a restart), TRL
    and the floor, on `builtin:tiny` with a few tiny steps: about a minute on 2 cores. Its
    bench.json has the fields it had before the benchmarks became tools/bench/ (the
    fixture's command is this one)."""
    pytest.importorskip("trl", reason="TRL is installed by tools/setup.sh (the bench extra)")
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tools.bench", "--model", "builtin:tiny", "--pairs", "1"]
    cmd += ["--steps", "4", "--ckpt-every", "2", "--floor-steps", "2", "--prompts", "2"]
    cmd += ["--n", "2", "--tokens", "4", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads((out / "bench.json").read_text())
    assert key_tree(written) == json.loads(FIELDS.read_text())["fields"]
    s = written["summary"]
    for side in ("rftpipe", "trl"):
        assert s[side]["step_s"] > 0 and s[side]["completions_per_s"] > 0, s[side]
    assert s["ratio_completions_per_s"] > 0
    assert s["floor"]["floor_s"] > 0
    assert s["durability"]["resume_to_first_rollout_s"] > 0
    assert "rftpipe/TRL" in proc.stdout  # the full report, not the engines-only one
    assert "rftpipe/TRL" in (out / "bench.md").read_text()  # and beside the JSON
