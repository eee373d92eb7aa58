"""The run: resume, then steps until `total_steps`, logging each step after it commits."""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rftpipe.config.loader import to_dict
from rftpipe.config.schema import RunConfig
from rftpipe.dist import Dist
from rftpipe.engines import models
from rftpipe.engines.train.ema import ParameterEMA
from rftpipe.errors import UserError
from rftpipe.faults import slow
from rftpipe.observe.events import events
from rftpipe.observe.trackers import (
    JsonlTracker,
    NullTracker,
    TensorBoardTracker,
    Trackers,
    WandbTracker,
    wandb_mode,
)
from rftpipe.run import resume, runtime
from rftpipe.run.driver import evaluate_initial, maybe_checkpoint, run_step
from rftpipe.run.metrics import step_metrics, write_summary
from rftpipe.run.preemption import NoStop, StopFlag
from rftpipe.stages import FINAL
from rftpipe.storage.atomic import atomic_write_json, read_json
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
) -> int:
    rt = runtime.build(cfg, run, dist, allow_mismatch, stop)
    last_done = rt.store.newest_complete_step(FINAL)
    if last_done > cfg.total_steps:
        raise UserError(
            f"total_steps: {cfg.total_steps} is below the {last_done} steps already committed"
        )
    ckpt_step = resume.prepare(rt, repair)
    if dist.is_main:
        run.promote_pending_config()
    last_done = rt.store.newest_complete_step(FINAL)
    if ckpt_step == cfg.total_steps:
        log.info("run already complete: %d/%d steps", last_done, cfg.total_steps)
        finish(rt)
        return 0
    trackers = make_trackers(rt, last_done)
    evaluate_initial(rt, ckpt_step)
    first = 0 if rt.store.is_committed(0, "eval") else 1
    trackers.log_committed(range(first, last_done + 1), partial(step_metrics, rt.store))
    bar = progress(cfg, dist, last_done)
    t_replay = t_prev = time.perf_counter()
    ran = 0
    try:
        for step in range(ckpt_step + 1, cfg.total_steps + 1):
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
            ran += 1
            if replay:
                if step == last_done:
                    events().write(
                        "replay_done",
                        steps=last_done - ckpt_step,
                        seconds=round(time.perf_counter() - t_replay, 3),
                    )
                    log.info(
                        "replayed %d train steps in %.2f s",
                        last_done - ckpt_step,
                        time.perf_counter() - t_replay,
                    )
                continue
            if dist.is_main:
                m = step_metrics(rt.store, step)
                trackers.log(
                    {
                        **m,
                        "perf/commit_s": timings.get("commit", 0.0),
                        "perf/checkpoint_s": timings.get("checkpoint", 0.0),
                        "perf/checkpoint_wait_s": timings.get("checkpoint_wait", 0.0),
                        "perf/checkpoint_interval": rt.ckpt_schedule.interval(),
                    },
                    step,
                )
                bar_update(bar, m, metrics)
    finally:
        # A stop or an error between stages still lets a pending checkpoint commit.
        rt.ckpt_writer.wait()
    if ran == 0:
        raise RuntimeError(
            f"resume at step {ckpt_step + 1} with {cfg.total_steps} total did no work"
        )
    finish(rt)
    trackers.close()
    if bar is not None:
        bar.close()
    return 0


def make_trackers(rt: runtime.Runtime, last_done: int) -> Trackers:
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


def bar_update(bar, m: dict[str, Any], train_metrics: dict[str, float]) -> None:
    if bar is None:
        return
    bar.set_postfix(
        {
            "reward": f"{m.get('rollout/reward_mean', math.nan):.3f}",
            "kl": f"{train_metrics['train/kl']:.2e}",
            "len": f"{m.get('rollout/response_length', math.nan):.1f}",
            "t_roll": f"{m['perf/rollout_s']:.1f}s",
            "t_train": f"{m['perf/train_s']:.1f}s",
        },
        refresh=False,
    )
    bar.update(1)


def finish(rt: runtime.Runtime) -> None:
    """The evaluations' summary and the HF export of the final policy (done once), and of
    the actor's parameter average with `train.ema_decay` (RUN/export_ema).

    No stop check here: once the last step has committed, the run is finished and a late
    signal must not requeue it.
    """
    slow("finish")
    if rt.dist.is_main:
        write_summary(rt.store, rt.run.root / "eval.json")
    # The trainer's full weights, whatever the rollout engine holds (a serving engine's
    # copy is not a transformers module): the module itself on one device, gathered from
    # the shards otherwise.
    _export_once(rt, rt.run.root / "export", rt.train_engine.rollout_weights)
    if (ema := rt.train_engine.ema) is not None:
        _export_once(rt, rt.run.root / "export_ema", lambda: _ema_weights(rt, ema))
    rt.dist.barrier()


def _export_once(
    rt: runtime.Runtime,
    final: Path,
    weights: Callable[[], torch.nn.Module | Mapping[str, torch.Tensor]],
) -> None:
    """`export_final(final, weights())`, unless `final` already holds the last step's."""
    marker = final / EXPORT_MARKER
    # Re-exported when a run is extended past the step its export was taken at. Rank 0
    # decides for all: gathering sharded weights is collective.
    stale = rt.dist.is_main and not (
        marker.exists() and read_json(marker)["step"] == rt.cfg.total_steps
    )
    if rt.dist.any(stale):
        state = weights()
        if rt.dist.is_main:
            export_final(rt, final, state)


def _ema_weights(
    rt: runtime.Runtime, ema: ParameterEMA
) -> torch.nn.Module | Mapping[str, torch.Tensor]:
    """The averages, gathered on every rank (collective under fsdp2); on rank 0, the one
    that exports, as a fresh policy module holding them (by parameter name, so a tied head
    takes its embedding's average, as it does in training)."""
    params = ema.full_params()
    if not rt.dist.is_main:
        return params
    model = models.load_causal_lm(rt.model_dir, rt.cfg.model.dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


EXPORT_MARKER = "rftpipe_export.json"


def export_final(
    rt: runtime.Runtime, final: Path, weights: torch.nn.Module | Mapping[str, torch.Tensor]
) -> None:
    """HF-format export of a policy (RUN/export, RUN/export_ema), published by a dir rename."""
    tmp = rt.run.root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    if not isinstance(weights, torch.nn.Module):
        state = weights
        weights = models.load_causal_lm(rt.model_dir, rt.cfg.model.dtype)
        weights.load_state_dict(state)
    weights.save_pretrained(tmp)
    rt.tokenizer.save_pretrained(tmp)
    atomic_write_json(tmp / EXPORT_MARKER, {"step": rt.cfg.total_steps})
    old = rt.run.root / f".tmp-old-{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
