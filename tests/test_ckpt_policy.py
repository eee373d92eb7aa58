"""The checkpoint policy: Young/Daly intervals, their costs, the preemption rate, the controller,
and the `checkpoint.*` config fields that select it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.submit import main as submit_main
from rftpipe.checkpoint.policy import (
    CheckpointController,
    RunHistory,
    daly_period_s,
    interval_costs,
    pooled_mtbf_s,
    read_history,
    young_daly_interval,
    young_period_s,
)
from rftpipe.config.loader import ConfigError, diff_keys, load_config, to_dict
from rftpipe.config.schema import RESUME_SAFE_KEYS, RunConfig

ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600.0

# ------------------------------------------------------------------------ formulas


def test_young_period_by_hand() -> None:
    # sqrt(2 * 2 * 3600) = sqrt(14400) = 120 exactly.
    assert young_period_s(2.0, 3600.0) == 120.0
    assert young_period_s(0.0, 3600.0) == 0.0


def test_daly_period_by_hand() -> None:
    # C / 2M = 1/3600, its root 1/60: 120 * (1 + 1/180 + 1/32400) - 2 = 118 + 2/3 + 1/270.
    assert daly_period_s(2.0, 3600.0) == pytest.approx(118 + 2 / 3 + 1 / 270, rel=1e-12)
    # C >= 2M: once per MTBF.
    assert daly_period_s(10.0, 5.0) == 5.0
    assert daly_period_s(10.0, 4.0) == 4.0
    # Just below 2M the formula applies: sqrt(2C M) (1 + 1/3 sqrt(x) + x/9) - C, x -> 1.
    c, m = 9.99, 5.0
    x = c / (2 * m)
    expect = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert daly_period_s(c, m) == pytest.approx(expect)


def test_interval_in_steps_rounded_and_clamped() -> None:
    # 120 s of 6 s steps.
    assert young_daly_interval(2.0, 6.0, 3600.0, order="young") == 20
    # Daly: 118.67 / 6 = 19.78 -> 20.
    assert young_daly_interval(2.0, 6.0, 3600.0) == 20
    # Daly: 118.67 / 5 = 23.73 -> 24; Young: 24 exactly.
    assert young_daly_interval(2.0, 5.0, 3600.0) == 24
    # Halves round up: 120 / 48 = 2.5 -> 3, 120 / 80 = 1.5 -> 2.
    assert young_daly_interval(2.0, 48.0, 3600.0, order="young") == 3
    assert young_daly_interval(2.0, 80.0, 3600.0, order="young") == 2
    # Clamping.
    assert young_daly_interval(2.0, 6.0, 3600.0, order="young", max_interval=15) == 15
    assert young_daly_interval(2.0, 6.0, 3600.0, order="young", min_interval=25) == 25
    assert young_daly_interval(0.0, 6.0, 3600.0) == 1
    assert young_daly_interval(0.0, 6.0, 3600.0, min_interval=5) == 5
    assert young_daly_interval(2.0, 6.0, 1e12, max_interval=200) == 200


def test_replay_aware_interval() -> None:
    # Replay at half a step's cost: as if M were doubled. sqrt(2 * 2 * 7200) / 6 = 28.28 -> 28.
    assert young_daly_interval(2.0, 6.0, 3600.0, replay_step_s=3.0, order="young") == 28
    assert young_daly_interval(2.0, 6.0, 7200.0, order="young") == 28
    # replay_step_s == step_s is the classic model.
    assert young_daly_interval(2.0, 6.0, 3600.0, replay_step_s=6.0) == young_daly_interval(
        2.0, 6.0, 3600.0
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ckpt_cost_s": -1.0}, "ckpt_cost_s"),
        ({"ckpt_cost_s": math.nan}, "ckpt_cost_s"),
        ({"step_s": 0.0}, "step_s"),
        ({"mtbf_s": 0.0}, "mtbf_s"),
        ({"mtbf_s": math.inf}, "mtbf_s"),
        ({"replay_step_s": 0.0}, "replay_step_s"),
        ({"min_interval": 0}, "min_interval"),
        ({"min_interval": 5, "max_interval": 4}, "max_interval"),
        ({"order": "third"}, "order"),
    ],
)
def test_interval_rejects_bad_arguments(kwargs: dict, needle: str) -> None:
    args = {"ckpt_cost_s": 2.0, "step_s": 6.0, "mtbf_s": 3600.0, **kwargs}
    with pytest.raises(ValueError, match=needle):
        young_daly_interval(**args)


def test_interval_costs_by_hand() -> None:
    c = interval_costs(
        20, ckpt_cost_s=2.33, step_s=5.95, replay_step_s=2.4, mtbf_s=4 * HOUR, commit_s=0.0359
    )
    assert c.interval == 20
    assert c.checkpoint_share == pytest.approx(2.33 / 119.0)
    assert c.commit_share == pytest.approx(0.0359 / 5.95)
    assert c.durability_share == pytest.approx(2.33 / 119.0 + 0.0359 / 5.95)
    assert c.replay_s == pytest.approx(24.0)  # 10 train steps of 2.4 s
    assert c.replay_share == pytest.approx(24.0 / 14400.0)
    assert c.total_share == pytest.approx(c.durability_share + c.replay_share)
    with pytest.raises(ValueError, match="interval"):
        interval_costs(0, ckpt_cost_s=1.0, step_s=1.0, replay_step_s=1.0, mtbf_s=1.0)


def test_replay_aware_optimum_balances_checkpoints_and_replay() -> None:
    # First order: at k* = sqrt(2 C M / (s t)) the two shares are equal.
    k = young_daly_interval(2.0, 6.0, 3600.0, replay_step_s=3.0, order="young")
    c = interval_costs(k, ckpt_cost_s=2.0, step_s=6.0, replay_step_s=3.0, mtbf_s=3600.0)
    assert c.checkpoint_share == pytest.approx(c.replay_share, rel=0.05)
    for other in (k - 3, k + 3):
        o = interval_costs(other, ckpt_cost_s=2.0, step_s=6.0, replay_step_s=3.0, mtbf_s=3600.0)
        assert o.checkpoint_share + o.replay_share > c.checkpoint_share + c.replay_share


# ------------------------------------------------------------------ preemption rate


def _ev(t: float, event: str, rank: int = 0, **fields) -> str:
    return json.dumps({"t": t, "pid": 1, "rank": rank, "event": event, **fields})


def _steps(t0: float, first: int, last: int, dt: float = 10.0) -> list[str]:
    out, t = [], t0
    for s in range(first, last + 1):
        out += [
            _ev(t, "stage_begin", step=s, stage="rollout"),
            _ev(t + 1, "commit", step=s, stage="rollout"),
        ]
        out += [_ev(t + 2, "commit", step=s, stage="train")]
        t += dt
    return out


def test_history_from_synthetic_events(tmp_path: Path) -> None:
    lines = [
        _ev(1.0, "user_error", message="before any start: ignored"),
        # 1: stopped by a signal (every rank logs the stop) after 3600 s.
        _ev(1000.0, "start", removed=0, last_commit="None"),
        *_steps(1010.0, 1, 3),
        _ev(1050.0, "checkpoint", step=2),
        _ev(4600.0, "stop", rank=0, signal="SIGUSR2", at="step 4 rollout"),
        _ev(4600.0, "stop", rank=1, signal="SIGUSR2", at="step 4 rollout"),
        # 2: replays, works, then nothing: a hard kill, seen at the next start. 1800 s.
        _ev(10000.0, "start", removed=1, last_commit="(3, 'train')"),
        _ev(10010.0, "replay", step=3, seconds=2.4, identical=True),
        *_steps(10020.0, 4, 6),
        _ev(11800.0, "checkpoint", step=5),
        '{"t": 11800.5, "event": "comm',  # torn by the kill
        # 3: refused its input (e.g. total_steps below the committed steps). 5 s.
        _ev(20000.0, "start", removed=0, last_commit="(6, 'train')"),
        _ev(20005.0, "user_error", message="total_steps: 4 is below the 6 steps"),
        # 4: finishes: its last step checkpoints, nothing after. 3600 s.
        _ev(30000.0, "start", removed=0, last_commit="(6, 'train')"),
        *_steps(30010.0, 6, 10),
        _ev(33600.0, "checkpoint", step=10),
        # 5: started on a finished run, did nothing. 0 s.
        _ev(50000.0, "start", removed=0, last_commit="(10, 'train')"),
        "[1, 2]",
        "not json",
        # 6: extended run, still going (newest session: not counted). 1800 s.
        _ev(60000.0, "start", removed=0, last_commit="(10, 'train')"),
        *_steps(60010.0, 11, 12),
        _ev(61800.0, "commit", step=13, stage="rollout"),
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    h = read_history(path)
    assert h == RunHistory(sessions=6, interruptions=2, run_s=3600 + 1800 + 5 + 3600 + 0 + 1800)
    # (4 h prior + 10805 s) / (1 + 2)
    assert pooled_mtbf_s(h, 4 * HOUR) == pytest.approx((14400 + 10805) / 3)
    assert pooled_mtbf_s(h, 4 * HOUR, prior_weight=2.0) == pytest.approx((28800 + 10805) / 4)


def test_history_edge_cases(tmp_path: Path) -> None:
    assert read_history(tmp_path / "missing.jsonl") == RunHistory(0, 0, 0.0)
    path = tmp_path / "events.jsonl"
    path.write_text(
        "\n".join(
            [
                # Killed by a test fault point: interrupted.
                _ev(0.0, "start"),
                *_steps(1.0, 1, 2),
                _ev(30.0, "fault", point="train_mid_step"),
                # Did no step and the run was not complete: died while loading.
                _ev(100.0, "start"),
                _ev(110.0, "corrupt_checkpoint", step=2, path="x"),
                # Newest session, stopped by a signal: counted.
                _ev(200.0, "start"),
                _ev(260.0, "stop", signal="SIGTERM", at="step 1 train"),
            ]
        )
    )
    assert read_history(path) == RunHistory(sessions=3, interruptions=3, run_s=30 + 10 + 60)


def test_history_stop_right_after_a_checkpoint(tmp_path: Path) -> None:
    # Stopped at a boundary just after its checkpoint: interrupted, and not a finished run,
    # so the next session, which does no step, died while loading.
    path = tmp_path / "events.jsonl"
    path.write_text(
        "\n".join(
            [
                _ev(0.0, "start"),
                *_steps(1.0, 1, 2),
                _ev(25.0, "checkpoint", step=2),
                _ev(30.0, "stop", signal="SIGUSR2", at="step 3 rollout"),
                _ev(100.0, "start"),
                _ev(120.0, "start"),
            ]
        )
    )
    assert read_history(path) == RunHistory(sessions=3, interruptions=2, run_s=30.0)


def test_pooled_mtbf_uses_the_prior_without_history() -> None:
    assert pooled_mtbf_s(RunHistory(0, 0, 0.0), 4 * HOUR) == 4 * HOUR
    # An uninterrupted run raises its estimate as it goes.
    assert pooled_mtbf_s(RunHistory(1, 0, 10 * HOUR), 4 * HOUR) == 14 * HOUR
    # Much history: tends to T / n.
    assert pooled_mtbf_s(RunHistory(101, 100, 100 * HOUR), 4 * HOUR) == pytest.approx(
        104 / 101 * HOUR
    )
    with pytest.raises(ValueError, match="prior_mtbf_s"):
        pooled_mtbf_s(RunHistory(0, 0, 0.0), 0.0)


# ------------------------------------------------------------------------ controller


def _controller(**kw) -> CheckpointController:
    args = {"mtbf_s": 3600.0, "initial_interval": 20, "min_interval": 5, "max_interval": 50}
    return CheckpointController(**{**args, "order": "young", **kw})


def _simulate(ctl: CheckpointController, steps: range, cost: float = 2.0) -> list[int]:
    """A driver's loop: measure each step, checkpoint when due, measure the checkpoint's cost."""
    taken = []
    pending = False
    for step in steps:
        ctl.observe_step(60.0 if step % 7 == 0 else 6.0, 3.0)  # sparse outliers
        if pending:
            ctl.observe_checkpoint(cost)
            pending = False
        if ctl.due(step):
            ctl.mark_checkpoint(step)
            taken.append(step)
            pending = True
    return taken


def test_controller_decisions_over_a_sequence() -> None:
    ctl = _controller()
    assert ctl.interval() == 20  # nothing measured yet
    assert not ctl.due(19) and ctl.due(20)
    # Medians: 6 s steps, 3 s train, 2 s checkpoints -> 28 steps (replay-aware Young);
    # the every-7th-step outliers of 60 s do not move the median.
    assert _simulate(ctl, range(1, 101)) == [20, 48, 76]
    assert ctl.step_s == 6.0 and ctl.train_s == 3.0 and ctl.ckpt_cost_s == 2.0
    assert ctl.interval() == 28
    costs = ctl.costs()
    assert costs is not None and costs.interval == 28 and costs.replay_s == 42.0
    # due() changes nothing.
    assert ctl.due(104) and ctl.due(104) and ctl.last_checkpoint == 76
    # Cheaper checkpoints: median of [2, 2, 0, 0, 0] is 0 -> min_interval.
    for _ in range(3):
        ctl.observe_checkpoint(-0.5)  # noise below zero counts as 0
    assert ctl.ckpt_cost_s == 0.0 and ctl.interval() == 5
    assert not ctl.due(80) and ctl.due(81)
    # Rare preemptions: capped at max_interval.
    ctl.mtbf_s = 1e9
    for _ in range(5):
        ctl.observe_checkpoint(2.0)
    assert ctl.interval() == 50
    # Bad figures are ignored.
    before = ctl.state_dict()
    ctl.observe_step(math.nan, math.inf)
    ctl.observe_step(-1.0, 0.0)
    ctl.observe_checkpoint(math.nan)
    assert ctl.state_dict() == before


def test_controller_is_deterministic_and_round_trips() -> None:
    a, b = _controller(), _controller()
    assert _simulate(a, range(1, 200)) == _simulate(b, range(1, 200))
    # Resume mid-run from the state captured at a checkpoint: same decisions as running on.
    first = _controller()
    taken = _simulate(first, range(1, 49))
    assert taken == [20, 48]
    state = json.loads(json.dumps(first.state_dict()))  # plain numbers only
    assert all(isinstance(v, float) for v in state["step_s"] + [state["last_checkpoint"]])
    resumed = _controller()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert _simulate(resumed, range(49, 200)) == _simulate(first, range(49, 200))
    # A smaller window keeps the newest measurements.
    small = _controller(step_window=3, ckpt_window=1)
    small.load_state_dict(state)
    assert small.state_dict()["step_s"] == state["step_s"][-3:]
    assert small.state_dict()["ckpt_cost_s"] == state["ckpt_cost_s"][-1:]


def test_controller_bounds_and_arguments() -> None:
    # The initial interval is clamped too.
    assert _controller(initial_interval=2).interval() == 5
    assert _controller(initial_interval=99).interval() == 50
    # Never closer than min_interval, never farther than max_interval, whatever is measured.
    for cost in (0.0, 0.01, 2.0, 500.0):
        ctl = _controller()
        ctl.observe_step(6.0, 3.0)
        ctl.observe_checkpoint(cost)
        taken = _simulate(ctl, range(1, 400), cost=cost)
        gaps = [b - a for a, b in zip([0, *taken], taken, strict=False)]
        assert gaps and all(5 <= g <= 50 for g in gaps), (cost, gaps)
    with pytest.raises(ValueError, match="min_interval"):
        CheckpointController(mtbf_s=1.0, initial_interval=1, min_interval=0)
    with pytest.raises(ValueError, match="max_interval"):
        CheckpointController(mtbf_s=1.0, initial_interval=1, min_interval=3, max_interval=2)
    with pytest.raises(ValueError, match="mtbf_s"):
        CheckpointController(mtbf_s=0.0, initial_interval=1)


def test_module_imports_no_torch() -> None:
    code = "import sys, rftpipe.checkpoint.policy; sys.exit('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------------------- config


def test_config_defaults_keep_the_fixed_interval() -> None:
    ck = load_config(RunConfig).checkpoint
    assert (ck.policy, ck.interval, ck.mtbf_hours) == ("fixed", 20, 4.0)
    assert (ck.min_interval, ck.max_interval) == (10, 200)
    ck = load_config(
        RunConfig,
        None,
        [
            "checkpoint.policy=young_daly",
            "checkpoint.mtbf_hours=1e-1",
            "checkpoint.max_interval=20",
        ],
    ).checkpoint
    assert (ck.policy, ck.mtbf_hours, ck.max_interval) == ("young_daly", 0.1, 20)
    # A fixed interval below min_interval is fine: the bounds are young_daly's.
    assert load_config(RunConfig, None, ["checkpoint.interval=2"]).checkpoint.interval == 2


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("checkpoint.policy=auto", ("checkpoint.policy", "'fixed', 'young_daly'")),
        ("checkpoint.mtbf_hours=0", ("'checkpoint'", "mtbf_hours must be", "got 0.0")),
        ("checkpoint.mtbf_hours=-2", ("'checkpoint'", "mtbf_hours must be")),
        ("checkpoint.mtbf_hours=.nan", ("'checkpoint'", "mtbf_hours must be")),
        ("checkpoint.mtbf_hours=.inf", ("'checkpoint'", "mtbf_hours must be")),
        ("checkpoint.mtbf_hours=often", ("checkpoint.mtbf_hours", "expects a float")),
        ("checkpoint.min_interval=0", ("'checkpoint'", "min_interval must be >= 1")),
        ("checkpoint.min_interval=2.5", ("checkpoint.min_interval", "expects an int")),
        ("checkpoint.max_interval=5", ("'checkpoint'", "max_interval must be >= min_interval=10")),
    ],
)
def test_config_rejects_bad_values(override: str, needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [override])
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_config_young_daly_interval_within_bounds() -> None:
    with pytest.raises(
        ConfigError, match=r"interval must be in \[min_interval=10, max_interval=200\]"
    ):
        load_config(RunConfig, None, ["checkpoint.policy=young_daly", "checkpoint.interval=2"])


def test_submit_bad_value_is_one_stderr_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = submit_main(
        ["--cluster", "local", "--run-dir", str(tmp_path / "r"), "--create-only"]
        + ["checkpoint.min_interval=0"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["rftpipe: error: config error in 'checkpoint': min_interval must be >= 1, got 0"]
    assert not (tmp_path / "r").exists()


def test_policy_fields_are_resume_safe() -> None:
    old = load_config(RunConfig)
    new = load_config(
        RunConfig,
        None,
        [
            "checkpoint.policy=young_daly",
            "checkpoint.mtbf_hours=1",
            "checkpoint.min_interval=5",
            "checkpoint.max_interval=100",
        ],
    )
    assert diff_keys(to_dict(old), to_dict(new), exclude=RESUME_SAFE_KEYS) == []
