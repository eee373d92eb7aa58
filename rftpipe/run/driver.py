"""The step driver: rollout -> score -> advantage -> train -> sync (-> eval), each stage durable.

A stage whose MANIFEST.json exists is never run again; train steps after the newest
checkpoint are replayed from their committed advantage rows (`rftpipe.run.executor`).
With `rollout.staleness` k >= 1 a step also generates the rollouts of step s+k, which
sample from the weights it starts with (`rftpipe.run.staleness`), before its training or
beside it (`rftpipe.run.overlap`), or separate ranks generate them
(`rftpipe.run.placement`).
"""

from __future__ import annotations

import logging

import torch

from rftpipe.checkpoint import writer
from rftpipe.checkpoint.room import room_for
from rftpipe.run import handoff, overlap, staleness
from rftpipe.run.executor import execute
from rftpipe.stages import generation, round_stage, rounds
from rftpipe.stages.base import Runtime, Stage, StepPlan, StepState, no_rows
from rftpipe.stages.chain import EVAL, SYNC, TRAINING, generation_round

log = logging.getLogger(__name__)


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    state = StepState(rows=no_rows, timings=timings)
    later = staleness.generated_in(step, rt.cfg.rollout.staleness, rt.cfg.total_steps)
    if rt.handoff is not None:
        # Other ranks generate (launch.rollout_ranks): this step's is read once committed.
        timings["generation_wait"] = handoff.await_generation(rt, step)
        later = range(0)
    plan = generate(rt, step, state)
    # They sample from the weights this step starts with: generated before it trains them
    # away, or beside its training (rollout.overlap), always before its sync.
    with overlap.generating(rt, later, generate, timings) as engine_free:
        for stage in TRAINING:
            _execute(rt, plan, stage, state, engine_free)
    evaluate = (EVAL,) if rt.cfg.eval.due(step, rt.cfg.total_steps) else ()
    for stage in (SYNC, *evaluate):
        _execute(rt, plan, stage, state)
    return state.manifests["train"]["metrics"]


def generate(rt: Runtime, step: int, state: StepState) -> StepPlan:
    """The rollout and score stages, in rounds of fresh prompts while dynamic sampling still
    lacks groups whose scores vary (one round without it). Returns the plan of the groups
    the step trains on; `state.rows` then gives this rank's rows of them."""
    consumed = 0 if step == 1 else generation.consumed_after(rt.store, step - 1)
    plans: list[StepPlan] = []
    varied: list[list[int]] = []
    while not plans or rounds.another_round(rt, step, varied):
        plan = rounds.plan_round(rt, step, consumed)
        for stage in generation_round(len(plans)):
            _execute(rt, plan, stage, state)
        score = state.manifests[round_stage("score", len(plans))]
        varied.append(score.get(generation.VARIED, []))
        plans.append(plan)
        consumed = plan.sampler["consumed_after"]
    if not rt.cfg.rollout.dynamic_sampling.enabled:
        return plans[0]
    return rounds.kept_plan(rt, step, plans, varied, state)


def _execute(
    rt: Runtime, plan: StepPlan, stage: Stage, state: StepState, engine: bool = True
) -> None:
    """`execute`, with the rollout engine awake only for the stages that use it (`engine`
    False: left as it is, another thread generates with it)."""
    if stage.engine_awake:
        rt.rollout_engine.wake()
    elif engine:
        rt.rollout_engine.sleep()
    execute(rt, plan, stage, state)


def evaluate_initial(rt: Runtime, ckpt_step: int) -> None:
    """The evaluation of the initial weights (step 0), once, before step 1.

    Only from the initial weights (`ckpt_step` 0): a restart from a checkpoint holds later
    ones, and then step 0's evaluation committed long ago (or was not asked for).
    """
    if ckpt_step or not rt.cfg.eval.due(0, rt.cfg.total_steps):
        return
    plan = StepPlan(step=0, global_ids=[], mine=[], sampler={})
    _execute(rt, plan, EVAL, StepState(rows=no_rows, timings={}))


def stateful_parts(rt: Runtime) -> dict[str, writer.Stateful]:
    """Everything a checkpoint holds, by name (the trainer's own counters are the steps)."""
    parts: dict[str, writer.Stateful] = {
        "engine": rt.train_engine,
        "kl_controller": rt.kl_ctrl,
        "ckpt_schedule": rt.ckpt_schedule,
    }
    if rt.train_engine.ema is not None:
        parts["ema"] = rt.train_engine.ema  # `train.ema_decay`: DCP reshards it like the actor
    if rt.critic is not None:
        parts["critic"] = rt.critic
    return parts


def maybe_checkpoint(rt: Runtime, step: int, timings: dict[str, float]) -> None:
    """Start a background checkpoint after `step` if the schedule (or the last step) says so.

    `timings` holds the step's measured seconds, or nothing for a replayed step (which ran
    only its train stage and must not teach the schedule). The schedule's inputs are
    all-reduced (max), so every rank takes the same decision.
    """
    if "step" in timings:
        t = rt.dist.all_reduce_max(torch.tensor([timings["step"], timings.get("train", 0.0)]))
        rt.ckpt_schedule.record(step, float(t[0]), float(t[1]))
    if step != rt.cfg.total_steps and not rt.ckpt_schedule.due(step):
        return
    done = writer.list_committed(rt.run.checkpoints)
    if done and done[-1].step >= step:
        return
    waited = rt.ckpt_writer.wait()  # a pending write's files count against the room
    parts = stateful_parts(rt)
    skip = rt.cfg.checkpoint.on_no_space == "skip"
    if not room_for(rt.run.checkpoints, step, done, parts, rt.dist, skip):
        timings["checkpoint_skipped"] = 1.0
        return
    rt.ckpt_schedule.mark_checkpoint(step)
    timings["checkpoint"] = waited + rt.ckpt_writer.submit(
        rt.run.checkpoints, step, parts, rt.cfg.checkpoint.keep_last
    )
