"""The five stages of a PPO step as durable executor stages, in pipeline order.

Each adapter only connects a stage module's one public `run` to the run's parts; what is
written, committed and read back is the executor's business (`rftpipe.run.executor`).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rftpipe.algos.names import ESTIMATOR_TRAITS
from rftpipe.config.schema import old_logprobs_source
from rftpipe.data.prompts import content_key, rank_slice
from rftpipe.errors import UserError
from rftpipe.faults import fault
from rftpipe.observe import perf
from rftpipe.observe.events import events
from rftpipe.run.executor import Rows, Stage, StageOutput, StepPlan
from rftpipe.run.runtime import Runtime
from rftpipe.stages import (
    GENERATION,
    ORDER,
    StageName,
    advantage,
    critic_train,
    evaluation,
    generation,
    rollout,
    round_stage,
    score,
    sync,
    train,
)
from rftpipe.storage.atomic import CorruptionError
from rftpipe.storage.baseline_rows import without_baseline

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _NoSideEffects:
    """A stage whose whole result is its committed rows: a committed one is only read."""

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        return None


@dataclass(frozen=True, slots=True)
class RolloutStage(_NoSideEffects):
    """1. n samples per prompt, grouped, with their sampling logprobs."""

    round: int = 0
    """The generation round (> 0 only under dynamic sampling); its samples are seeded from
    its own stage name, so a prompt met again in a later round samples afresh."""
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = True

    @property
    def name(self) -> str:
        return round_stage("rollout", self.round)

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        inp = rollout.RolloutInputs(
            step=plan.step,
            rank=rt.dist.rank,
            run_seed=rt.cfg.seed,
            prompts=plan.mine,
            baseline=ESTIMATOR_TRAITS[rt.cfg.advantage.estimator].needs_baseline_rollout,
            seed_stage=self.name,
        )
        table = rollout.run(rt.cfg.rollout, rt.rollout_engine, rt.tokenizer, inp)
        return StageOutput(
            rows=table, extra={"sampler": plan.sampler, "prompt_ids": plan.global_ids}
        )


@dataclass(frozen=True, slots=True)
class ScoreStage(_NoSideEffects):
    """2. One column per reward function and their weighted sum; under dynamic sampling,
    also which of the round's groups have scores that vary (in the manifest)."""

    round: int = 0
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = False

    @property
    def name(self) -> str:
        return round_stage("score", self.round)

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        table = score.run(rt.cfg.reward, rt.rewards, rows())
        ds = rt.cfg.rollout.dynamic_sampling
        if not ds.enabled:
            return StageOutput(rows=table)
        local = generation.varied_groups(table, generation.metric_column(ds.metric))
        # Each rank knows only its own groups: a flag per prompt of the round, summed.
        flags = rt.dist.all_reduce_sum(
            torch.tensor([float(p in local) for p in plan.global_ids], dtype=torch.float64)
        )
        varied = [p for p, f in zip(plan.global_ids, flags.tolist(), strict=True) if f > 0]
        extra = {
            generation.VARIED: varied,
            generation.TARGET: rt.cfg.data.prompts_per_step,
        }
        return StageOutput(rows=table, extra=extra)


@dataclass(frozen=True, slots=True)
class AdvantageStage(_NoSideEffects):
    """3. The actor's old logprobs (if `train.old_logprobs` resolves to `actor`), reference
    logprobs (if a KL term is on) and per-token advantages."""

    name: StageName = "advantage"
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = False

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        kl_coef = float(rt.kl_ctrl.coef)
        cfg = advantage.AdvantageStageConfig(
            advantage=rt.cfg.advantage, kl=rt.cfg.kl, kl_coef=kl_coef
        )
        ref = (
            None
            if rt.reference is None
            # Under the sampling temperature, as the rollout recorded its own logprobs.
            else partial(rt.reference.compute_logprobs, temperature=rt.cfg.rollout.temperature)
        )
        # The actor still holds the weights that sampled these rows (the step's train stage
        # has not run, and a restart replays every earlier one before this stage), and a
        # committed column is never recomputed, so the old policy is exact under replay too.
        actor = (
            partial(rt.train_engine.compute_logprobs, temperature=rt.cfg.rollout.temperature)
            if old_logprobs_source(rt.cfg.train, rt.cfg.rollout) == "actor"
            else None
        )
        table, metrics = advantage.run(
            cfg,
            rows(),
            ref,
            rt.dist.all_reduce_sum,
            actor_logprobs=actor,
            reduce_max=rt.dist.all_reduce_max,
            # The critic holds the weights of the step's train stages so far, as the actor.
            critic_values=None if rt.critic is None else rt.critic.compute_values,
        )
        return StageOutput(rows=table, extra={"kl_coef": kl_coef, "metrics": metrics})


@dataclass(frozen=True, slots=True)
class TrainStage:
    """4. PPO epochs x mini-batches on the committed rows; replayed after a restart until
    the weights catch up with the newest committed step."""

    name: StageName = "train"
    publish: bool = False
    replay_reads_rows: bool = True
    engine_awake: bool = False

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        return StageOutput(rows=None, extra={"metrics": self._train(rt, plan, rows)})

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        rt.stop.check(rt.dist, f"step {plan.step} train replay")
        fault("train_mid_replay")
        metrics = self._train(rt, plan, rows)
        same = _update_metrics(metrics) == _update_metrics(manifest["metrics"])
        events().write("replay", step=plan.step, identical=same)
        if not same:
            # Same inputs and seeds must give the same update; a difference means the
            # environment changed (thread count, library version), which the user must know.
            log.warning("replayed train step %d differs from its committed metrics", plan.step)

    def _train(self, rt: Runtime, plan: StepPlan, rows: Rows) -> dict[str, float]:
        # The previous step's checkpoint may still be reading the weights this stage updates,
        # or a restart still loading the optimizer state it needs.
        try:
            rt.ckpt_writer.wait()
        except CorruptionError as exc:
            _refuse_corrupt_late_load(rt, exc)
        # The controller's coefficient for this step is the one its advantage stage recorded.
        kl_coef = float(rt.store.manifest(plan.step, "advantage")["kl_coef"])
        n = rt.cfg.rollout.n
        inp = train.TrainInputs(
            step=plan.step,
            run_seed=rt.cfg.seed,
            # ReMax's greedy baseline rows only set the other rows' advantages.
            table=without_baseline(rows()),
            kl_coef=kl_coef,
            global_samples=[(p, k) for p in plan.global_ids for k in range(n)],
            temperature=rt.cfg.rollout.temperature,
            response_budget=rt.cfg.rollout.max_new_tokens,
            ptx=rt.ptx,
        )
        if not plan.global_ids:
            # Dynamic sampling kept no group (none varied): nothing to learn from this step.
            return {"train/kl": 0.0, "train/updates": 0.0}
        critic = {} if rt.critic is None else critic_train.run(rt.critic, rt.dist, inp)
        if rt.critic is not None and plan.step <= rt.critic.cfg.warmup_steps:
            # Critic warm-up: the actor waits (no update, no KL-controller input).
            return {"train/kl": 0.0, "train/updates": 0.0, **critic}
        metrics = train.run(rt.cfg.train, rt.cfg.kl, rt.train_engine, rt.dist, inp)
        rt.kl_ctrl.update(metrics["train/kl"], n_steps=len(plan.global_ids) * n)
        dtype = perf.compute_dtype(rt.cfg.train.param_dtype, rt.cfg.model.dtype)
        peak = perf.peak_tflops(rt.dist.device, dtype, rt.cfg.launch.peak_tflops)
        return {**metrics, **perf.mfu(metrics["perf/train_tflops"], peak, rt.dist.world), **critic}


def _update_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """What the update determines (timings, under perf/, are the machine's business)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


@dataclass(frozen=True, slots=True)
class SyncStage:
    """5. The rollout engine takes the new weights; the step's rows become its dataset."""

    name: StageName = "sync"
    publish: bool = True
    replay_reads_rows: bool = False
    engine_awake: bool = True

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        sync_weights(rt, plan.step)
        # `step` is the hive key of the dataset's directory: a column of the same name would
        # make pandas and pyarrow refuse to read it.
        return StageOutput(rows=rows().drop_columns(["step"]), extra={"weight_version": plan.step})

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        sync_weights(rt, plan.step)


def sync_weights(rt: Runtime, version: int) -> None:
    """The sync stage's work (also a restart's, for the weights it loaded). With
    `weight_sync=disk` the weights go through RUN/sync, transient: a replay writes it again."""
    via = rt.run.root / "sync" if rt.cfg.rollout.inference.weight_sync == "disk" else None
    sync.run(rt.rollout_engine, rt.train_engine, version, rt.dist, via)


def _refuse_corrupt_late_load(rt: Runtime, exc: CorruptionError) -> None:
    """The optimizer state that a restart loaded in the background is corrupt. The model
    weights it sampled this step's rows with were verified, so those rows stand; the
    checkpoint goes, and the next start falls back to the one before and replays."""
    ckpt = exc.path.parent
    events().write("corrupt_checkpoint", path=str(exc.path), deferred=True)
    if rt.dist.is_main and ckpt.parent == rt.run.checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
    raise UserError(
        f"checkpoint {ckpt} is corrupt ({exc.path.name}: {exc.why}) and was removed; "
        "start the run again to resume from the previous checkpoint"
    ) from exc


@dataclass(frozen=True, slots=True)
class EvalStage(_NoSideEffects):
    """After sync, when `eval.due(step)`: greedy and sampled completions of the held-out
    problems with the step's weights, scored (its rows are the evaluation's record)."""

    name: StageName = "eval"
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = True

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        assert rt.held_out is not None, "eval is due only with eval.size > 0"
        held = rt.held_out.prompts
        # Dealt in whole calls of the problems' order (see evaluation.run).
        mine = rank_slice(
            range(len(held)), rt.dist.rank, rt.dist.world, rt.cfg.eval.problems_per_call
        )
        inp = evaluation.EvalInputs(
            step=plan.step,
            rank=rt.dist.rank,
            run_seed=rt.cfg.seed,
            prompts=[held[i] for i in mine],
            eval=rt.cfg.eval,
            rollout=rt.cfg.rollout,
            reward=rt.cfg.reward,
        )
        table = evaluation.run(rt.rollout_engine, rt.tokenizer, rt.rewards, inp)
        train = {content_key(p) for p in rt.prompts.prompts}
        overlap = sum(content_key(p) in train for p in held)
        extra = {
            "problems": len(held),
            "overlap_with_train": overlap,
            "k": list(rt.cfg.eval.k) if rt.cfg.eval.samples else [],
        }
        return StageOutput(rows=table, extra=extra)


EVAL = EvalStage()
"""Not in PIPELINE: the driver runs it only on the steps `eval.due` names."""


def generation_round(r: int) -> tuple[Stage, ...]:
    """The stages of generation round `r` of a step (round 0: the pipeline's first two)."""
    return (RolloutStage(round=r), ScoreStage(round=r))


AFTER_GENERATION: tuple[Stage, ...] = (AdvantageStage(), TrainStage(), SyncStage())
"""The stages that run once per step, on the groups the generation rounds kept."""

PIPELINE: tuple[Stage, ...] = (*generation_round(0), *AFTER_GENERATION)
assert tuple(s.name for s in PIPELINE) == ORDER
assert tuple(s.name for s in generation_round(0)) == GENERATION
