"""Generation ahead of training (`rollout.staleness`): the later steps a step generates, run
before its advantage and train stages, or beside them (`rollout.overlap`).

Beside them means a background thread of each rank. It computes exactly what the
sequential order computes: the engine holds its own copy of the weights the step starts
with (the sync stage, which would change them, waits for the thread), every sample's seed
is derived from the run's config, not from timing, and the thread's collectives run on a
group of their own (`Runtime.generation_dist`), so the two streams of collectives never
interleave. The sync stage's commit follows the thread's last one, so a run killed at any
instant finds step s+k generated whenever step s synced, as in the sequential order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as tdist

from rftpipe.dist import Dist
from rftpipe.stages.base import Runtime, StepPlan, StepState, no_rows

log = logging.getLogger(__name__)

Generate = Callable[[Runtime, int, StepState], StepPlan]
"""`rftpipe.run.driver.generate`: a step's rollout and score stages."""


def second_stream(dist: Dist) -> Dist:
    """`dist` with its collectives on a new group of the same ranks (every rank calls this,
    in the same order); `dist` itself on one rank, which has no collectives."""
    if dist.world == 1:
        return dist
    return dataclasses.replace(dist, group=tdist.new_group(list(range(dist.world))))


@contextmanager
def generating(
    rt: Runtime, steps: range, generate: Generate, timings: dict[str, float]
) -> Iterator[bool]:
    """Generate `steps` before the block, or with `rollout.overlap` beside it, finished
    when the block ends. Yields whether the block's stages may put the rollout engine to
    sleep (not while the background thread generates with it). The thread's error, a stop
    included, is raised when the block ends."""
    if not rt.cfg.rollout.overlap or not steps:
        for step in steps:
            generate(rt, step, StepState(rows=no_rows, timings=timings))
        yield True
        return
    beside = dataclasses.replace(rt, dist=rt.generation_dist or rt.dist)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            for step in steps:
                generate(beside, step, StepState(rows=no_rows, timings=timings))
        except BaseException as exc:  # raised in the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=work, name=f"generate-{steps[0]}", daemon=True)
    thread.start()
    try:
        yield False
    finally:
        # Also when the block raised: the thread reaches its next stage boundary (a stop
        # stops it there too) or ends, and nothing of it is left running.
        thread.join()
    if failed:
        raise failed[0]
