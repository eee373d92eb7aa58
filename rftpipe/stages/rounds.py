"""Generation rounds: which prompts a step's round generates, whether the step generates
another round (DAPO's dynamic sampling, `rollout.dynamic_sampling`), and the plan of the
groups it finally trains on. The choice itself is `stages.generation`'s, from committed
manifests only, so a resumed step chooses the same on any world size.
"""

from __future__ import annotations

import logging
from functools import partial

from rftpipe.data.sampler import SamplerState, rank_slice
from rftpipe.errors import UserError
from rftpipe.stages import generation, round_stage
from rftpipe.stages.base import Runtime, StepPlan, StepState

log = logging.getLogger(__name__)


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


def another_round(rt: Runtime, step: int, varied: list[list[int]]) -> bool:
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


def kept_plan(
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
