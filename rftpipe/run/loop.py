"""The run: resume, then steps until `total_steps`, logging each step after it commits."""

from __future__ import annotations

import logging
import math
import sys
import time
from functools import partial
from typing import Any

from rftpipe.config.loader import to_dict
from rftpipe.config.schema import RunConfig
from rftpipe.dist import Dist
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import slow
from rftpipe.observe import memory
from rftpipe.observe.trackers import (
    JsonlTracker,
    NullTracker,
    TensorBoardTracker,
    Trackers,
    WandbTracker,
    wandb_mode,
)
from rftpipe.run import export, handoff, resume, roles, runtime
from rftpipe.run.driver import evaluate_initial, maybe_checkpoint, run_step
from rftpipe.run.metrics import step_metrics, write_summary
from rftpipe.run.placement import Placement
from rftpipe.run.preemption import NoStop, StopFlag, StopRequested
from rftpipe.stages import FINAL
from rftpipe.stages.base import ReplayCheck, Runtime
from rftpipe.storage.layout import RunDir

log = logging.getLogger(__name__)


def train_run(
    cfg: RunConfig,
    run: RunDir,
    dist: Dist,
    *,
    repair: bool,
    allow_mismatch: bool,
    stop: StopFlag | NoStop | None = None,
    placement: Placement | None = None,
) -> int:
    """The steps on every rank, or with `placement` of the training role, on its ranks
    (`dist` is then the role's)."""
    # From the start: loading the model may be the run's peak.
    memory.start_run_sampler()
    rt = runtime.build(cfg, run, dist, allow_mismatch, stop, placement)
    ckpt_step, last_done = _resume(rt, repair, placement)
    if ckpt_step == cfg.total_steps:
        log.info("run already complete: %d/%d steps", last_done, cfg.total_steps)
        finish(rt)
        return 0
    trackers = make_trackers(rt, last_done)
    busy = roles.Roles(handoff.channel(rt) if rt.handoff is not None else None)
    evaluate_initial(rt, ckpt_step)
    first = 0 if rt.store.is_committed(0, "eval") else 1
    trackers.log_committed(
        range(first, last_done + 1), partial(step_metrics, rt.store, env=cfg.rollout.env)
    )
    bar = progress(cfg, dist, last_done)
    try:
        _run_steps(rt, ckpt_step, last_done, trackers, busy, bar)
    except BaseException as exc:
        # A stop or an error between stages still lets a pending checkpoint commit; a stop
        # only until Slurm's kill nears (then the write is abandoned, see Writer.wait).
        until = exc.deadline() if isinstance(exc, StopRequested) else None
        with memory.measured(cfg.total_steps, "checkpoint_wait"):
            rt.ckpt_writer.wait(until)
        raise
    with memory.measured(cfg.total_steps, "checkpoint_wait"):
        rt.ckpt_writer.wait()
    finish(rt)
    trackers.close()
    if bar is not None:
        bar.close()
    return 0


def _resume(rt: Runtime, repair: bool, placement: Placement | None) -> tuple[int, int]:
    """The run directory brought back to its last consistent state (`resume.prepare`), with
    `total_steps` checked against what it holds; returns (the step of the checkpoint it
    resumes from, the newest step whose stages all committed)."""
    cfg, run = rt.cfg, rt.run
    last_done = rt.store.newest_complete_step(FINAL)
    if last_done > cfg.total_steps:
        raise UserError(
            f"total_steps: {cfg.total_steps} is below the {last_done} steps already committed"
        )
    ckpt_step = resume.prepare(rt, repair)
    if placement is not None and placement.disaggregated:
        handoff.clear_failure(rt)
        placement.job.barrier()  # the rollout ranks start on the consistent directory
    # Every stage's memory increment is measured from here: model, engines and state loaded.
    memory.mark_baseline()
    if ckpt_step > cfg.total_steps:
        # A checkpoint past every committed step: the steps it saved lost their stage files
        # (the check above sees only those). Nothing is left to run, and its state is not a
        # step-`total_steps` policy to finish with.
        raise UserError(
            f"total_steps: {cfg.total_steps} is below the checkpoint of step {ckpt_step}, "
            f"whose steps are missing from {run.stages}"
        )
    if rt.dist.is_main:
        run.promote_pending_config()
    return ckpt_step, rt.store.newest_complete_step(FINAL)


def _run_steps(
    rt: Runtime, ckpt_step: int, last_done: int, trackers: Trackers, busy: roles.Roles, bar: Any
) -> None:
    """Steps `ckpt_step + 1` to `total_steps`, each checkpointed as the schedule decides:
    those up to `last_done` replayed (committed and logged before), the others logged."""
    t_replay = t_prev = time.perf_counter()
    for step in range(ckpt_step + 1, rt.cfg.total_steps + 1):
        replay = step <= last_done
        timings: dict[str, float] = {}
        metrics = run_step(rt, step, timings)
        now = time.perf_counter()
        if "rollout" in timings:
            # A whole step computed in this process, end to end (the previous step's
            # checkpoint hand-off and logging included): what the checkpoint schedule
            # learns from. Replayed and half-resumed steps are left out.
            timings["step"] = now - t_prev
        t_prev = now
        timings["checkpoint_wait"] = rt.ckpt_writer.last_wait_s
        maybe_checkpoint(rt, step, timings)
        if replay:
            if step == last_done:
                _log_replay_done(last_done - ckpt_step, t_replay)
            continue
        if rt.dist.is_main:
            _log_step(rt, step, timings, metrics, trackers, busy, bar)


def _log_replay_done(steps: int, t_replay: float) -> None:
    """The `replay_done` event and log line, once the last committed step is replayed
    (`steps` of them, from `t_replay` on)."""
    events().write("replay_done", steps=steps, seconds=round(time.perf_counter() - t_replay, 3))
    log.info("replayed %d train steps in %.2f s", steps, time.perf_counter() - t_replay)


def _log_step(
    rt: Runtime,
    step: int,
    timings: dict[str, float],
    train_metrics: dict[str, float],
    trackers: Trackers,
    busy: roles.Roles,
    bar: Any,
) -> None:
    """A computed step's metrics to every tracker (its committed files' with this process's
    timings, memory, replay verdict and role figures) and the progress bar (rank 0)."""
    m = step_metrics(rt.store, step, rt.cfg.rollout.env)
    trackers.log(
        {
            **m,
            "perf/commit_s": timings.get("commit", 0.0),
            "perf/checkpoint_s": timings.get("checkpoint", 0.0),
            "perf/checkpoint_wait_s": timings.get("checkpoint_wait", 0.0),
            "perf/checkpoint_interval": rt.ckpt_schedule.interval(),
            "checkpoint/skipped_no_space": timings.get("checkpoint_skipped", 0.0),
            **memory.run_figures(),
            **resume_metrics(rt.replays),
            **busy.step_figures(),
        },
        step,
    )
    rt.replays.clear()
    bar_update(bar, m, train_metrics, drift_label(rt.cfg))


def resume_metrics(checks: list[ReplayCheck]) -> dict[str, float]:
    """The verdict on the train steps this process replayed, logged with the first step it
    computes: `resume/replay_identical` 1 when every one equals its committed update
    bitwise, `resume/replay_max_rel_diff` the largest relative difference of their update
    metrics, and `resume/platform_changed` 1 when one was committed on another platform
    (`rftpipe.observe.machine`; absent when none recorded it). Nothing without a replay."""
    if not checks:
        return {}
    out = {
        "resume/replay_identical": float(all(c.identical for c in checks)),
        "resume/replay_max_rel_diff": max(c.max_rel_diff for c in checks),
    }
    known = [c.platform_changed for c in checks if c.platform_changed is not None]
    if known:
        out["resume/platform_changed"] = float(any(known))
    return out


def make_trackers(rt: Runtime, last_done: int) -> Trackers:
    if not rt.dist.is_main:
        return Trackers([NullTracker()])
    jsonl = JsonlTracker(rt.run.metrics_path, last_done)
    out: list[Any] = []
    mode = wandb_mode(rt.cfg.logging.wandb)
    if mode:
        out.append(WandbTracker(rt.run, mode, rt.cfg.logging.wandb_project, to_dict(rt.cfg)))
    if rt.cfg.logging.tensorboard:
        missing = [s for s in range(1, last_done + 1) if not jsonl.has(s)]
        first = missing[0] if missing else last_done + 1
        out.append(TensorBoardTracker(rt.run, {s for s in jsonl.records if s < first}, first))
    # JSONL last: a step with its line reached every tracker before it.
    return Trackers([*out, jsonl], jsonl)


def progress(cfg: RunConfig, dist: Dist, initial: int):
    if not (cfg.logging.progress and dist.is_main):
        return None
    from tqdm import tqdm

    return tqdm(
        total=cfg.total_steps,
        initial=initial,
        desc="steps",
        file=sys.stdout,
        dynamic_ncols=True,
        mininterval=0,
    )


def drift_label(cfg: RunConfig) -> str:
    """The bar's name for `train/kl`: the KL to the reference with one (`kl.mode` loss or
    reward), else the train stage's k3 estimate of the drift from the old (behaviour)
    policy, which is no KL penalty and must not read as one."""
    return "kl" if cfg.kl.mode != "none" else "drift"


def bar_update(bar, m: dict[str, Any], train_metrics: dict[str, float], drift_key: str) -> None:
    if bar is None:
        return
    postfix = {
        "reward": f"{m.get('rollout/reward_mean', math.nan):.3f}",
        drift_key: f"{train_metrics['train/kl']:.2e}",
        "len": f"{m.get('rollout/response_length', math.nan):.1f}",
    }
    if "episode/turns_mean" in m:  # a multi-turn step
        postfix["turns"] = f"{m['episode/turns_mean']:.2f}"
    postfix["t_roll"] = f"{m['perf/rollout_s']:.1f}s"
    postfix["t_train"] = f"{m['perf/train_s']:.1f}s"
    bar.set_postfix(postfix, refresh=False)
    bar.update(1)


def finish(rt: Runtime) -> None:
    """The evaluations' summary and the HF export of the final policy (done once), and of
    the actor's parameter average with `train.ema_decay` (RUN/export_ema).

    No stop check here: once the last step has committed, the run is finished and a late
    signal must not requeue it.
    """
    slow("finish")
    # A run found complete at start may still be loading its optimizer's moments in the
    # background (`resume.restore`): a daemon thread inside a collective at interpreter
    # exit aborts the process ("terminate called without an active exception", a FAILED job).
    rt.ckpt_writer.wait()
    if rt.dist.is_main:
        write_summary(rt.store, rt.run.root / "eval.json")
    with memory.measured(rt.cfg.total_steps, "export"):
        export.export_policies(rt)
    events().write("run_memory", **memory.run_event())
    rt.dist.barrier()
