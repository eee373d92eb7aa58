"""The rollout role of a disaggregated run (`launch.rollout_ranks`): every step's
generation, in order, each from the weights the schedule names (`rftpipe.run.handoff`).

The trainers make the run directory consistent first (`rftpipe.run.resume.prepare`); a
step whose generation committed is never run again, and its weights are not waited for.
"""

from __future__ import annotations

import shutil

from rftpipe.config.schema import RunConfig
from rftpipe.observe import memory
from rftpipe.run import handoff, roles, runtime
from rftpipe.run.driver import generate
from rftpipe.run.placement import Placement
from rftpipe.run.preemption import NoStop, StopFlag
from rftpipe.stages import FINAL
from rftpipe.stages.base import StepState, no_rows
from rftpipe.storage.layout import RunDir


def generate_run(
    cfg: RunConfig,
    run: RunDir,
    placement: Placement,
    *,
    allow_mismatch: bool,
    stop: StopFlag | NoStop | None = None,
) -> int:
    memory.start_run_sampler()
    rt = runtime.build(cfg, run, placement.dist, allow_mismatch, stop, placement)
    if rt.dist.is_main:
        roles.write_generation_clock(handoff.channel(rt))  # the trainers' first reading
    placement.job.barrier()  # the trainers' restart is done: the directory is consistent
    memory.mark_baseline()
    total = cfg.total_steps
    try:
        for step in range(1, total + 1):
            if handoff.generated(rt, step):
                continue
            handoff.receive(rt, step)
            generate(rt, step, StepState(rows=no_rows, timings={}))
            if rt.dist.is_main:
                roles.write_generation_clock(handoff.channel(rt))
        # Until the trainers are done: the job ends for both roles together.
        handoff.wait(rt, lambda: rt.store.is_committed(total, FINAL), "the trainers' last step")
    finally:
        rt.rollout_engine.close()  # a serving engine's own processes end with it
    if rt.dist.is_main:
        shutil.rmtree(handoff.channel(rt), ignore_errors=True)  # no step samples from them
    return 0
