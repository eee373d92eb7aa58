"""The durable stage executor: the one place that writes, checksums, commits and reads back.

Every stage of a step goes through `execute`:
- not committed: check for a stop, run it, write this rank's shard (if it returns rows),
  and commit the manifest on rank 0, every rank waiting for each (publishing the shards as
  the step's dataset if the stage says so; a full disk on any rank stops them all alike);
- committed: never run again. Its rows are read back (and verified) only if a later stage
  asks for them, and a stage with side effects outside the run directory (training the
  weights, handing them to the rollout engine) re-applies them with `replay`.
"""

from __future__ import annotations

import json
import threading
import time
from functools import partial

import pyarrow as pa

from rftpipe.atomic import CorruptionError
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import slow
from rftpipe.observe import memory
from rftpipe.run import roles
from rftpipe.stages.base import Rows, Runtime, Stage, StepPlan, StepState
from rftpipe.storage.agreed import write_then_agree
from rftpipe.storage.layout import schema_version
from rftpipe.storage.routes import ACTOR_ROUTES, ROUTES


def execute(rt: Runtime, plan: StepPlan, stage: Stage, state: StepState) -> None:
    store, dist, step = rt.store, rt.dist, plan.step
    if store.is_committed(step, stage.name):
        manifest = store.manifest(step, stage.name)
        stage.replay(rt, plan, state.rows, manifest)
        slow(f"{stage.name}_replay", step)
        state.manifests[stage.name] = manifest
        if manifest["shards"]:
            state.rows = _reader(rt, plan, stage.name)
        return
    rt.stop.check(dist, f"step {step} {stage.name}")
    # Counted by the tests: a stage may run again only if it never committed. Generation
    # beside training (rollout.overlap) names its thread.
    where = threading.current_thread()
    beside = {} if where is threading.main_thread() else {"thread": where.name}
    events().write("stage_begin", step=step, stage=stage.name, **beside)
    memory.reset_peak()
    t0 = time.perf_counter()
    out = stage.run(rt, plan, state.rows)
    slow(stage.name, step)
    t1 = time.perf_counter()
    roles.clock().add(stage.name, t1 - t0)
    # This rank's peak during the stage (the manifest keeps rank 0's; events every rank's).
    mem = memory.stage_figures(stage.name)
    events().write("stage_memory", step=step, stage=stage.name, **mem)
    shard = None
    if out.rows is not None:
        meta = {
            "rftpipe.schema_version": schema_version(out.rows.column_names),
            "rftpipe.stage": stage.name,
            "rftpipe.step": str(step),
        }
        if rt.route_shape is not None and {ROUTES, ACTOR_ROUTES} & set(out.rows.column_names):
            # An MoE run's routes columns: their shape and dtype, for offline readers.
            meta["rftpipe.routes"] = json.dumps(rt.route_shape.to_meta(), sort_keys=True)
        shard = partial(store.write_shard, step, stage.name, dist.rank, out.rows, meta)
    # A full disk on any rank stops every rank alike, said once (`write_then_agree`).
    write_then_agree(dist, shard)
    manifest = {**out.extra, "seconds": t1 - t0, "memory": mem}
    commit = partial(store.commit, step, stage.name, dist.world, manifest, publish=stage.publish)
    write_then_agree(dist, commit, main_only=True)
    state.manifests[stage.name] = manifest
    if out.rows is not None:
        table = out.rows
        state.rows = lambda: table
    state.timings[stage.name] = t1 - t0
    state.timings["commit"] = state.timings.get("commit", 0.0) + time.perf_counter() - t1


def _reader(rt: Runtime, plan: StepPlan, stage: str) -> Rows:
    """Read a committed stage's rows for this rank once, on first use."""
    cache: list[pa.Table] = []

    def rows() -> pa.Table:
        if not cache:
            mine = [p.prompt_id for p in plan.mine]
            try:
                table = rt.store.read_for(plan.step, stage, rt.dist.rank, rt.dist.world, mine)
            except CorruptionError as exc:
                # Only when a corrupt checkpoint sent replay further back than the restart
                # checked; the next start checks this stage and can repair it.
                raise UserError(
                    f"corrupt committed file {exc.path} ({exc.why}); "
                    "rerun with --repair to roll the run back before it"
                ) from exc
            cache.append(table)
        return cache[0]

    return rows
