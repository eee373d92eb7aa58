"""The `remote` reward against a real local HTTP server that injects faults on a schedule:
5xx, slow replies and dropped connections are retried, a 4xx is not, the circuit opens."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from reward_fns import rollouts
from reward_server import RewardServer, Schedule, score_of

from rftpipe.config.loader import from_dict
from rftpipe.config.schema import RewardConfig
from rftpipe.errors import UserError
from rftpipe.rewards import resolve_all
from rftpipe.stages import score

TOKEN = "s3cret-token-value"

# Timeouts of 0.3-0.5 s against a local server: one at a time.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFTPIPE_REWARD_TOKEN", TOKEN)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # the server is local


def scored(url: str, on_error: str = "fail", **remote: object) -> pa.Table:
    remote = {"url": url, "backoff_s": 0.01, "backoff_max_s": 0.05, **remote}
    cfg = from_dict(RewardConfig, {"functions": ["remote"], "on_error": on_error, "remote": remote})
    return score.run(cfg, resolve_all(cfg, None), rollouts())


def requests_per_row(log: list[dict]) -> Counter:
    return Counter(r["row"] for r in log)


def test_retries_5xx_slow_and_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    plan = Schedule(default=["503", "slow", "drop", "502", "ok"], slow_s=1.5, token=TOKEN)
    with RewardServer(plan, tmp_path / "log.jsonl") as srv:
        # 6 rows x 4 failed tries interleave: keep the circuit out of it.
        t = scored(srv.url, timeout_s=0.5, attempts=5, circuit_after=50).to_pydict()
        log = srv.log()
    assert t["reward_status"] == ["ok"] * 6
    assert t["reward_remote"] == [score_of(r) for r in rollouts().column("response").to_pylist()]
    assert t["reward_remote_length"] == [
        float(len(r)) for r in rollouts().column("response").to_pylist()
    ]
    # Every row: four failed tries, then the one that scored it, and nothing after.
    assert requests_per_row(log) == {f"1/{p}/{k}": 5 for p in range(2) for k in range(3)}
    assert all(r["token_ok"] and r["header_row"] == r["row"] for r in log)
    assert any("HTTP 503" in m and "try 1 of 5" in m for m in caplog.messages)
    assert any("timed out after 0.5 s" in m for m in caplog.messages)
    assert any("RemoteDisconnected" in m for m in caplog.messages)
    assert not any(TOKEN in m for m in caplog.messages)


def test_4xx_is_not_retried(tmp_path: Path) -> None:
    plan = Schedule(rows={"1/1/2": ["400"]})
    with RewardServer(plan, tmp_path / "log.jsonl") as srv:
        with pytest.raises(UserError) as err:
            scored(srv.url, on_error="zero")
        log = srv.log()
    msg = str(err.value)
    assert "refused the request of step 1 prompt_id 1 sample_idx 2" in msg, msg
    assert "HTTP 400" in msg and "scheduled 400" in msg and "not retried" in msg
    assert requests_per_row(log)["1/1/2"] == 1
    assert TOKEN not in msg


def test_a_wrong_token_is_a_4xx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RFTPIPE_REWARD_TOKEN", "wrong")
    with (
        RewardServer(Schedule(token=TOKEN), tmp_path / "log.jsonl") as srv,
        pytest.raises(UserError, match="HTTP 401"),
    ):
        scored(srv.url)


def test_429_and_408_are_retried(tmp_path: Path) -> None:
    plan = Schedule(rows={"1/0/0": ["429", "ok"], "1/0/1": ["408", "408", "ok"]})
    with RewardServer(plan, tmp_path / "log.jsonl") as srv:
        t = scored(srv.url)
        counts = requests_per_row(srv.log())
    assert t.column("reward_status").to_pylist() == ["ok"] * 6
    assert (counts["1/0/0"], counts["1/0/1"], counts["1/1/1"]) == (2, 3, 1)


def test_circuit_opens_after_the_bound(tmp_path: Path) -> None:
    with RewardServer(Schedule(default=["503"]), tmp_path / "log.jsonl") as srv:
        with pytest.raises(UserError) as err:
            scored(srv.url, attempts=100, circuit_after=5, concurrency=1)
        log = srv.log()
    msg = str(err.value)
    assert "circuit open after 5 consecutive failed requests" in msg, msg
    assert "HTTP 503" in msg and srv.url.split("/score")[0] in msg
    assert len(log) == 5  # one row's five tries; the sixth found the circuit open


def test_circuit_closes_on_success(tmp_path: Path) -> None:
    """Failures spread over rows that each end up scored never open the circuit."""
    with RewardServer(Schedule(default=["503", "503", "ok"]), tmp_path / "log.jsonl") as srv:
        t = scored(srv.url, circuit_after=3, concurrency=1)
    assert t.column("reward_status").to_pylist() == ["ok"] * 6


@pytest.mark.parametrize(("action", "status"), [("503", "error"), ("slow", "timeout")])
def test_exhausted_retries_follow_on_error(tmp_path: Path, action: str, status: str) -> None:
    plan = Schedule(default=[action], slow_s=1.0)
    with RewardServer(plan, tmp_path / "log.jsonl") as srv:
        t = scored(srv.url, on_error="zero", attempts=2, timeout_s=0.3).to_pydict()
        assert requests_per_row(srv.log()) == {f"1/{p}/{k}": 2 for p in range(2) for k in range(3)}
        with pytest.raises(UserError, match=r"remote (failed|timed out) on step 1 prompt_id \d"):
            scored(srv.url, attempts=2, timeout_s=0.3)
    assert t["reward_status"] == [status] * 6
    assert t["reward_remote"] == [0.0] * 6 and t["reward"] == [0.0] * 6
    assert "(2 tries)" in t["reward_error"][0]


def test_connection_refused_is_retried_then_an_error(tmp_path: Path) -> None:
    with RewardServer(Schedule(), tmp_path / "log.jsonl") as srv:
        url = srv.url  # closed on exit: nothing listens there any more
    t = scored(url, on_error="zero", attempts=2, circuit_after=100).to_pydict()
    assert t["reward_status"] == ["error"] * 6
    assert "ConnectionRefusedError" in t["reward_error"][0]
