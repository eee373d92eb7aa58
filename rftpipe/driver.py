"""The step driver: rollout -> score -> advantage -> train -> sync, each stage durable.

A stage whose MANIFEST.json exists is read back, never recomputed; train steps after the
newest checkpoint are replayed from their committed advantage rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pyarrow as pa

from rftpipe import checkpoint
from rftpipe.data import Prompt, SamplerState, global_window, rank_slice
from rftpipe.faults import events, fault, slow
from rftpipe.runtime import Runtime
from rftpipe.stages import advantage, rollout, score, sync, train
from rftpipe.store import TRAJECTORY_SCHEMA_VERSION, Stage

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """Which prompts a step uses: the global window and this rank's share of it."""

    step: int
    global_ids: list[int]
    mine: list[Prompt]
    sampler: dict[str, int]


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    cfg, dist = rt.cfg, rt.dist
    plan = plan_step(rt, step)
    stage = partial(durable, rt, plan, timings)
    # 1. rollout: n samples per prompt, grouped, with sampling logprobs
    rolled = stage(
        "rollout",
        {"sampler": plan.sampler, "prompt_ids": plan.global_ids},
        lambda: rollout.run(
            cfg.rollout,
            rt.rollout_engine,
            rt.tokenizer,
            rollout.RolloutInputs(step=step, rank=dist.rank, run_seed=cfg.seed, prompts=plan.mine),
        ),
    )
    # 2. score: one column per reward function
    scored = stage("score", {}, lambda: score.run(cfg.reward, rt.rewards, rolled))
    # 3. advantage: reference logprobs (if a KL term is on) and per-token advantages
    kl_coef = float(rt.kl_ctrl.coef)
    adv_cfg = advantage.AdvantageStageConfig(advantage=cfg.advantage, kl=cfg.kl, kl_coef=kl_coef)
    adv = stage(
        "advantage",
        {"kl_coef": kl_coef},
        lambda: advantage.run(adv_cfg, scored, reference_fn(rt), dist.all_reduce_sum),
    )
    # 4. train: PPO epochs x mini-batches on the committed rows (replayed after a restart)
    metrics = train_step(rt, plan, adv, kl_coef, timings)
    # 5. sync: the rollout engine takes the new weights; the step's trajectories appear
    sync_step(rt, step, adv, timings)
    return metrics


def reference_fn(rt: Runtime) -> advantage.RefLogprobs | None:
    """Reference logprobs under the sampling temperature, as the rollout recorded its own."""
    if rt.reference is None:
        return None
    return partial(rt.reference.compute_logprobs, temperature=rt.cfg.rollout.temperature)


def plan_step(rt: Runtime, step: int) -> StepPlan:
    """The step's prompts, from the consumed-sample state the previous rollout committed."""
    consumed = 0 if step == 1 else rt.run.manifest(step - 1, "rollout")["sampler"]["consumed_after"]
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


def durable(
    rt: Runtime,
    plan: StepPlan,
    timings: dict[str, float],
    stage: Stage,
    extra: dict,
    compute: Callable[[], pa.Table],
) -> pa.Table:
    """Read a committed stage back, or compute, write and commit it."""
    if rt.run.is_committed(plan.step, stage):
        mine = [p.prompt_id for p in plan.mine]
        return rt.run.read_stage_for(plan.step, stage, rt.dist.rank, rt.dist.world, mine)
    rt.stop.check(rt.dist, f"step {plan.step} {stage}")
    if stage == "rollout":
        # Marks the first new work of a (re)started process: tools.bench times resumes by it.
        events().write("rollout_begin", step=plan.step)
    t0 = time.perf_counter()
    table = compute()
    slow(stage)
    t1 = time.perf_counter()
    meta = {"rftpipe.schema_version": TRAJECTORY_SCHEMA_VERSION, "rftpipe.stage": stage}
    rt.run.write_shard(plan.step, stage, rt.dist.rank, table, meta)
    rt.dist.barrier()
    if rt.dist.is_main:
        rt.run.commit_stage(plan.step, stage, rt.dist.world, {**extra, "seconds": t1 - t0})
    rt.dist.barrier()
    timings[stage] = t1 - t0
    timings["commit"] = timings.get("commit", 0.0) + time.perf_counter() - t1
    return table


def train_step(
    rt: Runtime, plan: StepPlan, adv: pa.Table, kl_coef: float, timings: dict[str, float]
) -> dict[str, float]:
    step, ids = plan.step, plan.global_ids
    committed = rt.run.is_committed(step, "train")
    rt.stop.check(rt.dist, f"step {step} train")
    # The previous step's checkpoint may still be reading the weights this stage updates.
    timings["checkpoint_wait"] = rt.ckpt_writer.wait()
    t0 = time.perf_counter()
    inp = train.TrainInputs(
        step=step,
        run_seed=rt.cfg.seed,
        table=adv,
        kl_coef=kl_coef,
        global_samples=[(p, k) for p in ids for k in range(rt.cfg.rollout.n)],
        temperature=rt.cfg.rollout.temperature,
    )
    if committed:
        fault("train_mid_replay")
    metrics = train.run(rt.cfg.train, rt.cfg.kl, rt.train_engine, rt.dist, inp)
    rt.kl_ctrl.update(metrics["train/kl"], n_steps=len(ids) * rt.cfg.rollout.n)
    seconds = time.perf_counter() - t0
    if committed:
        _check_replay(rt, step, metrics, seconds)
        return metrics
    slow("train")
    t1 = time.perf_counter()
    if rt.dist.is_main:
        rt.run.commit_stage(step, "train", rt.dist.world, {"metrics": metrics, "seconds": seconds})
    rt.dist.barrier()
    timings["train"] = seconds
    timings["commit"] = timings.get("commit", 0.0) + time.perf_counter() - t1
    return metrics


def _check_replay(rt: Runtime, step: int, metrics: dict[str, float], seconds: float) -> None:
    committed = rt.run.manifest(step, "train")["metrics"]
    same = committed == metrics
    events().write("replay", step=step, seconds=round(seconds, 4), identical=same)
    if not same:
        # Same inputs and seeds must give the same update; a difference means the
        # environment changed (thread count, library version), which the user must know.
        log.warning("replayed train step %d differs from its committed metrics", step)


def sync_step(rt: Runtime, step: int, adv: pa.Table, timings: dict[str, float]) -> None:
    t0 = time.perf_counter()
    sync.run(rt.rollout_engine, rt.train_engine, version=step)
    if rt.run.is_committed(step, "sync"):
        return
    rt.stop.check(rt.dist, f"step {step} sync")
    t1 = time.perf_counter()
    meta = {"rftpipe.schema_version": TRAJECTORY_SCHEMA_VERSION, "rftpipe.step": str(step)}
    rt.run.stage_trajectories(step, rt.dist.rank, adv, meta)
    rt.dist.barrier()
    if rt.dist.is_main:
        rt.run.publish_trajectories(step, rt.dist.world)
        rt.run.commit_stage(step, "sync", rt.dist.world, {"weight_version": step})
    rt.dist.barrier()
    timings["sync"] = t1 - t0
    timings["commit"] = timings.get("commit", 0.0) + time.perf_counter() - t1


def maybe_checkpoint(rt: Runtime, step: int, timings: dict[str, float]) -> None:
    cfg = rt.cfg
    if step % cfg.checkpoint.interval and step != cfg.total_steps:
        return
    done = checkpoint.list_committed(rt.run.checkpoints)
    if done and done[-1].step >= step:
        return
    extra = {
        "step": step,
        "kl_controller": rt.kl_ctrl.state_dict(),
        "engine": rt.train_engine.state_dict(),
    }
    timings["checkpoint"] = rt.ckpt_writer.submit(
        rt.run.checkpoints, step, rt.train_engine, extra, cfg.checkpoint.keep_last
    )
