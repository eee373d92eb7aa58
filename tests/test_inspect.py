"""rftpipe.inspect against one real tiny run, checked against an independent pandas reading."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import ROOT, submit

pytestmark = pytest.mark.slow

STAGES = ("rollout", "score", "advantage", "train", "sync")
STEPS = 10


def inspect(*args: str | Path) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "rftpipe.inspect", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("inspect") / "run"
    r = submit(run, f"total_steps={STEPS}")
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def mid_step_copy(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the run killed inside step 10: train and sync uncommitted, nothing published."""
    copy = tmp_path_factory.mktemp("inspect-copy") / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "export"))
    shutil.rmtree(copy / "trajectories" / f"step={STEPS}")
    for stage in ("train", "sync"):
        shutil.rmtree(copy / "stages" / f"step={STEPS}" / stage)
    return copy


def frame(run: Path) -> pd.DataFrame:
    df = pd.read_parquet(run / "trajectories")
    df["step"] = df["step"].astype(int)  # hive keys come back as a category
    return df


def manifest(run: Path, step: int, stage: str) -> dict[str, Any] | None:
    p = run / "stages" / f"step={step}" / stage / "MANIFEST.json"
    return json.loads(p.read_text()) if p.exists() else None


def expected_summary(run: Path) -> list[dict[str, Any]]:
    """The summary recomputed without rftpipe.inspect: pandas over the published rows plus
    the train/stage manifests."""
    df = frame(run)
    # Numeric components (not reward_status / reward_error).
    comps = [
        c for c in df.columns if c.startswith("reward_") and pd.api.types.is_float_dtype(df[c])
    ]
    out = []
    for step, g in df.groupby("step", sort=True):
        train = manifest(run, step, "train")
        if train is None:
            continue
        adv = np.concatenate([np.asarray(a, dtype=np.float64) for a in g["advantages"]])
        gate = g["reward_accuracy"] if "reward_accuracy" in g else g["reward"]
        e: dict[str, Any] = {
            "step": step,
            "rollout/samples": len(g),
            "rollout/reward_mean": g["reward"].mean(),
            "rollout/reward_std": g["reward"].std(ddof=0),
            "rollout/reward_min": g["reward"].min(),
            "rollout/reward_max": g["reward"].max(),
            **{f"rollout/{c}": g[c].mean() for c in comps},
            "rollout/pass_rate": (gate > 0).mean(),
            "rollout/response_length": g["response_length"].mean(),
            "rollout/response_length_max": g["response_length"].max(),
            "rollout/stop_frac": (g["finish_reason"] == "stop").mean(),
            "advantage/mean": adv.mean(),
            "advantage/std": adv.std(),
            **train["metrics"],
        }
        for stage in STAGES:
            m = manifest(run, step, stage)
            e[f"perf/{stage}_s"] = m.get("seconds") if m else None
        out.append(e)
    return out


def assert_rows_match(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for a, e in zip(actual, expected, strict=True):
        assert set(a) == set(e), (a["step"], set(a) ^ set(e))
        for k, v in e.items():
            if v is None or a[k] is None:
                assert a[k] == v, (a["step"], k)
            else:
                assert math.isclose(a[k], float(v), rel_tol=1e-9, abs_tol=1e-9), (
                    a["step"],
                    k,
                    a[k],
                    v,
                )


def summary_json(run: Path) -> list[dict[str, Any]]:
    r = inspect(run, "summary", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_summary_matches_pandas(run: Path) -> None:
    actual = summary_json(run)
    assert [r["step"] for r in actual] == list(range(1, STEPS + 1))
    assert_rows_match(actual, expected_summary(run))
    # The text table has a header plus one line per step.
    r = inspect(run, "summary")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 + STEPS


@pytest.mark.tier1
def test_summary_skips_uncommitted_step(mid_step_copy: Path) -> None:
    actual = summary_json(mid_step_copy)
    assert [r["step"] for r in actual] == list(range(1, STEPS))
    assert_rows_match(actual, expected_summary(mid_step_copy))


def test_plot_and_series(run: Path, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    png, data = tmp_path / "x.png", tmp_path / "x.csv"
    r = inspect(run, "plot", "--out", png, "--data-out", data)
    assert r.returncode == 0, r.stderr
    img = mpimg.imread(png)
    h, w = img.shape[:2]
    assert 300 <= h <= 3000 and 300 <= w <= 3000, img.shape
    assert img.std() > 0
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 1

    series = pd.read_csv(data)
    df = frame(run).groupby("step").mean(numeric_only=True)
    assert series["step"].tolist() == df.index.tolist()
    np.testing.assert_allclose(series["rollout/reward_mean"], df["reward"], rtol=1e-9)
    np.testing.assert_allclose(series["rollout/response_length"], df["response_length"], rtol=1e-9)


def printed_samples(stdout: str) -> list[tuple[int, float]]:
    """(step, reward) of each sample header line that `samples` printed."""
    pat = re.compile(r"^== step (\d+) .* reward (\S+) ", re.M)
    return [(int(s), float(x)) for s, x in pat.findall(stdout)]


def test_samples_best_regex_and_export(run: Path, tmp_path: Path) -> None:
    df = frame(run)
    r = inspect(run, "samples", "--best", "3", "--step", "2")
    assert r.returncode == 0, r.stderr
    got = printed_samples(r.stdout)
    top3 = df[df["step"] == 2]["reward"].nlargest(3).tolist()
    assert [s for s, _ in got] == [2, 2, 2]
    np.testing.assert_allclose([x for _, x in got], top3, rtol=1e-5)

    # A pattern that RE2 and Python's re read the same way; it must select a strict subset
    # for the check to mean anything.
    pattern = "[A-Z]"
    hits = df["response"].str.contains(pattern, regex=True)
    assert 0 < hits.sum() < len(df)
    r = inspect(run, "samples", "--regex", pattern, "--limit", "100000")
    assert r.returncode == 0, r.stderr
    assert len(printed_samples(r.stdout)) == hits.sum()

    out = tmp_path / "regex.jsonl"
    r = inspect(run, "export", "--format", "jsonl", "--out", out, "--regex", pattern)
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == hits.sum()
    out = tmp_path / "rows.jsonl"
    r = inspect(run, "export", "--format", "jsonl", "--out", out, "--min-reward", "0.5")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    want = df[df["reward"] >= 0.5]
    assert 0 < len(want) < len(df)
    assert len(recs) == len(want)
    assert all(rec["reward"] >= 0.5 and isinstance(rec["advantages"], list) for rec in recs)

    r = inspect(run, "samples", "--regex", "(unclosed")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("inspect: error:") and len(r.stderr.splitlines()) == 1


def test_compare_with_copy(run: Path, mid_step_copy: Path, tmp_path: Path) -> None:
    png = tmp_path / "cmp.png"
    r = inspect(run, "compare", mid_step_copy, "--out", png)
    assert r.returncode == 0, r.stderr
    assert "rollout/reward_mean" in r.stdout
    assert png.stat().st_size > 0


def test_bad_run_dir(tmp_path: Path) -> None:
    for bad in (tmp_path / "missing", tmp_path):  # absent, and present with nothing committed
        r = inspect(bad, "summary")
        assert r.returncode == 2
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("inspect: error:"), r.stderr
