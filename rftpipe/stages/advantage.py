"""Stage 3, advantage: the actor's old logprobs (`train.old_logprobs=actor`), reference
logprobs (when a KL term is on) and per-token advantages."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import pyarrow as pa
import torch

from rftpipe.algos.advantage import (
    AdvantageInputs,
    Reducer,
    compute_advantages,
    compute_episode_advantages,
    gae_returns,
)
from rftpipe.algos.losses import kl_estimate
from rftpipe.config.schema import (
    AdvantageConfig,
    KLConfig,
    old_logprobs_source,
    skips_alike_groups,
)
from rftpipe.stages import StageName
from rftpipe.stages.base import NoSideEffects, Rows, Runtime, StageOutput, StepPlan
from rftpipe.stages.batching import alike_groups, model_token_mask, pad_ragged, turn_tokens
from rftpipe.stages.images import RowImages, image_rows
from rftpipe.stages.routes import committed_column, with_routes
from rftpipe.storage.baseline_rows import baseline_flags
from rftpipe.storage.branch_rows import has_branches, last_rows
from rftpipe.storage.routes import ACTOR_ROUTES, ROUTES

T = TypeVar("T")

RefLogprobs = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[list[float]]]
"""Response logprobs of (prompts, responses) under some model: the reference, or the actor."""

CriticValues = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[list[float]]]
"""The critic's per-token values V(s_t) of (prompts, responses), no grad."""


def unpad(t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(t, mask, strict=True)]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageStageConfig:
    advantage: AdvantageConfig
    kl: KLConfig
    kl_coef: float
    """The controller's coefficient for this step (recorded in the manifest)."""


@dataclass(frozen=True, slots=True)
class _Batch:
    """What every step of `run` reads of the scored rows, read once."""

    prompts: list[list[int]]
    responses: list[list[int]]
    padded: torch.Tensor
    """(B, T) bool: every response token (the layout every column is cut back to)."""
    losses: list[list[int]]
    """Multi-turn rows' `loss_mask` (empty without the column)."""
    mask: torch.Tensor
    """(B, T) bool: the tokens the model sampled."""
    is_baseline: torch.Tensor
    """(B,) bool: ReMax's greedy rows."""

    @classmethod
    def of(cls, scored: pa.Table) -> _Batch:
        prompts = scored.column("prompt_token_ids").to_pylist()
        responses = scored.column("response_token_ids").to_pylist()
        _, padded = pad_ragged(scored.column("logprobs").to_pylist(), torch.float64)
        # Multi-turn rows: the environment's tokens get no advantage, KL penalty or value
        # target (they are cut back to full length with `padded`).
        losses = (
            scored.column("loss_mask").to_pylist() if "loss_mask" in scored.column_names else []
        )
        mask = model_token_mask(losses or [None] * len(prompts), padded)
        # ReMax's greedy rows (`is_baseline`) are scored but never trained on.
        is_baseline = torch.tensor(baseline_flags(scored), dtype=torch.bool)
        return cls(prompts, responses, padded, losses, mask, is_baseline)


def run(
    cfg: AdvantageStageConfig,
    scored: pa.Table,
    ref_logprobs: RefLogprobs | None,
    reduce_sum: Reducer,
    *,
    actor_logprobs: RefLogprobs | None = None,
    reduce_max: Reducer | None = None,
    critic_values: CriticValues | None = None,
    skip: frozenset[int] = frozenset(),
) -> tuple[pa.Table, dict[str, float]]:
    """This rank's rows with `advantages` (and `old_logprobs`, `ref_logprobs`, `values`,
    `returns`) appended, and the stage's metrics (global over ranks).

    With `critic_values`, the critic's values become column `values` and the GAE returns
    (with the gamma and lam of `advantage.estimator`) column `returns`: the critic's old
    predictions and targets in the train stage, never recomputed once committed.

    With `actor_logprobs` (the actor's weights are still those that sampled the rows), its
    logprobs become column `old_logprobs`: PPO's old policy in the train stage and the
    policy side of the `kl.mode=reward` penalty. `reduce_max` is then needed too.

    `skip`: rows the train stage will skip (`batching.alike_groups`, under
    `train.skip_zero_advantage=auto`), whose old logprobs nothing reads: the actor's pass
    leaves them out, their `old_logprobs` are their sampling logprobs, and the
    logprob-difference metrics are over the other rows.
    """
    batch = _Batch.of(scored)
    out = scored
    metrics: dict[str, float] = {}
    old_column = "logprobs"
    if actor_logprobs is not None:
        assert reduce_max is not None, "the logprob-difference metrics need reduce_max"
        old = _skipping(actor_logprobs, skip, scored.column("logprobs").to_pylist())
        out = _append_floats(out, "old_logprobs", old(batch.prompts, batch.responses))
        old_column = "old_logprobs"
        # The greedy rows recorded no sampling logprobs: nothing to compare.
        skipped = torch.tensor([i in skip for i in range(len(batch.prompts))], dtype=torch.bool)
        diff_mask = batch.mask & ~(batch.is_baseline | skipped)[:, None]
        metrics = _logprob_diff_metrics(out, diff_mask, reduce_sum, reduce_max)
        counts = [float(skipped.sum()), float((batch.padded & skipped[:, None]).sum())]
        total = reduce_sum(torch.tensor(counts, dtype=torch.float64))
        metrics["advantage/old_logprob_skipped_rows"] = float(total[0])
        metrics["advantage/old_logprob_skipped_tokens"] = float(total[1])
    penalty = None
    if cfg.kl.mode != "none":
        assert ref_logprobs is not None, "a KL term needs the reference model"
        out = _append_floats(out, "ref_logprobs", ref_logprobs(batch.prompts, batch.responses))
        if cfg.kl.mode == "reward":
            penalty = _kl_penalty(cfg, out, old_column, batch.mask)
    values = None
    if critic_values is not None:
        out = _append_floats(out, "values", critic_values(batch.prompts, batch.responses))
        # Read back through float32, exactly as the train stage will see the column.
        values = _read_back(out, "values")
    inputs = _advantage_inputs(scored, out, old_column, batch, penalty, values)
    adv = _advantages(cfg, scored, inputs, reduce_sum)
    table = _append_floats(out, "advantages", unpad(adv, batch.padded))
    if values is not None:
        returns = gae_returns(inputs, cfg.advantage.estimator)
        table = _append_floats(table, "returns", unpad(returns, batch.padded))
        metrics = {**metrics, **_value_metrics(values, returns, batch.mask, reduce_sum)}
    return table, metrics


def _skipping(fn: RefLogprobs, skip: frozenset[int], fill: list[list[float]]) -> RefLogprobs:
    """`fn` over the rows not in `skip`; a skipped row gets its row of `fill`."""
    if not skip:
        return fn

    def run(
        prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        keep = [i for i in range(len(prompts)) if i not in skip]
        got = iter(fn([prompts[i] for i in keep], [responses[i] for i in keep]))
        return [list(fill[i]) if i in skip else next(got) for i in range(len(prompts))]

    return run


def _append_floats(table: pa.Table, name: str, rows: list[list[float]]) -> pa.Table:
    """`table` with the per-token column `name` of `rows`, committed as float32."""
    return table.append_column(
        pa.field(name, pa.list_(pa.float32())), pa.array(rows, pa.list_(pa.float32()))
    )


def _read_back(table: pa.Table, name: str) -> torch.Tensor:
    """The per-token column `name` of `table`, right-padded to (B, T) in float64."""
    tensor, _ = pad_ragged(table.column(name).to_pylist(), torch.float64)
    return tensor


def _kl_penalty(
    cfg: AdvantageStageConfig, table: pa.Table, old_column: str, mask: torch.Tensor
) -> torch.Tensor:
    """`kl.mode=reward`'s per-token penalty, the controller's coefficient times the KL
    estimate of the old policy (`old_column`) from the reference, 0 off `mask`."""
    # Read back through float32, exactly as the train stage will see these columns.
    ref_t = _read_back(table, "ref_logprobs")
    old32 = _read_back(table, old_column)
    return cfg.kl_coef * kl_estimate(old32, ref_t, cfg.kl.estimator) * mask


def _advantage_inputs(
    scored: pa.Table,
    out: pa.Table,
    old_column: str,
    batch: _Batch,
    penalty: torch.Tensor | None,
    values: torch.Tensor | None,
) -> AdvantageInputs:
    """The estimators' batch: the rows' rewards, groups and masks, multi-turn rows' turns,
    with the behaviour logprobs as `out` commits them (`old_column`)."""
    turn_rewards = turn_starts = None
    if batch.losses:
        # Token-level estimators credit each turn's environment reward where it was paid,
        # and the discounting ones discount per turn from where each turn starts.
        turn_rewards, turn_starts = turn_tokens(
            scored.column("turn_offsets").to_pylist(),
            scored.column("turn_rewards").to_pylist(),
            batch.losses,
            (batch.padded.shape[0], batch.padded.shape[1]),
        )
    group = torch.tensor(scored.column("prompt_id").to_pylist(), dtype=torch.int64)
    # The behaviour policy's logprobs, as committed: the optimal token baseline reads them.
    behaviour = _read_back(out, old_column)
    return AdvantageInputs(
        rewards=torch.tensor(scored.column("reward").to_pylist(), dtype=torch.float64),
        group_index=group,
        response_mask=batch.mask,
        token_kl_penalty=penalty,
        logprobs=behaviour,
        is_baseline=batch.is_baseline,
        values=values,
        turn_rewards=turn_rewards,
        turn_starts=turn_starts,
    )


def _advantages(
    cfg: AdvantageStageConfig, scored: pa.Table, inputs: AdvantageInputs, reduce_sum: Reducer
) -> torch.Tensor:
    """(B, T) per-token advantages of `advantage.estimator`, per episode for agent rows."""
    if has_branches(scored):
        # An agent episode of several sequences: one advantage per episode, on all of them.
        return compute_episode_advantages(
            cfg.advantage.estimator,
            inputs,
            torch.tensor(last_rows(scored), dtype=torch.int64),
            reduce_sum=reduce_sum,
        )
    return compute_advantages(cfg.advantage.estimator, inputs, reduce_sum=reduce_sum)


def _value_metrics(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce_sum: Reducer
) -> dict[str, float]:
    """The critic's values and targets over every response token of all ranks, and the
    share of the returns' variance its values explain (1: perfect, <= 0: no better than
    their mean)."""
    v, r = torch.where(mask, values, 0.0), torch.where(mask, returns, 0.0)
    err = r - v
    s = reduce_sum(
        torch.stack(
            [mask.sum().double(), v.sum(), r.sum(), r.square().sum(), err.sum(), err.square().sum()]
        )
    )
    n = max(float(s[0]), 1.0)
    var_r = float(s[3]) / n - (float(s[2]) / n) ** 2
    var_err = float(s[5]) / n - (float(s[4]) / n) ** 2
    return {
        "critic/values_mean": float(s[1]) / n,
        "critic/returns_mean": float(s[2]) / n,
        "critic/explained_var": 1.0 - var_err / var_r if var_r > 0 else 0.0,
    }


def _logprob_diff_metrics(
    table: pa.Table, mask: torch.Tensor, reduce_sum: Reducer, reduce_max: Reducer
) -> dict[str, float]:
    """Mean and max over every response token of all ranks of |old_logprobs - logprobs|,
    as committed (float32): how far the rollout engine's numbers are from the trainer's;
    the k3 estimate of KL(rollout || trainer) on the sampled tokens, (r - 1) - log r with
    r = p_trainer / p_rollout; and the share of tokens whose probabilities differ by more
    than a factor 2 (|delta logprob| > ln 2), the mismatch routing replay removes on MoE."""
    old, _ = pad_ragged(table.column("old_logprobs").to_pylist(), torch.float64)
    rollout, _ = pad_ragged(table.column("logprobs").to_pylist(), torch.float64)
    delta = torch.where(mask, old - rollout, 0.0)
    diff = delta.abs()
    k3 = torch.where(mask, torch.expm1(delta) - delta, 0.0)
    far = (diff > math.log(2.0)) & mask
    local = [float(diff.sum()), float(mask.sum()), float(k3.sum()), float(far.sum())]
    sums = reduce_sum(torch.tensor(local, dtype=torch.float64))
    local_max = float(diff.max()) if diff.numel() else 0.0  # a rank may hold no rows
    top = reduce_max(torch.tensor([local_max], dtype=torch.float64))
    tokens = max(float(sums[1]), 1.0)
    return {
        "rollout/logprob_abs_diff_mean": float(sums[0]) / tokens,
        "rollout/logprob_abs_diff_max": float(top[0]),
        "rollout/k3_kl": float(sums[2]) / tokens,
        "rollout/logprob_diff_over_ln2_frac": float(sums[3]) / tokens,
    }


@dataclass(frozen=True, slots=True)
class AdvantageStage(NoSideEffects):
    """3. The actor's old logprobs (if `train.old_logprobs` resolves to `actor`), reference
    logprobs (if a KL term is on) and per-token advantages."""

    name: StageName = "advantage"
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = False

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        kl_coef = float(rt.kl_ctrl.coef)
        cfg = AdvantageStageConfig(advantage=rt.cfg.advantage, kl=rt.cfg.kl, kl_coef=kl_coef)
        scored = rows()
        # A vision-language policy's rows: the reference and the actor see their images.
        vision = RowImages(rt.vision, rt.run.root).of(image_rows(scored))
        routes, recorded = _replayed_routes(rt, plan.step, scored)
        ref = (
            None
            if rt.reference is None
            # Under the sampling temperature, as the rollout recorded its own logprobs.
            else partial(
                rt.reference.compute_logprobs,
                temperature=rt.cfg.rollout.temperature,
                vision=vision,
                # The policy's routes mean something to the initial policy only.
                routes=routes if rt.cfg.model.reference is None else None,
            )
        )
        # The actor still holds the weights that sampled these rows (the step's train stage
        # has not run, and a restart replays every earlier one before this stage), and a
        # committed column is never recomputed, so the old policy is exact under replay too.
        from_actor = old_logprobs_source(rt.cfg.train, rt.cfg.rollout) == "actor"
        # Rows the train stage skips need no old policy; under R2 this forward records
        # every row's routes, so it skips none.
        skip = (
            alike_groups(scored)
            if from_actor and recorded is None and skips_alike_groups(rt.cfg)
            else frozenset()
        )
        keep = [i for i in range(scored.num_rows) if i not in skip]
        actor = (
            partial(
                rt.train_engine.compute_logprobs,
                temperature=rt.cfg.rollout.temperature,
                vision=_only(vision, keep),
                routes=None if recorded is not None else _only(routes, keep),
                record=recorded,
            )
            if from_actor
            else None
        )
        table, metrics = run(
            cfg,
            scored,
            ref,
            rt.dist.all_reduce_sum,
            actor_logprobs=actor,
            reduce_max=rt.dist.all_reduce_max,
            # The critic holds the weights of the step's train stages so far, as the actor.
            critic_values=None
            if rt.critic is None
            else partial(rt.critic.compute_values, vision=vision),
            skip=skip,
        )
        extra: dict[str, object] = {"kl_coef": kl_coef, "metrics": metrics}
        if recorded is not None and rt.route_shape is not None:
            table = with_routes(table, ACTOR_ROUTES, recorded)
            extra["routes"] = rt.route_shape.to_meta()
        return StageOutput(rows=table, extra=extra)


def _only(rows: Sequence[T] | None, keep: list[int]) -> list[T] | None:
    """The rows `keep` of a per-row list (None stays None)."""
    return None if rows is None else [rows[i] for i in keep]


def _replayed_routes(
    rt: Runtime, step: int, scored: pa.Table
) -> tuple[list[torch.Tensor | None] | None, list[torch.Tensor] | None]:
    """(the routes this stage's forwards replay, the list R2's old-logprob forward records
    into). R3: the rollout's, read back; R2: the actor's own selection, recorded by its
    forward (which runs first) and then replayed by the reference's, the same list."""
    if rt.route_shape is None or rt.replay == "none":
        return None, None
    if rt.replay == "r3":
        return committed_column(rt, step, ROUTES).table(scored), None
    recorded: list[torch.Tensor] = []
    return recorded, recorded  # type: ignore[return-value]
