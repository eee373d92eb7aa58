"""Actor-critic PPO: GAE and the clipped value loss against hand-computed numbers, then real
runs with a critic (values that learn, warm-up, 1 vs 2 ranks)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoint_tensors,
    committed_hash,
    dcp_chunks,
    events,
    submit,
    trajectories,
    two_ranks_then_one,
    weights_rel_diff,
)
from safetensors.torch import load_file

from rftpipe.algos.advantage import AdvantageInputs, compute_advantages, gae_returns
from rftpipe.algos.value import clipped_value_loss
from rftpipe.algos.variants import GAESettings
from rftpipe.engines.models import prepare_tiny
from rftpipe.engines.train.critic import head_seed, load_value_model

CRITIC = ("advantage.estimator=gae", "advantage.estimator.lam=0.95", "critic.lr=1e-3")


def _gae_inputs() -> AdvantageInputs:
    """Three rows: three tokens with a KL penalty, one token, and an empty response.
    Padding holds garbage that must be ignored."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    return AdvantageInputs(
        rewards=torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64),
        group_index=torch.tensor([0, 0, 1]),
        response_mask=mask,
        token_kl_penalty=torch.tensor(
            [[0.1, 0.0, 0.2], [0.0, 7.0, 7.0], [7.0, 7.0, 7.0]], dtype=torch.float64
        ),
        values=torch.tensor(
            [[0.5, 0.2, -0.1], [0.3, 9.0, 9.0], [9.0, 9.0, 9.0]], dtype=torch.float64
        ),
    )


def test_gae_matches_hand_computed_values() -> None:
    inputs = _gae_inputs()
    gamma, gl = 0.9, 0.9 * 0.8
    # Row 0: token rewards [-0.1, 0, 1 - 0.2], V = [0.5, 0.2, -0.1], V after the end 0.
    d2 = 0.8 + gamma * 0.0 - (-0.1)  # 0.9
    d1 = 0.0 + gamma * -0.1 - 0.2  # -0.29
    d0 = -0.1 + gamma * 0.2 - 0.5  # -0.42
    a2, a1 = d2, d1 + gl * d2
    a0 = d0 + gl * a1
    # Row 1: one token, reward 0.5, V = 0.3 (the penalty on padding is not its own).
    b0 = 0.5 - 0.3
    raw = [a0, a1, a2, b0]
    want_returns = torch.tensor(
        [[a0 + 0.5, a1 + 0.2, a2 - 0.1], [b0 + 0.3, 0, 0], [0, 0, 0]], dtype=torch.float64
    )
    settings = GAESettings(gamma=gamma, lam=0.8)
    assert torch.allclose(gae_returns(inputs, settings), want_returns, atol=1e-12)
    # Whitened over the four valid tokens: unbiased variance, as verl's masked_whiten.
    mean, var = statistics.fmean(raw), statistics.variance(raw)
    w = [(x - mean) / math.sqrt(var + 1e-8) for x in raw]
    want = torch.tensor([[w[0], w[1], w[2]], [w[3], 0, 0], [0, 0, 0]], dtype=torch.float64)
    got = compute_advantages(settings, inputs)
    assert torch.allclose(got, want, atol=1e-12), got
    assert torch.equal(got[2], torch.zeros(3, dtype=torch.float64))  # the empty response


def test_gae_with_gamma_lambda_one_is_reward_minus_value() -> None:
    """The 0/1-outcome case the default task runs: advantages before whitening are R - V_t."""
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.25, 0.75, 0.0]], dtype=torch.float64)
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0]), group_index=torch.tensor([0]), response_mask=mask,
        values=values,
    )  # fmt: skip
    returns = gae_returns(inputs, GAESettings(gamma=1.0, lam=1.0))
    assert torch.equal(returns - values * mask, torch.tensor([[0.75, 0.25, 0.0]]).double())


def test_gae_without_values_is_refused() -> None:
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0]),
        group_index=torch.tensor([0]),
        response_mask=torch.ones((1, 2), dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(GAESettings(), inputs)


def test_clipped_value_loss_numbers_and_gradient() -> None:
    values = torch.tensor([[1.0, 0.0, 2.0, 0.4]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    out = clipped_value_loss(values, old, returns, cliprange=0.2)
    # 0: clip(1.0) = 0.7, (0.7-2)^2 = 1.69 > (1-2)^2 = 1 -> the clipped term, 0.845.
    # 1: clip(0.0) = 0.3, 0.49 < 1 -> plain, 0.5.  2: clip = 0.7, 0.49 < 4 -> plain, 2.0.
    # 3: inside the range, both terms 0.16 -> 0.08, not counted as clipped.
    assert torch.allclose(out.loss, torch.tensor([[0.845, 0.5, 2.0, 0.08]]), atol=1e-6)
    assert out.clipped.tolist() == [[True, False, False, False]]
    out.loss.sum().backward()
    # The clipped term is flat in V: no gradient pushes a prediction further out of range.
    assert torch.allclose(values.grad, torch.tensor([[0.0, -1.0, 2.0, 0.4]]), atol=1e-6)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_critic_learns_and_warmup_freezes_the_actor(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = submit(run, "total_steps=6", "critic.warmup_steps=2", "checkpoint.keep_last=3", *CRITIC)
    assert out.returncode == 0, out.stderr[-3000:]
    m = _metrics(run)
    # Warm-up: only the critic updates in steps 1-2, both afterwards.
    assert [x["train/updates"] for x in m] == [0, 0, 2, 2, 2, 2]
    assert all(x["critic/updates"] == 2 for x in m)
    # The value model fits the dense reward: its error falls well below where it started.
    assert m[-1]["critic/mse"] < 0.5 * m[0]["critic/mse"], [x["critic/mse"] for x in m]
    gap = [abs(x["critic/values_mean"] - x["critic/returns_mean"]) for x in m]
    assert gap[-1] < 0.5 * gap[0], gap  # the values caught up with their targets

    t = trajectories(run).to_pylist()
    by_step = {s: [r for r in t if int(r["step"]) == s] for s in (1, 6)}
    for rows in by_step.values():
        for r in rows:
            assert len(r["values"]) == len(r["returns"]) == len(r["advantages"])
            assert len(r["values"]) == r["response_length"]
    mean_v = {
        s: statistics.fmean(v for r in rows for v in r["values"]) for s, rows in by_step.items()
    }
    assert abs(mean_v[6] - mean_v[1]) > 0.05, mean_v  # the values moved towards the returns
    adv = [a for r in by_step[6] for a in r["advantages"]]
    assert statistics.pstdev(adv) > 0.5  # whitened, not collapsed

    ckpt = run / "checkpoints"
    init = load_value_model(prepare_tiny(), "float32", head_seed(0)).state_dict()
    init = {f"critic.model.{k}": v for k, v in init.items()}
    trained = checkpoint_tensors(ckpt / "step=6", "critic.model.")
    assert weights_rel_diff(init, trained) > 1e-3
    head = "critic.model.value_head.weight"
    assert not torch.equal(init[head], trained[head])
    # The actor did not move during the warm-up: step 2's checkpoint holds its initial weights.
    actor0 = load_file(prepare_tiny() / "model.safetensors")
    actor2 = checkpoint_tensors(ckpt / "step=2", "engine.model.")
    assert all(torch.equal(actor0[k], actor2[f"engine.model.{k}"]) for k in actor0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_critic_one_and_two_ranks_agree(tmp_path: Path) -> None:
    """FSDP2 on 1 and 2 ranks: the same samples, values, returns and updates of both the
    actor and the critic (see test_distributed.py for the actor alone)."""
    args = (
        "train.backend=fsdp2",
        "total_steps=3",
        "data.prompts_per_step=8",
        "rollout.groups_per_call=2",
        *CRITIC,
    )
    runs = {}
    for world in (1, 2):
        runs[world] = tmp_path / f"w{world}"
        out = submit(runs[world], *args, extra=("--tasks-per-node", str(world)), timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
    a, b = trajectories(runs[1]), trajectories(runs[2])
    same = ["prompt_id", "sample_idx", "response_token_ids", "reward"]
    assert a.select(same).equals(b.select(same))
    assert set(b.column("rank").to_pylist()) == {0, 1}
    for col in ("values", "returns", "advantages"):
        x = torch.tensor([v for row in a.column(col).to_pylist() for v in row])
        y = torch.tensor([v for row in b.column(col).to_pylist() for v in row])
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), col
    for x, y in zip(_metrics(runs[1]), _metrics(runs[2]), strict=True):
        for key in ("critic/vf_loss", "critic/mse", "train/pg_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    for prefix in ("critic.model.", "engine.model."):
        wa = checkpoint_tensors(runs[1] / "checkpoints" / "step=3", prefix)
        wb = checkpoint_tensors(runs[2] / "checkpoints" / "step=3", prefix)
        assert weights_rel_diff(wa, wb) < 1e-5, prefix


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")
def test_critic_on_deepspeed_matches_single_device(tmp_path: Path) -> None:
    """The critic is an engine of the actor's backend: ZeRO-2 trains it as one device does."""
    runs = {b: tmp_path / b for b in ("single", "deepspeed")}
    for backend, run in runs.items():
        out = submit(run, "total_steps=3", f"train.backend={backend}", *CRITIC, timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
    for x, y in zip(_metrics(runs["single"]), _metrics(runs["deepspeed"]), strict=True):
        for key in ("critic/mse", "critic/values_mean", "critic/vf_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key
    wa = checkpoint_tensors(runs["single"] / "checkpoints" / "step=3", "critic.model.")
    wb = checkpoint_tensors(runs["deepspeed"] / "checkpoints" / "step=3", "critic.model.")
    assert weights_rel_diff(wa, wb) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_critic_reshards_from_two_ranks_to_one_on_resume(tmp_path: Path) -> None:
    """The critic's state is saved in shards under fsdp2, like the actor's. A run killed on
    2 ranks after step 3's train commit and resumed on 1 (replaying step 3 from the 2-rank
    checkpoint of step 2) ends with the critic of a run that switched from 2 ranks to 1 at
    that checkpoint without a kill, bitwise: weights and AdamW moments."""
    switched, killed = two_ranks_then_one(tmp_path, *CRITIC)
    key = "critic.model.model.layers.0.mlp.up_proj.weight"
    assert dcp_chunks(switched / "checkpoints" / "step=2", key) == 2
    a = checkpoint_tensors(switched / "checkpoints" / "step=4", "critic.")
    b = checkpoint_tensors(killed / "checkpoints" / "step=4", "critic.")
    assert any(k.startswith("critic.optim") for k in a), sorted(a)[:5]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_decaying_critic_lr_keeps_total_steps_on_resume(tmp_path: Path) -> None:
    """critic.lr_schedule spans total_steps as the actor's does. A run killed right after
    step 3's train commit (the 14th) and extended on resume would take other LRs from step 4
    on, yet its replay check passes: the one replayed update takes its LR from the restored
    optimizer. So the extension is refused (exit 2, one line, nothing committed changes);
    resumed as it was, the replay equals its commit and the run completes."""
    run = tmp_path / "run"
    env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": "13"}
    out = submit(run, "total_steps=3", "critic.lr_schedule=cosine", *CRITIC, env=env)
    assert out.returncode != 0
    step3 = run / "stages" / "step=3"
    assert (step3 / "train" / "MANIFEST.json").exists()
    assert not (step3 / "sync" / "MANIFEST.json").exists()
    before = committed_hash(run)

    res = submit(run, "total_steps=6", config=None)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    for needle in ("total_steps", "critic.lr_schedule=cosine", "3 -> 6"):
        assert needle in lines[0], (needle, lines[0])
    assert committed_hash(run) == before

    out = submit(run, "total_steps=3", config=None)
    assert out.returncode == 0, out.stderr[-3000:]
    replays = [e for e in events(run) if e["event"] == "replay"]
    # `identical` compares every update metric of the commit, the critic's LR among them.
    assert [(e["step"], e["identical"]) for e in replays] == [(3, True)]
    committed = json.loads((step3 / "train" / "MANIFEST.json").read_text())["metrics"]
    assert committed["critic/lr"] == _metrics(run)[2]["critic/lr"]
    assert len(_metrics(run)) == 3
