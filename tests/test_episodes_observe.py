"""Observing a multi-turn run (trajectory schema version 2, issue 24): the episode/* step
metrics, the inspector turn by turn, exports, verify, and the Parquet readers, on one real
run whose episodes end all four ways (`envs_toy.EndsFourWays`)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, TESTS_ON_PATH, submit

from rftpipe.storage.episode_stats import EPISODE_STATUSES, METRICS

pytestmark = pytest.mark.slow

RUN = (
    "rollout.env.path=envs_toy:EndsFourWays",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    "rollout.env.on_error=end_episode",
    "reward.functions=[]",
    "logging.tensorboard=true",
    "total_steps=3",
)
# The run imports the environment from tests/.
ENV_PATH = TESTS_ON_PATH


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("episodes-observe") / "run"
    out = submit(run, *RUN, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def inspect(*args: str | Path) -> subprocess.CompletedProcess:
    """The real command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "rftpipe.inspect", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def frame(run: Path) -> pd.DataFrame:
    df = pd.read_parquet(run / "trajectories")  # pandas reads version 2 as it is
    df["step"] = df["step"].astype(int)  # hive keys come back as a category
    return df.sort_values(["step", "prompt_id", "sample_idx"], ignore_index=True)


def expected_episode_metrics(g: pd.DataFrame) -> dict[str, float]:
    """episode/* of one step's rows, recomputed with pandas from the published rows."""
    model = g["loss_mask"].map(lambda m: int(sum(m)))
    return {
        "episode/turns_mean": g["num_turns"].mean(),
        **{f"episode/{s}_frac": (g["episode_status"] == s).mean() for s in EPISODE_STATUSES},
        "episode/model_tokens_mean": model.mean(),
        "episode/env_tokens_mean": (g["loss_mask"].map(len) - model).mean(),
        # EndsFourWays has no tools: every turn's info has neither key.
        "episode/tool_calls_mean": g["turn_infos"]
        .map(lambda ts: sum(len(json.loads(t).get("tool_calls") or []) for t in ts))
        .mean(),
        "episode/tool_errors_mean": g["turn_infos"]
        .map(lambda ts: sum(int(json.loads(t).get("tool_errors") or 0) for t in ts))
        .mean(),
    }


def test_step_metrics_summary_and_tensorboard_have_the_episode_metrics(run: Path) -> None:
    df = frame(run)
    # The environment ended episodes every way at step 1 (seed 0): each fraction is tested.
    assert set(df[df.step == 1]["episode_status"]) == set(EPISODE_STATUSES)
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    r = inspect(run, "summary", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert [m["step"] for m in logged] == [s["step"] for s in summary] == [1, 2, 3]
    for m, s in zip(logged, summary, strict=True):
        want = expected_episode_metrics(df[df.step == m["step"]])
        assert sorted(k for k in m if k.startswith("episode/")) == sorted(METRICS)
        for k, v in want.items():
            assert m[k] == pytest.approx(v, rel=1e-12) and s[k] == pytest.approx(v, rel=1e-12)
        assert sum(m[f"episode/{st}_frac"] for st in EPISODE_STATUSES) == pytest.approx(1.0)
        # rollout/response_length stays the whole response: both roles' tokens.
        both = m["episode/model_tokens_mean"] + m["episode/env_tokens_mean"]
        assert m["rollout/response_length"] == pytest.approx(both)
    table = inspect(run, "summary")
    assert table.returncode == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert {"turns", "done", "max_t", "trunc", "err", "model_tok", "env_tok"} <= set(header)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    turns = acc.Scalars("episode/turns_mean")
    assert [e.step for e in turns] == [1, 2, 3]
    for e, m in zip(turns, logged, strict=True):
        assert e.value == pytest.approx(m["episode/turns_mean"], rel=1e-6)


def test_the_progress_bar_shows_turns_on_a_multi_turn_step() -> None:
    from rftpipe.run.loop import bar_update

    class Bar:
        def set_postfix(self, postfix: dict, refresh: bool) -> None:
            self.postfix = postfix

        def update(self, n: int) -> None:
            pass

    bar = Bar()
    m: dict[str, Any] = {"rollout/reward_mean": 0.5, "perf/rollout_s": 1.0, "perf/train_s": 2.0}
    bar_update(bar, m, {"train/kl": 3e-4}, "drift")
    assert "turns" not in bar.postfix
    bar_update(bar, {**m, "episode/turns_mean": 1.5}, {"train/kl": 3e-4}, "drift")
    assert bar.postfix["turns"] == "1.50"


def blocks(stdout: str) -> list[list[str]]:
    """`samples` output cut into one list of lines per sample."""
    out: list[list[str]] = []
    for line in stdout.splitlines():
        if line.startswith("== "):
            out.append([])
        if out and line:
            out[-1].append(line)
    return out


def test_samples_print_each_episode_turn_by_turn(run: Path) -> None:
    r = inspect(run, "samples", "--step", "1", "--limit", "16")
    assert r.returncode == 0, r.stderr
    rows = frame(run)
    rows = rows[rows.step == 1].reset_index(drop=True)
    printed = blocks(r.stdout)
    assert len(printed) == len(rows) == 16
    for lines, (_, row) in zip(printed, rows.iterrows(), strict=True):
        assert lines[0].startswith(f"== step 1  prompt_id {row.prompt_id}  sample {row.sample_idx}")
        mask, offsets = list(row.loss_mask), list(row.turn_offsets)
        model = sum(mask)
        assert (
            f"   episode {row.episode_status}: {row.num_turns} turn(s), return "
            f"{row.env_reward:.4g}, {model} model + {len(mask) - model} environment tokens"
        ) in lines
        turns = [i for i, x in enumerate(lines) if x.startswith("  turn ")]
        assert len(turns) == row.num_turns == len(offsets)
        messages = json.loads(row.messages)
        assert lines[turns[0] - 1] == f"    [user] {messages[0]['content']}"  # the prompt
        bounds = [*offsets, len(mask)]
        for t, at in enumerate(turns):
            span = mask[bounds[t] : bounds[t + 1]]
            end = f"ends the episode: {row.episode_status}" if t == len(turns) - 1 else "continues"
            assert lines[at] == (
                f"  turn {t + 1}: reward {row.turn_rewards[t]:.4g}, {sum(span)} model + "
                f"{len(span) - sum(span)} environment tokens, {end}"
            )
            assert lines[at + 1].startswith("    [assistant] ")
            after = lines[at + 2 : turns[t + 1] if t + 1 < len(turns) else len(lines)]
            # The environment's feedback follows a turn that the episode went on after.
            assert any(x.startswith("    [user] Again, more even.") for x in after) == (
                t < len(turns) - 1
            )
            if row.episode_status == "error" and t == len(turns) - 1:
                assert any("RuntimeError: the environment broke" in x for x in after)


@pytest.mark.tier1
def test_export_and_verify_take_version_2(run: Path, tmp_path: Path) -> None:
    df = frame(run)
    out = tmp_path / "rows.csv"
    r = inspect(run, "export", "--format", "csv", "--out", out)
    assert r.returncode == 0, r.stderr
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(df)
    # CSV keeps the scalar episode columns; list columns (loss_mask, turn_*) are dropped.
    assert {"num_turns", "env_reward", "episode_status", "messages"} <= set(rows[0])
    assert "loss_mask" not in rows[0] and "turn_rewards" not in rows[0]
    assert [int(x["num_turns"]) for x in rows] == list(df["num_turns"])
    out = tmp_path / "rows.jsonl"
    r = inspect(run, "export", "--format", "jsonl", "--out", out, "--step", "2")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    step2 = df[df.step == 2]
    assert len(recs) == len(step2)
    for rec, (_, row) in zip(recs, step2.iterrows(), strict=True):
        assert rec["loss_mask"] == list(row.loss_mask) and rec["turn_infos"] == list(row.turn_infos)
    r = inspect(run, "verify")
    assert r.returncode == 0 and "0 corrupt file(s)" in r.stdout, r.stdout + r.stderr


def test_pandas_duckdb_and_pyarrow_read_version_2(run: Path) -> None:
    files = sorted((run / "trajectories").glob("step=*/part-r*.parquet"))
    assert files and all(
        pq.read_schema(f).metadata[b"rftpipe.schema_version"] == b"2" for f in files
    )
    table = ds.dataset(run / "trajectories", format="parquet", partitioning="hive").to_table()
    df = frame(run)
    glob = str(run / "trajectories" / "*" / "*.parquet")
    by_status = dict(
        duckdb.sql(
            f"select episode_status, count(*) from read_parquet('{glob}', hive_partitioning = true) "
            "group by episode_status"
        ).fetchall()
    )
    assert by_status == df["episode_status"].value_counts().to_dict()
    assert sum(by_status.values()) == table.num_rows == len(df) == 3 * 16
    # The loss mask covers every response token, in every reader.
    bad = duckdb.sql(
        f"select count(*) from read_parquet('{glob}') "
        "where len(loss_mask) != response_length or len(turn_offsets) != num_turns"
    ).fetchall()
    assert bad == [(0,)]
    assert all(
        len(m) == len(t) == n
        for m, t, n in zip(
            df["loss_mask"], df["response_token_ids"], df["response_length"], strict=True
        )
    )
    assert table.column("loss_mask").type.value_type.bit_width == 8
