"""Named fault points and slowed stages: test aids armed by the environment.

``RFTPIPE_FAULT=point[,point...]`` makes the process SIGKILL itself the first time it
reaches one of the named points (``RFTPIPE_FAULT_SKIP=k`` lets k hits pass first). The
hit is appended to ``events.jsonl`` (`rftpipe.events`) *before* the kill so tests
can prove every fault point was exercised. ``RFTPIPE_SLOW=stage=seconds[,...]`` stretches
a stage's compute (and ``STAGE_replay`` a restart's replay of a committed one, e.g.
``train_replay``; ``stage@step`` that step's only; ``checkpoint`` each file a background
checkpoint writes), so a test can aim a preemption at a known stage.
``RFTPIPE_SLOW_ALLOCATIONS=n`` stretches only the first n allocations of a Slurm job
(``SLURM_RESTART_COUNT`` below n): its requeued runs go at full speed. Outside tests each
check is one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from rftpipe.events import events

FAULT_POINTS: tuple[str, ...] = (
    "shard_before_rename",
    "shard_after_rename",
    "manifest_mid_write",
    "manifest_before_rename",
    "stage_after_commit",
    "publish_before_rename",
    "ckpt_mid_write",
    "ckpt_before_rename",
    "retention_mid_delete",
    "train_mid_step",
    "train_mid_replay",
)

EPISODE_FAULT_POINTS: tuple[str, ...] = ("episode_mid_turn", "episode_before_turn_commit")
"""Reached only by multi-turn runs (`rollout.env`): after each call's share of a turn (its
generation and environment steps), and after a whole turn before its commit. Right after a
turn's commit is `stage_after_commit`, as for every commit."""

AGENT_FAULT_POINTS: tuple[str, ...] = (
    "agent_mid_call",
    "agent_before_call_commit",
    "agent_after_call_commit",
)
"""Reached only by agent episodes (`rollout.agent`): after each engine call group's share
of a call index (mid-generation), after all of them before the index's commit (the
generation is lost), and after its commit before the answers go out (a restart answers
those calls from the record)."""

HANDOFF_FAULT_POINTS: tuple[str, ...] = ("handoff_mid_publish",)
"""Reached only with separate rollout ranks (`launch.rollout_ranks`): the trainers' main
rank, its weights for the rollout ranks half written (`rftpipe.run.handoff.publish`)."""

_hits: dict[str, int] = {}


def fault(point: str) -> None:
    """Kill this process with SIGKILL if `point` is armed by the environment."""
    armed = os.environ.get("RFTPIPE_FAULT")
    if not armed or point not in armed.split(","):
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] <= int(os.environ.get("RFTPIPE_FAULT_SKIP", "0")):
        return
    events().write("fault", point=point)
    os.kill(os.getpid(), signal.SIGKILL)


def slow(
    stage: str, step: int | None = None, sleep: Callable[[float], object] | None = None
) -> None:
    """Sleep inside `stage` (of `step`) if ``RFTPIPE_SLOW`` names it (a test aid, like the
    fault points): ``stage@step`` first, then ``stage``. `sleep` may end it early (the
    checkpoint writer passes its abandonment's ``Event.wait``)."""
    spec = os.environ.get("RFTPIPE_SLOW")
    if not spec:
        return
    allocations = os.environ.get("RFTPIPE_SLOW_ALLOCATIONS")
    if allocations and int(os.environ.get("SLURM_RESTART_COUNT", "0")) >= int(allocations):
        return
    delays = dict(item.split("=", 1) for item in spec.split(","))
    seconds = delays.get(f"{stage}@{step}", delays.get(stage))
    if seconds is not None:
        (sleep or time.sleep)(float(seconds))
