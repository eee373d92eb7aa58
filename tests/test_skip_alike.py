"""Rows of all-alike groups skip the train stage's forward and backward
(`train.skip_zero_advantage`), with the update as it was.

A group whose rewards are all equal gets advantage exactly 0 under the group estimators
(`EstimatorTraits.alike_groups_zero`), so its rows add nothing to the policy gradient; the
stage leaves them out of its micro-batches while the losses' normalisers still count them.
The bound: weights after a step within 1e-6 relative of the unskipped step's (float
summation order differs: other micro-batches), loss and gradient norm within the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from helpers import TESTS_ON_PATH, events, final_weights, submit, table_samples, trajectories

from jobs import status
from rftpipe.algos.advantage import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from rftpipe.algos.variants import (
    DrGRPOSettings,
    GPGAdvantageSettings,
    GRPOPassKSettings,
    GRPOSettings,
    OPOSettings,
    RLOOSettings,
)
from rftpipe.config.loader import load_config
from rftpipe.config.schema import (
    AdvantageConfig,
    KLConfig,
    RunConfig,
    TrainConfig,
    skips_alike_groups,
)
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.stages import advantage, batching, train

# Eight samples of 0.1: summed in some orders their float mean is 0.09999999999999999
# (whether the estimator's group matmul leaves that residue depends on the CPU's kernels).
ALIKE = [0.1] * 8


def _inputs(scores: list[float], groups: list[int]) -> AdvantageInputs:
    b = len(scores)
    return AdvantageInputs(
        rewards=torch.tensor(scores, dtype=torch.float64),
        group_index=torch.tensor(groups),
        response_mask=torch.ones(b, 3, dtype=torch.bool),
    )


@pytest.mark.parametrize(
    "settings", [GRPOSettings(), DrGRPOSettings(), RLOOSettings(), GPGAdvantageSettings()]
)
def test_an_all_alike_group_gets_exactly_zero(settings) -> None:  # noqa: ANN001
    """The estimators' own arithmetic leaves the residue of the group's float mean (GRPO
    divides it by eps); `compute_advantages` gives exactly 0 there and leaves a varied
    group's advantages as the estimator computed them."""
    scores = [*ALIKE, 0.0, 1.0, 0.5, 0.25]
    groups = [0] * 8 + [1] * 4
    inp = _inputs(scores, groups)
    raw = ADVANTAGE_ESTIMATORS.function(settings)(inp, settings, reduce_sum=lambda x: x)
    adv = compute_advantages(settings, inp)
    assert bool((adv[:8] == 0).all())
    assert torch.equal(adv[8:], raw[8:]) and bool((adv[8:] != 0).any())


def _table(rewards: list[list[float]], settings=None) -> pa.Table:  # noqa: ANN001
    """Groups of samples (prompt i's rewards[i]), responses of 2 to 4 tokens, old logprobs
    -1, advantages from the estimator `settings` (GRPO's by default)."""
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "sample_idx", "prompt_token_ids")}
    cols |= {"response_token_ids": [], "logprobs": [], "reward": [], "response_length": []}
    for g, rs in enumerate(rewards):
        for k, r in enumerate(rs):
            n = 2 + (g + k) % 3
            cols["prompt_id"].append(g)
            cols["sample_idx"].append(k)
            cols["prompt_token_ids"].append([5 + g, 6, 7 + k % 2])
            cols["response_token_ids"].append([8 + (g * 3 + k + j) % 20 for j in range(n)])
            cols["logprobs"].append([-1.0] * n)
            cols["reward"].append(r)
            cols["response_length"].append(n)
    lengths = torch.tensor(cols["response_length"])
    adv = compute_advantages(
        settings or GRPOSettings(),
        AdvantageInputs(
            rewards=torch.tensor(cols["reward"], dtype=torch.float64),
            group_index=torch.tensor(cols["prompt_id"]),
            response_mask=torch.arange(4)[None, :] < lengths[:, None],
        ),
    )
    cols["advantages"] = [adv[i, :n].tolist() for i, n in enumerate(cols["response_length"])]
    return pa.table(
        cols
        | {
            "logprobs": pa.array(cols["logprobs"], pa.list_(pa.float32())),
            "advantages": pa.array(cols["advantages"], pa.list_(pa.float32())),
        }
    )


def _step(table: pa.Table, skip: frozenset[int] | None, **train_cfg) -> tuple[dict, list]:  # noqa: ANN003
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, micro_batch_size=3, **train_cfg)
    engine = SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), cfg, Dist())
    samples = table_samples(table)
    inp = batching.TrainInputs(
        step=1, run_seed=0, table=table, global_samples=samples, kl_coef=0.0, temperature=1.0,
        response_budget=4, skip=skip,
    )  # fmt: skip
    metrics = train.run(cfg, KLConfig(), engine, Dist(), inp)
    return metrics, [p.detach().clone() for p in engine.model.parameters()]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)) ** 0.5
    return num / sum(float(x.pow(2).sum()) for x in a) ** 0.5


def _close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


# Two all-alike groups (rewards all 1, all 0) and two varied ones.
REWARDS = [[1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 1.0], [0.2, 0.7, 0.7, 0.1]]
ESTIMATORS = [
    GRPOSettings(), DrGRPOSettings(), RLOOSettings(), OPOSettings(), GPGAdvantageSettings(),
    GRPOPassKSettings(),
]  # fmt: skip
CASES = [
    *[pytest.param(e, "token-mean", 1, id=f"{type(e).__name__}") for e in ESTIMATORS],
    *[
        pytest.param(GRPOSettings(), agg, mb, id=f"{agg}-mb{mb}")
        for agg, mb in [
            ("token-mean", 2),
            ("seq-mean-token-mean", 2),
            ("seq-mean-token-sum", 1),
            ("seq-mean-token-sum-norm", 1),
        ]
    ],
]


@pytest.mark.parametrize(("settings", "agg", "mini_batches"), CASES)
def test_skipping_alike_rows_leaves_the_update_as_it_was(
    settings, agg: str, mini_batches: int
) -> None:  # noqa: ANN001
    """Every group estimator, every loss aggregation: the skipped step's weights, loss and
    gradient norm equal the full step's within 1e-6 relative, and its micro-batches held
    only the varied groups' tokens."""
    table = _table(REWARDS, settings)
    skip = batching.alike_rows(table)
    assert skip == frozenset(range(8))
    over = {"loss_agg": agg, "mini_batches": mini_batches}
    full, w_full = _step(table, None, **over)
    part, w_part = _step(table, skip, **over)
    assert "train/skipped_rows" not in full and part["train/skipped_rows"] == 8
    assert part["train/tokens"] < full["train/tokens"]
    assert part["train/tokens"] + part["train/skipped_tokens"] == full["train/tokens"]
    initial = [p.detach() for p in load_causal_lm(prepare_tiny(), "float32").parameters()]
    assert _rel(initial, w_full) > 1e-5  # the step moved the weights
    assert _rel(w_full, w_part) < 1e-6, _rel(w_full, w_part)
    for key in ("train/pg_loss", "train/grad_norm"):
        assert _close(full[key], part[key]), (key, full[key], part[key])


def test_the_actors_old_logprob_pass_skips_the_same_rows() -> None:
    """Item 3: with the old policy from the actor (`train.old_logprobs=actor`), the
    advantage stage's forward leaves out the rows the train stage will skip. The others'
    old logprobs equal the full pass's within 1e-6 (other micro-batches), the skipped rows
    carry their sampling logprobs (never read), and the logprob-difference metrics are over
    the computed rows, which the counts say."""
    table = _table(REWARDS).drop_columns(["advantages"])
    cfg = TrainConfig(micro_batch_size=3)
    engine = SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), cfg, Dist())
    fed: list[int] = []

    def actor(prompts, responses):  # noqa: ANN001, ANN202
        fed.append(len(prompts))
        return engine.compute_logprobs(prompts, responses, temperature=1.0)

    stage = advantage.AdvantageStageConfig(
        advantage=AdvantageConfig(), kl=KLConfig(), kl_coef=0.0
    )  # fmt: skip
    add = Dist().all_reduce_sum

    def run(skip: frozenset[int]) -> tuple[pa.Table, dict]:  # noqa: ANN001
        return advantage.run(
            stage, table, None, add, actor_logprobs=actor, reduce_max=add, skip=skip
        )

    full, m_full = run(frozenset())
    skip = batching.alike_groups(table)
    assert skip == frozenset(range(8))
    part, m_part = run(skip)
    assert fed == [16, 8]
    assert part.column("advantages").equals(full.column("advantages"))
    old_full = full.column("old_logprobs").to_pylist()
    old_part = part.column("old_logprobs").to_pylist()
    sampled = table.column("logprobs").to_pylist()
    for i, (a, b) in enumerate(zip(old_full, old_part, strict=True)):
        if i in skip:
            assert b == sampled[i]
        else:
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    assert m_full["advantage/old_logprob_skipped_rows"] == 0
    assert m_part["advantage/old_logprob_skipped_rows"] == 8
    tokens = sum(len(r) for r in table.column("response_token_ids").to_pylist()[:8])
    assert m_part["advantage/old_logprob_skipped_tokens"] == tokens
    # Over the 8 varied rows only: their own mean of |old - sampled|.
    diffs = [abs(x - y) for i in range(8, 16) for x, y in zip(old_part[i], sampled[i], strict=True)]
    assert m_part["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs))


def test_a_step_of_only_alike_groups_still_takes_its_optimizer_step() -> None:
    """Nothing to train: each mini-batch runs one weight-0 padding micro-batch, so every
    parameter has a zero gradient (not None) and AdamW's weight decay moves the weights as
    in the full step."""
    table = _table([[1.0] * 4, [0.0] * 4])
    full, w_full = _step(table, None)
    part, w_part = _step(table, batching.alike_rows(table))
    assert part["train/skipped_rows"] == 8 and part["train/tokens"] == 0
    assert part["train/skipped_tokens"] == full["train/tokens"]
    initial = [p.detach() for p in load_causal_lm(prepare_tiny(), "float32").parameters()]
    assert _rel(initial, w_part) > 0  # weight decay
    assert _rel(w_full, w_part) < 1e-6, _rel(w_full, w_part)
    assert full["train/updates"] == part["train/updates"] == 1


def test_a_row_of_an_alike_group_with_an_advantage_is_refused() -> None:
    table = _table([[1.0, 1.0]])
    table = table.set_column(
        table.schema.get_field_index("advantages"),
        "advantages",
        pa.array([[0.0, 0.0], [0.5, 0.5, 0.5]], pa.list_(pa.float32())),
    )
    with pytest.raises(RuntimeError, match=r"row 1 \(prompt_id 0\)"):
        batching.alike_rows(table)


@pytest.mark.parametrize(
    ("overrides", "skips"),
    [
        ((), True),
        (("advantage.estimator=rloo",), True),
        (("train.skip_zero_advantage=off",), False),
        (("kl.mode=loss", "kl.coef=0.1"), False),
        (("kl.mode=reward", "kl.coef=0.1"), False),
        (("train.entropy_coef=0.01",), False),
        (("train.entropy_mask_top=0.2",), False),
        (("train.policy_loss=kl_cov",), False),
        (("train.policy_loss=clip_cov",), False),
        (("advantage.estimator=reinforce_pp_baseline",), False),
        (("advantage.estimator=reinforce_pp",), False),
    ],
)
def test_auto_skips_only_where_no_term_reads_the_rows(overrides, skips: bool) -> None:  # noqa: ANN001
    cfg = load_config(RunConfig, None, list(overrides))
    assert skips_alike_groups(cfg) is skips


# -- a run ----------------------------------------------------------------------------------

# Even prompt ids score 1 on every sample (all alike: skipped), odd ones the share of even
# token ids (varied). 4 prompts a step, 3 steps, checkpoints every 2.
HALF = ("reward.functions=[{path: reward_fns:even_share_odd_prompts}]", "total_steps=3")


@pytest.mark.slow
def test_a_run_skips_and_a_kill_mid_train_resumes_bitwise(tmp_path: Path) -> None:
    """Under auto, every step skips its even prompts' groups (`train/skipped_rows`), the
    policy still learns from the others, and a SIGKILL mid-train (step 3's train stage
    replayed from step 2's checkpoint) ends bitwise equal to the uninterrupted run. With a
    KL loss, nothing is skipped and the metrics and `jobs.status` say why."""
    ref = tmp_path / "ref"
    out = submit(ref, *HALF, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/skipped_rows" in m]
    assert len(steps) == 3, steps
    rows = trajectories(ref).select(["step", "prompt_id", "reward"]).to_pylist()
    for m in steps:  # every row of a group whose rewards are all equal, the even prompts'
        mine = [r for r in rows if r["step"] == m["step"]]
        alike = [
            r
            for r in mine
            if {x["reward"] for x in mine if x["prompt_id"] == r["prompt_id"]} == {r["reward"]}
        ]
        assert all(r["prompt_id"] % 2 == 0 for r in alike)
        assert m["train/skipped_rows"] == len(alike), (m["step"], m["train/skipped_rows"])
    assert sum(m["train/skipped_rows"] for m in steps) > 0
    assert all(m["train/tokens"] > 0 for m in steps)  # the odd prompts' rows trained
    assert status.describe(ref)["skip_blocked"] == []
    run = tmp_path / "killed"
    env = {**TESTS_ON_PATH, "RFTPIPE_FAULT": "train_mid_step", "RFTPIPE_FAULT_SKIP": "2"}
    assert submit(run, *HALF, env=env).returncode != 0
    out = submit(run, *HALF, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(e["event"] == "replay" for e in events(run))
    assert trajectories(run).equals(trajectories(ref))
    a, b = final_weights(run), final_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    kl = tmp_path / "kl"
    out = submit(kl, *HALF, "total_steps=1", "kl.mode=loss", "kl.coef=0.05", env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (kl / "metrics.jsonl").read_text().splitlines()
    (m,) = [m for m in map(json.loads, lines) if "train/kl" in m]
    assert "train/skipped_rows" not in m and m["train/skip_blocked/kl_loss"] == 1.0
    assert status.describe(kl)["skip_blocked"] == ["kl.mode=loss: the KL term reads every row"]


@pytest.mark.slow
def test_a_run_on_the_actors_old_logprobs_skips_them_too(tmp_path: Path) -> None:
    """`train.old_logprobs=actor`: the advantage stage's actor pass leaves out the rows the
    train stage skips (the counts agree), and the step's weights equal those of the run
    that skips nothing within 1e-6 relative."""
    got = {}
    for mode in ("auto", "off"):
        run = tmp_path / mode
        over = ("total_steps=1", "train.old_logprobs=actor", f"train.skip_zero_advantage={mode}")
        out = submit(run, *HALF, *over, env=TESTS_ON_PATH)
        assert out.returncode == 0, out.stderr[-3000:]
        (m,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        got[mode] = m, final_weights(run)
    (auto, w_auto), (off, w_off) = got["auto"], got["off"]
    assert auto["advantage/old_logprob_skipped_rows"] == auto["train/skipped_rows"] > 0
    assert off["advantage/old_logprob_skipped_rows"] == 0
    assert _rel([w_off[k] for k in w_off], [w_auto[k] for k in w_off]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_two_ranks_skip_like_one(backend: str, tmp_path: Path) -> None:
    """Two ranks of a sharded backend, each skipping its own all-alike groups, give the
    one-rank run's rows bitwise and its final weights within 1e-5 of their norm (the
    sharded reductions' bound, tests/test_distributed.py)."""
    pytest.importorskip(backend if backend == "deepspeed" else "torch")
    one, two = tmp_path / "one", tmp_path / "two"
    for run, extra in ((one, ()), (two, ("--tasks-per-node", "2"))):
        over = () if run is one else (f"train.backend={backend}",)
        out = submit(run, *HALF, *over, extra=extra, env=TESTS_ON_PATH)
        assert out.returncode == 0, out.stderr[-3000:]
    cols = ["step", "prompt_id", "sample_idx", "response_token_ids", "reward", "advantages"]
    assert trajectories(two).select(cols).equals(trajectories(one).select(cols))
    a, b = final_weights(one), final_weights(two)
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    assert num / sum(float(a[k].pow(2).sum()) for k in a) ** 0.5 < 1e-5
    skipped = [
        json.loads(x).get("train/skipped_rows")
        for x in (two / "metrics.jsonl").read_text().splitlines()
    ]
    assert sum(s for s in skipped if s) > 0


def test_a_run_directory_from_before_the_key_resumes_without_skipping() -> None:
    """Saved configs hold every key of their version: one without
    `train.skip_zero_advantage` was written before it existed and resumes with `off`, so
    its replayed train steps equal their committed updates (tests/test_migration.py)."""
    from rftpipe.config.loader import from_dict, to_dict

    saved = to_dict(load_config(RunConfig))
    assert saved["train"]["skip_zero_advantage"] == "auto"
    del saved["train"]["skip_zero_advantage"]
    assert from_dict(RunConfig, saved, saved=True).train.skip_zero_advantage == "off"
    with pytest.raises(Exception, match="skip_zero_advantage"):
        from_dict(RunConfig, {"train": {"skip_zero_advantage": "sometimes"}})
