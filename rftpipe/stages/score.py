"""Stage 2, score: every reward function becomes its own column; `reward` is their weighted sum
(plus, for multi-turn episodes, the environment's rewards: column `reward_env`).

A function that declares `data_sources` sees only the rows of those sources: the other
rows' `reward_<name>` is null (not applied) and adds nothing to `reward`.

Each row also gets `reward_status` (ok, or the first function's timeout / error) and
`reward_error` (what failed, null when ok). A failed row stops the run under
`reward.on_error=fail`; under `zero` its component scores 0, is counted in the step's
metrics and logged. A malformed return value (not a number, NaN, a dict without
`score`) always stops the run: no policy can make it a reward.

The rows of a vision run carry the images their prompt showed (column `images`, paths
under the run directory): each sample gets them as `RewardSample.images`, absolute paths
under `run_root` with their sha256.
"""

from __future__ import annotations

import json
import logging
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from rftpipe.config.schema import RewardConfig
from rftpipe.errors import UserError
from rftpipe.rewards import applies
from rftpipe.rewards.signatures import parse_value
from rftpipe.rewards.types import (
    Outcome,
    RewardComponent,
    RewardSample,
    SampleImage,
    data_source_of,
)
from rftpipe.stages import generation, round_stage
from rftpipe.stages.base import NoSideEffects, Rows, Runtime, StageOutput, StepPlan
from rftpipe.storage.branch_rows import episode_rows, has_branches, last_row_index
from rftpipe.storage.layout import IMAGES_COLUMN

log = logging.getLogger(__name__)


def run(
    cfg: RewardConfig,
    components: Mapping[str, RewardComponent],
    rollouts: pa.Table,
    run_root: Path | None = None,
) -> pa.Table:
    """`rollouts` with the reward columns appended; `run_root` is the run directory the
    rows' `images` paths are under (needed only if some row has images).

    An agent episode of several sequences (`rftpipe.storage.branch_rows`) is scored once,
    on its last one (what the agent ended on), and each of its rows gets those columns."""
    if not has_branches(rollouts):
        return _scored(cfg, components, rollouts, run_root)
    last = _scored(cfg, components, episode_rows(rollouts), run_root)
    take = pa.array(last_row_index(rollouts), pa.int64())
    out = rollouts
    for name in last.column_names[rollouts.num_columns :]:
        out = out.append_column(last.schema.field(name), last.column(name).take(take))
    return out


def _scored(
    cfg: RewardConfig,
    components: Mapping[str, RewardComponent],
    rollouts: pa.Table,
    run_root: Path | None,
) -> pa.Table:
    samples = [_sample(r, run_root) for r in rollouts.to_pylist()]
    weights = cfg.weights or (1.0,) * len(components)
    total = [0.0] * len(samples)
    status = ["ok"] * len(samples)
    errors: list[str | None] = [None] * len(samples)
    out = rollouts
    for (col, comp), w in zip(components.items(), weights, strict=True):
        mine = [i for i, s in enumerate(samples) if applies(comp.spec, s.data_source)]
        # A shard with none of its sources makes no call (a remote server sees nothing).
        outcomes = (
            comp.score([samples[i] for i in mine], fail_fast=cfg.on_error == "fail") if mine else []
        )
        if cfg.on_error == "fail":
            _fail_on_first_failure(comp.spec.path, [samples[i] for i in mine], outcomes)
        values: list[float | None] = [None] * len(samples)
        extras: list[dict[str, Any]] = [{} for _ in samples]
        for i, o in zip(mine, outcomes, strict=True):
            v, extras[i] = _value(comp.spec.path, samples[i], o)
            if o is not None and o.status != "ok" and status[i] == "ok":
                status[i], errors[i] = o.status, f"{comp.spec.path}: {o.error}"
            values[i] = v
            total[i] += w * v
        out = out.append_column(pa.field(col, pa.float64()), pa.array(values, pa.float64()))
        for name, array in _extra_columns(col, extras).items():
            out = out.append_column(name, array)
    if "env_reward" in rollouts.column_names:
        # A multi-turn episode's return: its environment's rewards plus the functions'.
        env = rollouts.column("env_reward").to_pylist()
        total = [t + e for t, e in zip(total, env, strict=True)]
        out = out.append_column(pa.field("reward_env", pa.float64()), pa.array(env, pa.float64()))
    _report(status, errors)
    out = out.append_column(pa.field("reward_status", pa.string()), pa.array(status, pa.string()))
    out = out.append_column(pa.field("reward_error", pa.string()), pa.array(errors, pa.string()))
    return out.append_column(pa.field("reward", pa.float64()), pa.array(total, pa.float64()))


def _sample(r: dict[str, Any], run_root: Path | None) -> RewardSample:
    metadata = json.loads(r["metadata"])
    return RewardSample(
        step=r["step"],
        prompt_id=r["prompt_id"],
        sample_idx=r["sample_idx"],
        prompt=r["prompt"],
        response=r["response"],
        answer=r["answer"],
        data_source=data_source_of(r, metadata),
        metadata=metadata,
        response_token_ids=r["response_token_ids"],
        finish_reason=r["finish_reason"],
        messages=json.loads(r["messages"]) if r.get("messages") else None,
        images=_images(r, run_root),
    )


def _images(r: dict[str, Any], run_root: Path | None) -> tuple[SampleImage, ...]:
    """The row's images (its `images` column, absent in a text-only run), as
    `RewardSample.images`."""
    relpaths = r.get(IMAGES_COLUMN) or []
    if not relpaths:
        return ()
    if run_root is None:
        raise ValueError("score.run: rows with images need the run directory (run_root)")
    try:
        return tuple(SampleImage.in_run(run_root, p) for p in relpaths)
    except ValueError as exc:  # a committed row we wrote: a bug or damage, not user input
        where = f"step {r['step']} prompt_id {r['prompt_id']} sample_idx {r['sample_idx']}"
        raise ValueError(f"{where}: {exc}") from exc


def _value(fn: str, s: RewardSample, o: Outcome | None) -> tuple[float, dict[str, Any]]:
    """The component's score and extra entries for one row (0 for a failed one: `zero`)."""
    assert o is not None, f"{fn} left {s.where} unscored"
    if o.status != "ok":
        return 0.0, {}
    try:
        return parse_value(o.value)
    except (TypeError, ValueError) as exc:
        raise UserError(f"reward.functions: {fn} {exc} on {s.where}") from exc


def _fail_on_first_failure(
    fn: str, samples: list[RewardSample], outcomes: list[Outcome | None]
) -> None:
    """`on_error=fail`: the first failed row stops the run (rows left None came after it)."""
    for s, o in zip(samples, outcomes, strict=True):
        if o is not None and o.status != "ok":
            what = "timed out" if o.status == "timeout" else "failed"
            raise UserError(
                f"reward.functions: {fn} {what} on {s.where}: {o.error} (reward.on_error=fail)"
            )


def _extra_columns(col: str, extras: list[dict[str, Any]]) -> dict[str, pa.Array]:
    """`reward_<name>_<key>` per extra entry of a dict return: float64 if every value is a
    number, else their string form; null where a row has no such entry."""
    keys = sorted({k for e in extras for k in e})
    out = {}
    for k in keys:
        vals = [e.get(k) for e in extras]
        name = f"{col}_{re.sub(r'[^A-Za-z0-9_]', '_', k)}"
        if all(v is None or isinstance(v, numbers.Real) for v in vals):
            out[name] = pa.array([None if v is None else float(v) for v in vals], pa.float64())
        else:
            out[name] = pa.array([None if v is None else str(v) for v in vals], pa.string())
    return out


def _report(status: list[str], errors: list[str | None]) -> None:
    """Rows zeroed by `on_error=zero` are never silent: one warning per shard."""
    failed = [e for s, e in zip(status, errors, strict=True) if s != "ok"]
    if failed:
        log.warning(
            "reward: %d of %d rows scored 0 (reward.on_error=zero): %d timeouts, %d errors; "
            "first: %s",
            len(failed),
            len(status),
            status.count("timeout"),
            status.count("error"),
            failed[0],
        )


@dataclass(frozen=True, slots=True)
class ScoreStage(NoSideEffects):
    """2. One column per reward function and their weighted sum; under dynamic sampling,
    also which of the round's groups have scores that vary (in the manifest)."""

    round: int = 0
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = False

    @property
    def name(self) -> str:
        return round_stage("score", self.round)

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        table = run(rt.cfg.reward, rt.rewards, rows(), rt.run.root)
        ds = rt.cfg.rollout.dynamic_sampling
        if not ds.enabled:
            return StageOutput(rows=table)
        local = generation.varied_groups(table, generation.metric_column(ds.metric))
        # Each rank knows only its own groups: a flag per prompt of the round, summed.
        flags = rt.dist.all_reduce_sum(
            torch.tensor([float(p in local) for p in plan.global_ids], dtype=torch.float64)
        )
        varied = [p for p, f in zip(plan.global_ids, flags.tolist(), strict=True) if f > 0]
        extra = {
            generation.VARIED: varied,
            generation.TARGET: rt.cfg.data.prompts_per_step,
        }
        return StageOutput(rows=table, extra=extra)
