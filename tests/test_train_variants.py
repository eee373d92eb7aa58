"""Every policy-loss variant, the Dr. GRPO aggregation and the high-entropy token mask
through the real train stage on the tiny model."""

from __future__ import annotations

import dataclasses
import math

import pyarrow as pa
import pytest
import torch

from rftpipe.algos.losses import POLICY_LOSSES, entropy_top_mask
from rftpipe.algos.variants import ClipCovSettings, KLCovSettings
from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train.single import SingleDeviceEngine
from rftpipe.stages import batching, train
from rftpipe.stages.batching import pad_ragged

LENGTHS = ((5, 2, 7, 3), (4, 6, 1, 3))


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    """2 prompts x 4 responses of 1-7 tokens, in group order."""
    gen = torch.Generator().manual_seed(11)
    prompts, responses = [], []
    for lengths in LENGTHS:
        prompt = torch.randint(5, 200, (6,), generator=gen).tolist()
        for n in lengths:
            prompts.append(prompt)
            responses.append(torch.randint(5, 200, (n,), generator=gen).tolist())
    return prompts, responses


def _engine(cfg: TrainConfig) -> SingleDeviceEngine:
    return SingleDeviceEngine(load_causal_lm(prepare_tiny(), "float32"), cfg, Dist())


@pytest.fixture(scope="module")
def table() -> pa.Table:
    """Advantage rows: behaviour logprobs a little off the initial model's (ratios move off
    1) and advantages of both signs, varying along each response."""
    prompts, responses = _rows()
    logprobs = _engine(TrainConfig()).compute_logprobs(prompts, responses, 1.0)
    gen = torch.Generator().manual_seed(12)
    old = [[x + 0.3 * float(torch.randn((), generator=gen)) for x in lp] for lp in logprobs]
    adv = [[float(torch.randn((), generator=gen)) for _ in r] for r in responses]
    return pa.table(
        {
            "prompt_id": [i // 4 for i in range(len(prompts))],
            "sample_idx": [i % 4 for i in range(len(prompts))],
            "prompt_token_ids": prompts,
            "response_token_ids": responses,
            "logprobs": pa.array(old, pa.list_(pa.float32())),
            "advantages": pa.array(adv, pa.list_(pa.float32())),
            "response_length": [len(r) for r in responses],
        }
    )


def _inputs(table: pa.Table, budget: int = 0) -> batching.TrainInputs:
    """Step 1's train inputs: every row of `table` on one rank."""
    return batching.TrainInputs(
        step=1,
        run_seed=0,
        table=table,
        global_samples=[(r["prompt_id"], r["sample_idx"]) for r in table.to_pylist()],
        kl_coef=0.0,
        temperature=1.0,
        response_budget=budget,
    )


def _train(
    cfg: TrainConfig, table: pa.Table, budget: int = 0
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    engine = _engine(cfg)
    metrics = train.run(cfg, KLConfig(), engine, Dist(), _inputs(table, budget))
    weights = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return metrics, weights


def _moved(weights: dict[str, torch.Tensor]) -> float:
    initial = load_causal_lm(prepare_tiny(), "float32").state_dict()
    return sum(float((weights[k] - initial[k]).abs().sum()) for k in initial)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_trains(name: str, table: pa.Table) -> None:
    entry = POLICY_LOSSES[name]
    agg = "seq-mean-token-mean" if entry.traits.sequence_level else "token-mean"
    # Covariance shares large enough that the tiny batch has a token to cut / penalise.
    special = {
        "clip_cov": ClipCovSettings(ratio=0.2, lb=-10.0),
        "kl_cov": KLCovSettings(ratio=0.2),
    }
    cfg = TrainConfig(
        lr=1e-3,
        mini_batches=2,
        micro_batch_size=4,
        policy_loss=special.get(name, entry.settings()),
        loss_agg=agg,  # type: ignore[arg-type]
    )
    metrics, weights = _train(cfg, table)
    assert metrics["train/skipped_micro_batches"] == 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["train/tokens"] == sum(sum(x) for x in LENGTHS)
    assert _moved(weights) > 0


@pytest.mark.kernels
def test_entropy_mask_trains_only_the_top_tokens(table: pa.Table) -> None:
    """`entropy_mask_top=0.5` updates the weights exactly as zeroing the advantages of the
    other half of the tokens does. One micro-batch of all rows, so the ranking is over the
    batch; `seq-mean-token-sum` divides by sequences, which the mask does not change."""
    base = TrainConfig(lr=1e-3, micro_batch_size=8, loss_agg="seq-mean-token-sum")
    rows = table.to_pylist()
    _, ent = _engine(base).forward(
        [r["prompt_token_ids"] for r in rows],
        [r["response_token_ids"] for r in rows],
        1.0,
        with_entropy=True,
    )
    _, mask = pad_ragged([r["logprobs"] for r in rows], torch.float32)
    kept = entropy_top_mask(ent.detach(), mask, 0.5)
    assert int(kept.sum()) == math.ceil(0.5 * int(mask.sum()))
    zeroed = [
        [a if k else 0.0 for a, k in zip(r["advantages"], row, strict=False)]
        for r, row in zip(rows, kept.tolist(), strict=True)
    ]
    manual = table.set_column(
        table.schema.get_field_index("advantages"),
        "advantages",
        pa.array(zeroed, pa.list_(pa.float32())),
    )
    _, w_masked = _train(dataclasses.replace(base, entropy_mask_top=0.5), table)
    _, w_manual = _train(base, manual)
    _, w_full = _train(base, table)
    for k in w_masked:
        torch.testing.assert_close(w_masked[k], w_manual[k], rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(w_masked[k], w_full[k]) for k in w_masked)


@pytest.mark.kernels
def test_dr_grpo_norm_divides_by_the_response_budget(table: pa.Table) -> None:
    """`seq-mean-token-sum-norm` (verl's agg_loss): the responses' token sums added up over
    rollout.max_new_tokens, not divided by the number of responses. Doubling the budget
    halves the loss; with a budget of 16, the sum over the 8 responses is
    `seq-mean-token-sum` (their mean) x 8 / 16."""
    cfg = TrainConfig(lr=1e-3, micro_batch_size=8, loss_agg="seq-mean-token-sum-norm")
    at_8, _ = _train(cfg, table, budget=8)
    at_16, _ = _train(cfg, table, budget=16)
    summed, _ = _train(dataclasses.replace(cfg, loss_agg="seq-mean-token-sum"), table)
    assert math.isclose(at_8["train/pg_loss"], 2 * at_16["train/pg_loss"], rel_tol=1e-6)
    assert math.isclose(at_16["train/pg_loss"], summed["train/pg_loss"] * 8 / 16, rel_tol=1e-6)


@pytest.mark.kernels
def test_critic_seq_mean_token_sum_norm_divides_by_the_response_budget(table: pa.Table) -> None:
    """The critic's Dr. GRPO loss uses the same constant length as the actor's
    (`rollout.max_new_tokens`), not each micro-batch's padded width, so the value loss is the
    same whatever the micro-batching (it was 7/1 = 7x larger for a 1-token micro-batch)."""
    from rftpipe.config.schema import CriticConfig
    from rftpipe.engines.train.critic import (
        Critic,
        critic_train_config,
        head_seed,
        load_value_model,
    )
    from rftpipe.stages import critic_train

    rows = table.to_pylist()
    n = len(rows)
    values = [[0.1 * (i % 3)] * r["response_length"] for i, r in enumerate(rows)]
    returns = [[1.0] * r["response_length"] for r in rows]
    t = table.append_column("values", pa.array(values, pa.list_(pa.float32())))
    t = t.append_column("returns", pa.array(returns, pa.list_(pa.float32())))
    inp = _inputs(t, budget=8)
    losses = []
    for micro in (1, n):
        train_cfg = critic_train_config(
            TrainConfig(loss_agg="seq-mean-token-sum-norm", micro_batch_size=micro),
            CriticConfig(),
        )
        model = load_value_model(prepare_tiny(), "float32", head_seed(0))
        engine = SingleDeviceEngine(model, train_cfg, Dist())
        critic = Critic(engine=engine, cfg=CriticConfig(), train_cfg=train_cfg, dist=Dist())
        losses.append(critic_train.run(critic, Dist(), inp)["critic/vf_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
