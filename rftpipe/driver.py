"""The step driver: rollout -> score -> advantage -> train -> sync, each stage durable.

A stage whose MANIFEST.json exists is read back, never recomputed; train steps after the
newest checkpoint are replayed from their committed advantage rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pyarrow as pa

from rftpipe import checkpoint
from rftpipe.data import SamplerState, global_window, rank_slice
from rftpipe.faults import events, fault
from rftpipe.runtime import Runtime
from rftpipe.stages import advantage, rollout, score, sync, train
from rftpipe.store import TRAJECTORY_SCHEMA_VERSION, Stage

log = logging.getLogger(__name__)


def run_step(rt: Runtime, step: int, timings: dict[str, float]) -> dict[str, float]:
    """One PPO step; returns the train metrics (committed or replayed)."""
    cfg, dist = rt.cfg, rt.dist
    before = sampler_state(rt, step)
    window = global_window(
        len(rt.prompts), cfg.seed, cfg.data.shuffle, before, cfg.data.prompts_per_step
    )
    mine = [rt.prompts.prompts[i] for i in rank_slice(window, dist.rank, dist.world)]
    ids = [rt.prompts.prompts[i].prompt_id for i in window]
    after = {
        "sampler": {
            "consumed_before": before.consumed,
            "consumed_after": before.consumed + len(window),
        },
        "prompt_ids": ids,
    }
    # 1. rollout: n samples per prompt with sampling logprobs
    rolled = durable(
        rt,
        step,
        "rollout",
        timings,
        after,
        lambda: rollout.run(
            cfg.rollout,
            rt.rollout_engine,
            rt.tokenizer,
            rollout.RolloutInputs(step=step, rank=dist.rank, run_seed=cfg.seed, prompts=mine),
        ),
    )
    # 2. score: one column per reward function
    scored = durable(
        rt, step, "score", timings, {}, lambda: score.run(cfg.reward, rt.rewards, rolled)
    )
    # 3. advantage: reference logprobs and per-token advantages
    kl_coef = float(rt.kl_ctrl.coef)
    adv = durable(
        rt,
        step,
        "advantage",
        timings,
        {"kl_coef": kl_coef},
        lambda: advantage.run(
            advantage.AdvantageStageConfig(advantage=cfg.advantage, kl=cfg.kl, kl_coef=kl_coef),
            scored,
            rt.ref_logprobs,
            dist.all_reduce_sum,
        ),
    )
    # 4. train: PPO epochs x mini-batches on the committed rows (replayed after a restart)
    metrics = train_step(rt, step, adv, ids, kl_coef, timings)
    # 5. sync: the rollout engine takes the new weights; the step's trajectories appear
    sync_step(rt, step, adv, timings)
    return metrics


def sampler_state(rt: Runtime, step: int) -> SamplerState:
    """Consumed-sample state before `step`, as committed by the previous rollout stage."""
    if step == 1:
        return SamplerState()
    return SamplerState(consumed=rt.run.manifest(step - 1, "rollout")["sampler"]["consumed_after"])


def durable(
    rt: Runtime,
    step: int,
    stage: Stage,
    timings: dict[str, float],
    extra: dict,
    compute: Callable[[], pa.Table],
) -> pa.Table:
    """Read a committed stage back, or compute, write and commit it."""
    if rt.run.is_committed(step, stage):
        return rt.run.read_stage(step, stage, rt.dist.rank)
    t0 = time.perf_counter()
    table = compute()
    t1 = time.perf_counter()
    meta = {"rftpipe.schema_version": TRAJECTORY_SCHEMA_VERSION, "rftpipe.stage": stage}
    rt.run.write_shard(step, stage, rt.dist.rank, table, meta)
    rt.dist.barrier()
    if rt.dist.is_main:
        rt.run.commit_stage(step, stage, rt.dist.world, {**extra, "seconds": t1 - t0})
    rt.dist.barrier()
    timings[stage] = t1 - t0
    timings["commit"] = timings.get("commit", 0.0) + time.perf_counter() - t1
    return table


def train_step(
    rt: Runtime, step: int, adv: pa.Table, ids: list[int], kl_coef: float, timings: dict[str, float]
) -> dict[str, float]:
    committed = rt.run.is_committed(step, "train")
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
    sync.run(rt.rollout_engine, rt.model, version=step)
    if rt.run.is_committed(step, "sync"):
        return
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
    timings["checkpoint"] = checkpoint.save(
        rt.run.checkpoints,
        step,
        rt.model,
        rt.train_engine.optimizer,
        extra,
        rt.dist,
        cfg.checkpoint.keep_last,
    )
