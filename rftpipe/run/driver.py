"""The step driver: rollout -> score -> advantage -> train -> sync (-> eval), each stage durable.

A stage whose MANIFEST.json exists is never run again; train steps after the newest
checkpoint are replayed from their committed advantage rows (`rftpipe.run.executor`).
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from rftpipe.checkpoint import writer
from rftpipe.data.sampler import SamplerState, rank_slice
from rftpipe.errors import UserError
from rftpipe.run.executor import Stage, StepPlan, StepState, execute, no_rows
from rftpipe.run.pipeline import AFTER_GENERATION, EVAL, generation_round
from rftpipe.run.runtime import Runtime
from rftpipe.stages import generation, round_stage

log = logging.getLogger(__name__)


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    state = StepState(rows=no_rows, timings=timings)
    plan = generate(rt, step, state)
    evaluate = (EVAL,) if rt.cfg.eval.due(step, rt.cfg.total_steps) else ()
    for stage in (*AFTER_GENERATION, *evaluate):
        _execute(rt, plan, stage, state)
    return state.manifests["train"]["metrics"]


def generate(rt: Runtime, step: int, state: StepState) -> StepPlan:
    """The rollout and score stages, in rounds of fresh prompts while dynamic sampling still
    lacks groups whose scores vary (one round without it). Returns the plan of the groups
    the step trains on; `state.rows` then gives this rank's rows of them."""
    consumed = 0 if step == 1 else generation.consumed_after(rt.store, step - 1)
    plans: list[StepPlan] = []
    varied: list[list[int]] = []
    while not plans or _another_round(rt, step, varied):
        plan = plan_round(rt, step, consumed)
        for stage in generation_round(len(plans)):
            _execute(rt, plan, stage, state)
        score = state.manifests[round_stage("score", len(plans))]
        varied.append(score.get(generation.VARIED, []))
        plans.append(plan)
        consumed = plan.sampler["consumed_after"]
    if not rt.cfg.rollout.dynamic_sampling.enabled:
        return plans[0]
    return _kept_plan(rt, step, plans, varied, state)


def _execute(rt: Runtime, plan: StepPlan, stage: Stage, state: StepState) -> None:
    """`execute`, with the rollout engine awake only for the stages that use it."""
    if stage.engine_awake:
        rt.rollout_engine.wake()
    else:
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


def deal(rt: Runtime) -> generation.Deal:
    """How a round's prompts are dealt to ranks: whole calls of `rollout.groups_per_call`
    in the round's global order, so every sample is the same on any world size."""
    return partial(rank_slice, unit=rt.cfg.rollout.groups_per_call)


def plan_round(rt: Runtime, step: int, consumed: int) -> StepPlan:
    """A generation round's prompts: the next ones after the consumed-sample state."""
    d = rt.cfg.data
    size = rt.cfg.rollout.dynamic_sampling.round_size(d.prompts_per_step)
    window = rt.prompts.window(rt.cfg.seed, d.shuffle, SamplerState(consumed=consumed), size)
    prompts = rt.prompts.prompts
    return StepPlan(
        step=step,
        global_ids=[prompts[i].prompt_id for i in window],
        mine=[prompts[i] for i in deal(rt)(window, rt.dist.rank, rt.dist.world)],
        sampler={"consumed_before": consumed, "consumed_after": consumed + len(window)},
    )


def _another_round(rt: Runtime, step: int, varied: list[list[int]]) -> bool:
    """Whether the step generates (or, committed, reads) round `len(varied)` too."""
    r = len(varied)
    if rt.store.is_committed(step, round_stage("rollout", r)):
        # Begun before a restart: finished and used, whatever the bounds say now.
        return True
    ds, target = rt.cfg.rollout.dynamic_sampling, rt.cfg.data.prompts_per_step
    if not ds.enabled or generation.filled(varied, target):
        return False
    if rt.store.is_committed(step, "advantage"):
        return False  # trained on what its committed rounds found, short or not
    if r < ds.max_rounds:
        return True
    found = sum(len(v) for v in generation.select(varied, target))
    what = (
        f"step {step}: {r} rounds of {ds.round_size(target)} prompts found {found} of the "
        f"{target} groups whose {ds.metric} varies"
    )
    if ds.on_shortfall == "fail":
        raise UserError(
            f"rollout.dynamic_sampling: {what} (on_shortfall=fail); the rounds stay "
            "committed: resume with a larger max_rounds, or on_shortfall=train"
        )
    log.warning("rollout.dynamic_sampling: %s; training on those", what)
    return False


def _kept_plan(
    rt: Runtime, step: int, plans: list[StepPlan], varied: list[list[int]], state: StepState
) -> StepPlan:
    """The plan of the groups a dynamically sampled step trains on: the first varied ones
    in round order, dealt to ranks afresh (a group's rows may come from another rank)."""
    kept = generation.select(varied, rt.cfg.data.prompts_per_step)
    order = [p for ids in kept for p in ids]
    mine = [order[i] for i in rank_slice(range(len(order)), rt.dist.rank, rt.dist.world)]
    state.rows = generation.kept_rows(rt.store, step, kept, mine, deal(rt))
    wanted = set(mine)
    by_id = {p.prompt_id: p for p in rt.prompts.prompts if p.prompt_id in wanted}
    return StepPlan(
        step=step,
        global_ids=order,
        mine=[by_id[p] for p in mine],
        sampler={
            "consumed_before": plans[0].sampler["consumed_before"],
            "consumed_after": plans[-1].sampler["consumed_after"],
        },
    )


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
    rt.ckpt_schedule.mark_checkpoint(step)
    timings["checkpoint"] = rt.ckpt_writer.submit(
        rt.run.checkpoints, step, stateful_parts(rt), rt.cfg.checkpoint.keep_last
    )
