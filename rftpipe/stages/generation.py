"""DAPO's dynamic sampling (`rollout.dynamic_sampling`): which groups of a step's generation
rounds the step trains on, where their rows are, and what the rounds add up to.

A step generates in rounds of fresh prompts. Round 0 is the ordinary `rollout` and `score`
stages; round r > 0 commits `rollout.rR` and `score.rR` beside them. Each round's score
stage records, in its manifest, the prompt ids of the round's groups whose `metric` varies
(over all ranks, in the round's global prompt order). The step trains on the first
`data.prompts_per_step` of them in round order. Everything here is a function of committed
manifests, so a resumed step makes the same choice on any world size. Torch-free: the
run-directory tools use it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from rftpipe.stages import GENERATION, StageName, chain_position, round_stage
from rftpipe.storage.baseline_rows import baseline_flags, without_baseline
from rftpipe.storage.layout import list_steps
from rftpipe.storage.stage_store import StageStore

VARIED = "varied"
"""Score-manifest field: prompt ids (global order) of the round's groups whose metric varies."""
TARGET = "target_groups"
"""Score-manifest field: the groups the step needs (data.prompts_per_step)."""

DECODE_KEYS = ("forwards", "row_steps", "static_row_steps")
"""Rollout-manifest field `decode`: the HF loop's counts (`DecodeCounts`), summed over ranks."""

Deal = Callable[[Sequence[int], int, int], list[int]]
"""(a round's global prompt ids, rank, world) -> that rank's share: how rounds are dealt."""


def metric_column(metric: str) -> str:
    """The committed column of `rollout.dynamic_sampling.metric`."""
    return "reward" if metric == "reward" else f"reward_{metric}"


def varied_groups(table: pa.Table, column: str) -> set[int]:
    """Prompt ids of this shard's groups whose `column` takes more than one value.

    ReMax's greedy baseline rows are left out (they are not the policy's samples). A null
    (a component that does not apply to the row's data source) is a value like any other,
    so a group that the metric never scores never varies.
    """
    values: dict[int, set] = {}
    for pid, v, base in zip(
        table.column("prompt_id").to_pylist(),
        table.column(column).to_pylist(),
        baseline_flags(table),
        strict=True,
    ):
        if not base:
            values.setdefault(pid, set()).add(v)
    return {pid for pid, vs in values.items() if len(vs) > 1}


def select(varied_by_round: Sequence[Sequence[int]], target: int) -> list[list[int]]:
    """Per round, the prompt ids the step trains on: the first `target` varied groups in
    round order. A prompt met again in a later round (a step that straddles an epoch of
    the sampler) counts once, where it first varied."""
    seen: set[int] = set()
    out: list[list[int]] = []
    for varied in varied_by_round:
        taken = []
        for pid in varied:
            if len(seen) < target and pid not in seen:
                seen.add(pid)
                taken.append(pid)
        out.append(taken)
    return out


def filled(varied_by_round: Sequence[Sequence[int]], target: int) -> bool:
    return sum(len(r) for r in select(varied_by_round, target)) >= target


def committed_rounds(store: StageStore, step: int, stage: StageName) -> list[str]:
    """The committed directories of generation stage `stage` in `step`, in round order."""
    out: list[str] = []
    while store.is_committed(step, name := round_stage(stage, len(out))):
        out.append(name)
    return out


def consumed_after(store: StageStore, step: int) -> int:
    """The sampler's state after a complete step: what its last round's rollout recorded."""
    last = committed_rounds(store, step, "rollout")[-1]
    return store.manifest(step, last)["sampler"]["consumed_after"]


def stage_seconds(store: StageStore, step: int, stage: str) -> float:
    """A committed stage's seconds; a generation stage's summed over its rounds."""
    names = committed_rounds(store, step, stage) if stage in GENERATION else []
    return sum(store.manifest(step, s).get("seconds", 0.0) for s in names or [stage])


def kept_rows(
    store: StageStore, step: int, kept: Sequence[Sequence[int]], mine: Sequence[int], deal: Deal
) -> Callable[[], pa.Table]:
    """A reader of this rank's rows of the kept groups (`mine`, in the step's kept order),
    from the score stages of the rounds that generated them. Each round's shards are read
    only from the ranks that generated one of them (the round's deal, at the world size the
    round was written with)."""

    def rows() -> pa.Table:
        parts = []
        for r, ids in enumerate(kept):
            keep = set(ids)
            want = [p for p in mine if p in keep]
            wanted = set(want)
            if not want:
                continue
            stage = round_stage("score", r)
            world = store.manifest(step, stage)["world_size"]
            global_ids = store.manifest(step, round_stage("rollout", r))["prompt_ids"]
            owners = [w for w in range(world) if wanted.intersection(deal(global_ids, w, world))]
            parts.append(store.read_prompts(step, stage, want, owners))
        if not parts:  # no kept group here: an empty table, with the columns of the rows
            return store.read_prompts(step, "score", [], [0])
        # A dict-returning reward function's extra columns exist only in shards where some
        # row returned that key: the union of the rounds' columns, null where absent.
        return pa.concat_tables(parts, promote_options="default")

    return rows


def step_summary(store: StageStore, step: int) -> dict[str, float]:
    """The `dynamic/*` metrics of a committed step (empty without dynamic sampling).

    `dynamic/generated_<column>` are means over every sample the step generated, dropped
    groups included: the kept groups' rewards are biased by the filter (it removes the
    all-correct groups that a good policy produces), these are not.
    """
    first = store.manifest(step, "score")
    if VARIED not in first:
        return {}
    scores = committed_rounds(store, step, "score")
    varied = [store.manifest(step, s)[VARIED] for s in scores]
    kept = sum(len(r) for r in select(varied, first[TARGET]))
    generated = sum(
        len(store.manifest(step, s)["prompt_ids"]) for s in committed_rounds(store, step, "rollout")
    )
    out: dict[str, float] = {
        "dynamic/rounds": len(scores),
        "dynamic/generated_groups": generated,
        "dynamic/varied_groups": sum(len(v) for v in varied),
        "dynamic/kept_groups": kept,
        "dynamic/shortfall_groups": first[TARGET] - kept,
    }
    tables = [
        without_baseline(store.read(step, s, rank))
        for s in scores
        for rank in range(len(store.manifest(step, s)["shards"]))
    ]
    columns = sorted({c for t in tables for c in t.column_names if _is_reward_column(t, c)})
    for c in columns:
        values = np.concatenate(
            [t.column(c).to_numpy(zero_copy_only=False) for t in tables if c in t.column_names]
        ).astype(np.float64)
        finite = values[np.isfinite(values)]
        out[f"dynamic/generated_{c}"] = float(finite.mean()) if finite.size else 0.0
    return out


def _is_reward_column(t: pa.Table, c: str) -> bool:
    return (c == "reward" or c.startswith("reward_")) and pa.types.is_floating(
        t.schema.field(c).type
    )


def generated_ahead(store: StageStore) -> dict[int, list[str]]:
    """The steps whose generation has committed (some of it) before their training began
    (`rollout.staleness` >= 1 generates step s+k during step s): step -> its committed
    generation stages, in chain order; a step whose advantage stage committed is left out."""
    out: dict[int, list[str]] = {}
    for step in list_steps(store.run.stages):
        if store.is_committed(step, "advantage"):
            continue
        done = [name for stage in GENERATION for name in committed_rounds(store, step, stage)]
        if done:
            out[step] = sorted(done, key=lambda n: chain_position(n) or ())
    return out


def ahead_line(ahead: Mapping[int, list[str]] | Mapping[str, list[str]]) -> str:
    """`generated_ahead` as the line `rftpipe status` and `inspect summary` print."""
    return "; ".join(f"step {step} ({', '.join(stages)})" for step, stages in ahead.items())
