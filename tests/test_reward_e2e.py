"""Reward functions and the remote reward in real runs of the entry point: hard timeouts,
the error policy, a 4xx, and SIGKILLs during scoring that never score a committed row twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import ROOT, TINY, events, stage_history, submit, trajectories
from reward_server import RewardServer, Schedule, score_of

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
TOKEN = "e2e-s3cret-token"
ENV = {"PYTHONPATH": f"{TESTS}:{ROOT}", "NO_PROXY": "127.0.0.1,localhost"}


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def remote(url: str, *extra: str) -> tuple[str, ...]:
    return (
        "reward.functions=[remote]",
        f"reward.remote.url={url}",
        "reward.remote.backoff_s=0.01",
        "reward.remote.backoff_max_s=0.05",
        *extra,
    )


def test_a_hanging_function_is_killed_and_fails_the_run(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    res = submit(
        tmp_path / "run",
        "total_steps=2",
        "reward.functions=[{path: reward_fns:sleep_forever, timeout_s: 1}]",
        env={**ENV, "RFTPIPE_TEST_PIDS": str(pids)},
    )
    one_line_error(res, "reward_fns:sleep_forever timed out on step 1 prompt_id", "sample_idx")
    killed = [int(p) for p in pids.read_text().split()]
    assert killed and not any(alive(p) for p in killed), killed
    assert not (tmp_path / "run" / "stages" / "step=1" / "score" / "MANIFEST.json").exists()


@pytest.mark.serial  # the rows that do not hang must score within a 1 s timeout
def test_timeouts_zeroed_and_counted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    pids = tmp_path / "pids"
    res = submit(
        run,
        "total_steps=2",
        "reward.functions=[{path: reward_fns:sleepy, timeout_s: 1}]",
        "reward.on_error=zero",
        env={**ENV, "RFTPIPE_TEST_PIDS": str(pids)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    t = trajectories(run).to_pandas()
    # sample 0 of each of the 4 prompts per step hangs: killed, zeroed, recorded.
    assert (t[t.sample_idx == 0].reward_status == "timeout").all()
    assert (t[t.sample_idx != 0].reward_status == "ok").all()
    assert (t[t.sample_idx == 0].reward_sleepy == 0.0).all()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["rollout/reward_timeouts"], m["rollout/reward_errors"]) for m in metrics] == [
        (4, 0),
        (4, 0),
    ]
    assert "rows scored 0 (reward.on_error=zero): 4 timeouts" in res.stdout
    assert not any(alive(int(p)) for p in pids.read_text().split())


@pytest.mark.tier1
def test_remote_4xx_fails_the_run_without_retry(tmp_path: Path) -> None:
    with RewardServer(Schedule(default=["400"], token=TOKEN), tmp_path / "log.jsonl") as srv:
        res = submit(
            tmp_path / "run",
            "total_steps=2",
            *remote(srv.url),
            env={**ENV, "RFTPIPE_REWARD_TOKEN": TOKEN},
        )
        log = srv.log()
    one_line_error(res, "refused the request of step 1 prompt_id", "HTTP 400", "not retried")
    assert log and all(r["attempt"] == 1 and r["token_ok"] for r in log), log


def test_remote_circuit_stops_the_run(tmp_path: Path) -> None:
    with RewardServer(Schedule(default=["503"], token=TOKEN), tmp_path / "log.jsonl") as srv:
        res = submit(
            tmp_path / "run",
            "total_steps=2",
            *remote(srv.url, "reward.remote.circuit_after=6", "reward.remote.attempts=50"),
            env={**ENV, "RFTPIPE_REWARD_TOKEN": TOKEN},
        )
        log = srv.log()
    one_line_error(res, "circuit open after 6 consecutive failed requests", "HTTP 503")
    # Up to `concurrency` tries were in flight when the sixth failure opened it.
    assert 6 <= len(log) < 6 + 8, len(log)


def _start(run: Path, overrides: tuple[str, ...], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jobs.submit", "--cluster", "local", "--config", str(TINY)]
    return subprocess.Popen(
        [*cmd, "--run-dir", str(run), *overrides],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the server SIGKILLs this whole group
    )


def test_kills_during_scoring_never_rescore_a_committed_row(tmp_path: Path) -> None:
    """Three steps of 16 rows; every row's first request gets a 503 (so 32 requests a
    step). Kill 1: the server SIGKILLs the run at request 48, mid-way through step 2's
    score stage. Kill 2: the resumed run dies right after committing step 2's score
    (fault point stage_after_commit). The third start finishes. No row is requested after
    its score stage committed; rows of the killed, uncommitted stage are, again."""
    run = tmp_path / "run"
    env = {**ENV, "RFTPIPE_REWARD_TOKEN": TOKEN}
    plan = Schedule(default=["503", "ok"], token=TOKEN, kill_at=48)
    overrides = ("total_steps=3", *remote("URL"))
    outputs = []
    with RewardServer(plan, tmp_path / "log.jsonl") as srv:
        overrides = tuple(o.replace("URL", srv.url) for o in overrides)
        proc = _start(run, overrides, env)
        plan.kill_pgid = proc.pid
        out, err = proc.communicate(timeout=300)
        outputs += [out, err]
        assert proc.returncode != 0 and srv.requests >= 48, (proc.returncode, err[-2000:])
        res = submit(run, *overrides, env={**env, "RFTPIPE_FAULT": "stage_after_commit"})
        outputs += [res.stdout, res.stderr]
        assert res.returncode != 0
        res = submit(run, *overrides, env=env)
        outputs += [res.stdout, res.stderr]
        assert res.returncode == 0, res.stderr[-3000:]
        log = srv.log()

    committed_at = {
        e["step"]: e["t"] for e in events(run) if e["event"] == "commit" and e["stage"] == "score"
    }
    assert sorted(committed_at) == [1, 2, 3]
    late = [r for r in log if r["t"] > committed_at[int(r["row"].split("/")[0])]]
    assert late == [], late
    history = stage_history(run)
    assert history[(2, "score")] == ["begin", "begin", "commit"], history[(2, "score")]

    # The killed stage had rows scored (ok) that its rerun requested again: allowed, and
    # proof that the check above could tell the two kinds of rows apart.
    t_kill = next(r["t"] for r in log if r["action"] == "kill")
    ok_before = {r["row"] for r in log if r["action"] == "ok" and r["t"] < t_kill}
    step2_before = {r for r in ok_before if r.startswith("2/")}
    again = {r["row"] for r in log if r["t"] > t_kill}
    assert step2_before & again, (step2_before, again)
    # Retries happened: each row's first try got a 503, and it was tried again.
    per_row = Counter(r["row"] for r in log)
    assert len(per_row) == 3 * 16 and min(per_row.values()) >= 2
    assert all(r["token_ok"] for r in log)

    t = trajectories(run).to_pandas()
    assert len(t) == 3 * 16 and (t.reward_status == "ok").all()
    assert t.reward_remote.tolist() == [score_of(r) for r in t.response]
    # The token went over the wire only: not in the run directory nor in any output.
    for p in run.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p
    assert not any(TOKEN in o for o in outputs)
    assert "token_env: RFTPIPE_REWARD_TOKEN" in (run / "config.yaml").read_text()


def test_how_hard_scoring_tries_may_change_on_resume(tmp_path: Path) -> None:
    """A committed row is never scored again, so timeouts, retries and the error policy
    may change on resume; the server (url) or the functions may not."""
    run = tmp_path / "run"
    base = (*remote("http://127.0.0.1:9/score"),)
    # A run killed right after its first commit (its rollout): a directory that committed
    # nothing would take any config as a new run.
    started = submit(run, *base, env={**ENV, "RFTPIPE_FAULT": "stage_after_commit"})
    assert started.returncode != 0 and (run / "stages/step=1/rollout/MANIFEST.json").exists()
    changed = (
        *base,
        "reward.on_error=zero",
        "reward.timeout_s=5",
        "reward.remote.attempts=9",
        "reward.remote.circuit_after=3",
    )
    res = submit(run, *changed, extra=("--create-only",), env=ENV)
    assert res.returncode == 0, res.stderr
    res = submit(
        run,
        *remote("http://127.0.0.1:10/score"),
        extra=("--create-only",),
        env=ENV,
    )
    one_line_error(res, "reward.remote.url")
