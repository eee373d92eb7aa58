"""Reward functions by import path: signatures, return values, hard timeouts, error policy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from reward_fns import rollouts

from rftpipe.config.loader import ConfigError, from_dict
from rftpipe.config.schema import RewardConfig, RunConfig
from rftpipe.errors import UserError
from rftpipe.rewards import check_coverage, pool, resolve_all
from rftpipe.stages import score


@pytest.fixture(autouse=True)
def fresh_pools():
    """Each test starts its own workers (they inherit the environment it sets)."""
    yield
    for p in pool._shared.values():
        p.close()
    pool._shared.clear()


def scored(*functions: object, **reward: object) -> pa.Table:
    cfg = from_dict(RewardConfig, {"functions": list(functions), **reward})
    return score.run(cfg, resolve_all(cfg, None), rollouts())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_verl_signature_and_dict_components() -> None:
    t = scored({"path": "reward_fns:compute_score", "signature": "verl"}).to_pydict()
    assert t["reward_compute_score"] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert t["reward"] == t["reward_compute_score"]
    assert t["reward_compute_score_length"][2] == len("no idea")
    assert set(t["reward_compute_score_source"]) == {"basic_arithmetic"}  # data_source
    assert t["reward_status"] == ["ok"] * 6 and t["reward_error"] == [None] * 6


def test_trl_signature_is_called_per_group() -> None:
    t = scored({"path": "reward_fns:trl_length", "signature": "trl"}, "dense_even_tokens")
    assert t.column("reward_trl_length").to_pylist() == [1 / 8, 2 / 8, 3 / 8] * 2
    assert t.column("reward").to_pylist()[1] == 2 / 8 + 1 / 2


def test_weights_and_names() -> None:
    t = scored(
        {"path": "reward_fns:even_share", "name": "a"},
        {"path": "reward_fns:even_share", "name": "b"},
        weights=[1.0, -0.5],
    )
    assert t.column("reward_a").to_pylist() == t.column("reward_b").to_pylist()
    assert t.column("reward").to_pylist() == [0.5 * v for v in t.column("reward_a").to_pylist()]


@pytest.mark.serial  # a 1 s timeout: a loaded machine could trip it
def test_timeout_kills_the_worker_and_zero_counts_the_row(tmp_path: Path, monkeypatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("RFTPIPE_TEST_PIDS", str(pids))
    t0 = time.monotonic()
    t = scored(
        {"path": "reward_fns:sleepy", "timeout_s": 1.0}, on_error="zero", workers=2
    ).to_pydict()
    assert time.monotonic() - t0 < 20
    assert t["reward_status"] == ["timeout", "ok", "ok"] * 2
    assert t["reward_sleepy"][0] == t["reward_sleepy"][3] == 0.0
    assert "timed out after 1 s" in t["reward_error"][0]
    killed = [int(x) for x in pids.read_text().split()]
    assert len(killed) == 2 and not any(alive(p) for p in killed), killed
    # The killed workers were replaced: the pool still scores.
    again = scored({"path": "reward_fns:even_share"}, workers=2)
    assert again.column("reward_status").to_pylist() == ["ok"] * 6


def test_timeout_fails_the_run_naming_the_row(tmp_path: Path, monkeypatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("RFTPIPE_TEST_PIDS", str(pids))
    with pytest.raises(UserError) as err:
        scored({"path": "reward_fns:sleep_forever", "timeout_s": 0.5}, workers=1)
    msg = str(err.value)
    assert "reward_fns:sleep_forever timed out on step 1 prompt_id 0 sample_idx 0" in msg, msg
    assert "\n" not in msg
    assert not any(alive(int(p)) for p in pids.read_text().split())


def test_exception_policy() -> None:
    t = scored("reward_fns:raises_on_odd", on_error="zero").to_pydict()
    assert t["reward_status"] == ["ok", "error", "ok"] * 2
    assert t["reward_raises_on_odd"] == [1.0, 0.0, 1.0] * 2
    assert "RuntimeError: odd sample 1" in t["reward_error"][1]
    with pytest.raises(
        UserError, match=r"raises_on_odd failed on step 1 prompt_id \d sample_idx 1"
    ):
        scored("reward_fns:raises_on_odd")


def test_wrong_return_type_fails_under_any_policy() -> None:
    for policy in ("fail", "zero"):
        with pytest.raises(UserError, match="not_a_number returned str 'high'.*sample_idx 0"):
            scored("reward_fns:not_a_number", on_error=policy)
    with pytest.raises(UserError, match="trl_wrong_length returned list.*list of 3 values"):
        scored({"path": "reward_fns:trl_wrong_length", "signature": "trl"})


def test_a_dying_worker_is_an_error_and_prints_stay_out_of_replies() -> None:
    t = scored("reward_fns:exits", on_error="zero", workers=1).to_pydict()
    assert t["reward_status"] == ["error"] * 6
    assert "exit code 3" in t["reward_error"][0]
    t = scored("reward_fns:prints", workers=1).to_pydict()
    assert t["reward_prints"] == [0.5] * 6


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("nosuch_mod:fn", "cannot import 'nosuch_mod:fn'"),
        ("reward_fns:nosuch", "cannot import 'reward_fns:nosuch'"),
        ("nosuch", "unknown reward 'nosuch'"),
        ({"path": "reward_fns:compute_score"}, "cannot be called with the rftpipe signature"),
        ({"path": "reward_fns:even_share", "signature": "verl"}, "with the verl signature"),
        ({"path": "reward_fns:even_share", "signature": "trl"}, "with the trl signature"),
    ],
)
def test_bad_functions_refused_at_start(spec: object, needle: str) -> None:
    cfg = from_dict(RewardConfig, {"functions": [spec]})
    with pytest.raises(UserError, match=needle):
        resolve_all(cfg, None)


def test_reward_config() -> None:
    cfg = from_dict(
        RunConfig, {}, ["reward.functions=[accuracy, {path: m:compute_score, signature: verl}]"]
    )
    specs = cfg.reward.specs()
    assert [s.column for s in specs] == ["reward_accuracy", "reward_compute_score"]
    assert specs[1].signature == "verl"
    bad = {
        "reward.functions=[{path: m:f, signatur: verl}]": "did you mean 'reward.functions[0].signature'",
        "reward.functions=[remote]": "functions names 'remote' but remote.url is empty",
        "reward.remote.url=http://x": "remote.url is set but functions does not name 'remote'",
        "reward.functions=[a:f, b:f]": "share a column name",
        "reward.timeout_s=0": "timeout_s must be",
        "reward.on_error=skip": "must be one of 'fail', 'zero'",
        "reward.remote.url=ftp://x": "must start with http",
        "reward.remote.url=https://u:pw@x/score": "must not carry credentials",
    }
    for override, needle in bad.items():
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(")):
            from_dict(
                RunConfig,
                {},
                [override, "reward.functions=[remote]"]
                if "ftp" in override or "@" in override
                else [override],
            )


def test_data_source_routing() -> None:
    """A function with `data_sources` scores only those rows; the others' column is null
    and adds nothing to `reward`."""
    cfg = from_dict(
        RewardConfig,
        {
            "functions": [
                {"path": "reward_fns:compute_score", "signature": "verl", "data_sources": ["gsm"]},
                {"path": "reward_fns:trl_length", "signature": "trl", "data_sources": ["math"]},
                "dense_even_tokens",
            ]
        },
    )
    t = score.run(cfg, resolve_all(cfg, None), rollouts(sources=("gsm", "math"))).to_pydict()
    assert t["reward_compute_score"] == [1.0, 1.0, 0.0, None, None, None]
    assert t["reward_compute_score_source"] == ["gsm"] * 3 + [None] * 3
    assert t["reward_trl_length"] == [None, None, None, 1 / 8, 2 / 8, 3 / 8]
    even = t["reward_dense_even_tokens"]
    assert None not in even
    assert t["reward"] == [
        (c or 0.0) + (tl or 0.0) + e
        for c, tl, e in zip(t["reward_compute_score"], t["reward_trl_length"], even, strict=True)
    ]
    assert t["reward_status"] == ["ok"] * 6


def test_every_data_source_needs_a_function() -> None:
    routed = {"path": "reward_fns:even_share", "data_sources": ["gsm"]}
    cfg = from_dict(RewardConfig, {"functions": [routed]})
    check_coverage(cfg, {"gsm"})
    with pytest.raises(UserError, match="no function scores data source 'math'") as err:
        check_coverage(cfg, {"gsm", "math"})
    assert "\n" not in str(err.value)
    # A function without declared sources scores them all.
    check_coverage(from_dict(RewardConfig, {"functions": [routed, "format"]}), {"gsm", "math"})


def test_math_verify_builtin() -> None:
    """Hand-written responses against their reference answers, scored in the worker pool."""
    cases = [
        ("0.5", "Half of it: $\\frac{1}{2}$", 1.0),  # LaTeX-equivalent
        ("\\frac{1}{2}", "so the share is 0.5", 1.0),
        ("72", "48 + 24 = 72 clips.\n#### 72", 1.0),
        ("72", "She sold \\boxed{71} clips.", 0.0),  # wrong
        ("3", "I cannot tell.", 0.0),  # no answer at all
        ("0.75", "It is $\\dfrac{6}{8}$ of the cake", 1.0),
    ]
    rows = [
        {
            "step": 1,
            "prompt_id": i,
            "sample_idx": 0,
            "prompt": "q",
            "response": response,
            "answer": answer,
            "metadata": "{}",
            "response_token_ids": [1],
            "finish_reason": "stop",
        }
        for i, (answer, response, _) in enumerate(cases)
    ]
    cfg = from_dict(RewardConfig, {"functions": ["math_verify"]})
    t = score.run(cfg, resolve_all(cfg, None), pa.Table.from_pylist(rows)).to_pydict()
    assert t["reward_math_verify"] == [want for *_, want in cases]
    assert t["reward_status"] == ["ok"] * len(cases)
