"""The step driver: rollout -> score -> advantage -> train -> sync, each stage durable.

A stage whose MANIFEST.json exists is never run again; train steps after the newest
checkpoint are replayed from their committed advantage rows (`rftpipe.executor`).
"""

from __future__ import annotations

import logging

from rftpipe import checkpoint
from rftpipe.data import SamplerState, global_window, rank_slice
from rftpipe.executor import StepPlan, StepState, execute, no_rows
from rftpipe.pipeline import PIPELINE
from rftpipe.runtime import Runtime

log = logging.getLogger(__name__)


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    plan = plan_step(rt, step)
    state = StepState(rows=no_rows, timings=timings)
    for stage in PIPELINE:
        execute(rt, plan, stage, state)
    return state.manifests["train"]["metrics"]


def plan_step(rt: Runtime, step: int) -> StepPlan:
    """The step's prompts, from the consumed-sample state the previous rollout committed."""
    consumed = (
        0 if step == 1 else rt.store.manifest(step - 1, "rollout")["sampler"]["consumed_after"]
    )
    d = rt.cfg.data
    window = global_window(
        len(rt.prompts), rt.cfg.seed, d.shuffle, SamplerState(consumed=consumed), d.prompts_per_step
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


def maybe_checkpoint(rt: Runtime, step: int, timings: dict[str, float]) -> None:
    """Start a background checkpoint after `step` if one is due and not already there."""
    cfg = rt.cfg
    if step % cfg.checkpoint.interval and step != cfg.total_steps:
        return
    done = checkpoint.list_committed(rt.run.checkpoints)
    if done and done[-1].step >= step:
        return
    parts = {"engine": rt.train_engine, "kl_controller": rt.kl_ctrl}
    timings["checkpoint"] = rt.ckpt_writer.submit(
        rt.run.checkpoints, step, parts, cfg.checkpoint.keep_last
    )
