"""The step driver: rollout -> score -> advantage -> train -> sync (-> eval), each stage durable.

A stage whose MANIFEST.json exists is never run again; train steps after the newest
checkpoint are replayed from their committed advantage rows (`rftpipe.executor`).
"""

from __future__ import annotations

import logging

import torch

from rftpipe import checkpoint
from rftpipe.data import SamplerState, rank_slice
from rftpipe.executor import StepPlan, StepState, execute, no_rows
from rftpipe.pipeline import EVAL, PIPELINE
from rftpipe.runtime import Runtime

log = logging.getLogger(__name__)


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    plan = plan_step(rt, step)
    state = StepState(rows=no_rows, timings=timings)
    evaluate = (EVAL,) if rt.cfg.eval.due(step, rt.cfg.total_steps) else ()
    for stage in (*PIPELINE, *evaluate):
        if stage.engine_awake:
            rt.rollout_engine.wake()
        else:
            rt.rollout_engine.sleep()
        execute(rt, plan, stage, state)
    return state.manifests["train"]["metrics"]


def evaluate_initial(rt: Runtime, ckpt_step: int) -> None:
    """The evaluation of the initial weights (step 0), once, before step 1.

    Only from the initial weights (`ckpt_step` 0): a restart from a checkpoint holds later
    ones, and then step 0's evaluation committed long ago (or was not asked for).
    """
    if ckpt_step or not rt.cfg.eval.due(0, rt.cfg.total_steps):
        return
    plan = StepPlan(step=0, global_ids=[], mine=[], sampler={})
    rt.rollout_engine.wake()
    execute(rt, plan, EVAL, StepState(rows=no_rows, timings={}))


def plan_step(rt: Runtime, step: int) -> StepPlan:
    """The step's prompts, from the consumed-sample state the previous rollout committed."""
    consumed = (
        0 if step == 1 else rt.store.manifest(step - 1, "rollout")["sampler"]["consumed_after"]
    )
    d = rt.cfg.data
    window = rt.prompts.window(
        rt.cfg.seed, d.shuffle, SamplerState(consumed=consumed), d.prompts_per_step
    )
    prompts = rt.prompts.prompts
    return StepPlan(
        step=step,
        global_ids=[prompts[i].prompt_id for i in window],
        mine=[
            prompts[i]
            for i in rank_slice(window, rt.dist.rank, rt.dist.world, rt.cfg.rollout.groups_per_call)
        ],
        sampler={"consumed_before": consumed, "consumed_after": consumed + len(window)},
    )


def stateful_parts(rt: Runtime) -> dict[str, checkpoint.Stateful]:
    """Everything a checkpoint holds, by name (the trainer's own counters are the steps)."""
    parts: dict[str, checkpoint.Stateful] = {
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
    done = checkpoint.list_committed(rt.run.checkpoints)
    if done and done[-1].step >= step:
        return
    rt.ckpt_schedule.mark_checkpoint(step)
    timings["checkpoint"] = rt.ckpt_writer.submit(
        rt.run.checkpoints, step, stateful_parts(rt), rt.cfg.checkpoint.keep_last
    )
