"""Reading a run's committed files for inspection: open a run, and the per-step summary
(`summarize`) computed from the published trajectories and committed manifests only, so it
is safe on a live or preempted run. Definitions are in `rftpipe.inspect.cli`'s help.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from rftpipe.stages import ORDER as STAGES
from rftpipe.stages import generation
from rftpipe.storage import branch_rows, episode_stats
from rftpipe.storage.baseline_rows import COLUMN, without_baseline
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore


class InspectError(Exception):
    """A user-facing failure: printed as one `inspect: error:` line, exit code 2."""


# -- opening a run --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    rundir: RunDir
    dataset: ds.Dataset
    steps: list[int]
    #: Published fragments per committed step (one per rank).
    fragments: dict[int, list[ds.Fragment]]

    @property
    def reward_components(self) -> list[str]:
        """The numeric reward columns (not `reward_status`, `reward_error` or text entries)."""
        return [
            f.name
            for f in self.dataset.schema
            if f.name.startswith("reward_") and pa.types.is_floating(f.type)
        ]


def open_run(path: Path | str) -> Run:
    """The run's committed steps: published trajectories whose train stage also committed."""
    path = Path(path)
    if not path.is_dir():
        raise InspectError(f"no run directory at {path}")
    rundir = RunDir(path)
    if not rundir.trajectories.is_dir():
        raise InspectError(f"{path} has no committed steps (no trajectories/ directory)")
    # The default ignore_prefixes skip '.tmp-' files, so a half-written shard is never read.
    dataset = ds.dataset(rundir.trajectories, format="parquet", partitioning="hive")
    fragments: dict[int, list[ds.Fragment]] = {}
    for frag in dataset.get_fragments():
        step = ds.get_partition_keys(frag.partition_expression).get("step")
        if step is not None and StageStore(rundir).is_committed(int(step), "train"):
            fragments.setdefault(int(step), []).append(frag)
    if not fragments:
        raise InspectError(f"{path} has no committed steps")
    steps = sorted(fragments)
    return Run(rundir, dataset, steps, {s: fragments[s] for s in steps})


# -- summary --------------------------------------------------------------------------------


@dataclass(slots=True)
class Moments:
    """Count, mean and sum of squared deviations; mergeable (Chan et al.) so each shard is
    reduced on its own thread and std stays accurate without a second pass over the data."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    @classmethod
    def of(cls, x: np.ndarray, block: int = 1 << 16) -> Moments:
        """Moments of a (float32) array, accumulated in float64: float32 sums over millions
        of tokens drift. Both raw sums cast element-wise inside numpy, so no float64 copy of
        the array is made; einsum rather than np.dot because BLAS would start its own
        threads under our per-shard threads and oversubscribe the cores (10x slower)."""
        if x.size == 0:
            return cls()
        n = int(x.size)
        s1 = float(x.sum(dtype=np.float64))
        s2 = float(np.einsum("i,i->", x, x, dtype=np.float64))
        mean = s1 / n
        m2 = s2 - s1 * mean
        if m2 > s2 * 1e-6:  # the subtraction lost at most ~1e-10 relative precision
            return cls(n, mean, m2)
        # |mean| >> std (or constant values): the shortcut cancels, so sum the deviations
        # from the mean instead, in cache-sized float64 blocks.
        m2 = 0.0
        for i in range(0, n, block):
            b = x[i : i + block].astype(np.float64) - mean
            m2 += float(np.einsum("i,i->", b, b))
        return cls(n, mean, m2)

    def merge(self, o: Moments) -> Moments:
        if o.n == 0:
            return self
        if self.n == 0:
            return o
        n = self.n + o.n
        delta = o.mean - self.mean
        return Moments(
            n, self.mean + delta * o.n / n, self.m2 + o.m2 + delta * delta * self.n * o.n / n
        )

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else math.nan


@dataclass(slots=True)
class ShardStats:
    """Per-step sufficient statistics of one or more trajectory shards."""

    reward: Moments = field(default_factory=Moments)
    reward_min: float = math.inf
    reward_max: float = -math.inf
    component_sums: dict[str, float] = field(default_factory=dict)
    passed: int = 0
    length_sum: int = 0
    length_max: int = 0
    stops: int = 0
    adv: Moments = field(default_factory=Moments)
    has_adv: bool = False
    episodes: episode_stats.EpisodeCounts | None = None
    """A multi-turn shard's (schema version 2) episode counts; None for version 1."""

    def merge(self, o: ShardStats) -> ShardStats:
        sums = dict(self.component_sums)
        for k, v in o.component_sums.items():
            sums[k] = sums.get(k, 0.0) + v
        return ShardStats(
            self.reward.merge(o.reward),
            min(self.reward_min, o.reward_min),
            max(self.reward_max, o.reward_max),
            sums,
            self.passed + o.passed,
            self.length_sum + o.length_sum,
            max(self.length_max, o.length_max),
            self.stops + o.stops,
            self.adv.merge(o.adv),
            self.has_adv or o.has_adv,
            _merge_episodes(self.episodes, o.episodes),
        )


def _merge_episodes(
    a: episode_stats.EpisodeCounts | None, b: episode_stats.EpisodeCounts | None
) -> episode_stats.EpisodeCounts | None:
    if a is None or b is None:
        return a or b
    return a.merge(b)


def _numpy(col: pa.ChunkedArray) -> np.ndarray:
    return col.to_numpy()


def _shard_stats(frag: ds.Fragment, components: list[str], has_adv: bool) -> ShardStats:
    # Column projection: the token-id and logprob lists (most of the bytes) are never
    # decoded; advantages is the only list read, and only when the run has it.
    cols = ["reward", "response_length", "finish_reason", *components]
    cols += ["advantages"] if has_adv else []
    # ReMax's greedy baseline rows are not the policy's samples (as in step_metrics).
    names = frag.physical_schema.names
    cols += [COLUMN] if COLUMN in names else []
    # A multi-turn shard's turn counts, statuses and loss mask (one int8 per token).
    episodes = episode_stats.has_episodes(names)
    cols += episode_stats.columns(names) if episodes else []
    every = without_baseline(frag.to_table(columns=cols, use_threads=False))
    st = ShardStats(has_adv=has_adv)
    if episodes:
        st.episodes = episode_stats.EpisodeCounts.of(every)
    # An agent episode's sequences are one sample: its last row (the others share its
    # reward); advantages count every trained token.
    t = branch_rows.episode_rows(every)
    if t.num_rows == 0:
        return st
    reward = _numpy(t.column("reward"))
    st.reward = Moments.of(reward)
    st.reward_min, st.reward_max = float(reward.min()), float(reward.max())
    # nansum: an entry of a function's dict return is null on rows that lack it.
    st.component_sums = {
        c: float(np.nansum(t.column(c).to_numpy(zero_copy_only=False))) for c in components
    }
    gate = _numpy(t.column("reward_accuracy")) if "reward_accuracy" in components else reward
    st.passed = int(np.count_nonzero(gate > 0))
    length = _numpy(t.column("response_length")).astype(np.int64)
    st.length_sum, st.length_max = int(length.sum()), int(length.max())
    st.stops = int(pc.sum(pc.equal(t.column("finish_reason"), "stop")).as_py() or 0)
    if has_adv:
        # list_flatten respects slice offsets; chunks are reduced one at a time and merged
        # so no step-sized float64 copy of every token is ever materialised.
        for chunk in every.column("advantages").chunks:
            flat = pc.list_flatten(chunk)
            if flat.null_count:
                flat = pc.drop_null(flat)
            st.adv = st.adv.merge(Moments.of(flat.to_numpy(zero_copy_only=False)))
    return st


def _none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


def summarize(run: Run | Path | str, *, threads: int | None = None) -> list[dict[str, Any]]:
    """One dict per committed step (see the module docstring for the definitions)."""
    if not isinstance(run, Run):
        run = open_run(run)
    components = run.reward_components
    has_adv = "advantages" in run.dataset.schema.names
    jobs = [(s, f) for s in run.steps for f in run.fragments[s]]
    # One shard per task: Parquet decoding and the numpy reductions release the GIL, so a
    # thread per core overlaps them across shards (a shard's single list column cannot be
    # decoded in parallel within the file).
    workers = threads or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(lambda j: (j[0], _shard_stats(j[1], components, has_adv)), jobs))
    per_step: dict[int, ShardStats] = {}
    for step, st in parts:
        per_step[step] = per_step[step].merge(st) if step in per_step else st
    rows = []
    for step in run.steps:
        st = per_step[step]
        n = st.reward.n
        row: dict[str, Any] = {
            "step": step,
            "rollout/samples": n,
            "rollout/reward_mean": st.reward.mean if n else None,
            "rollout/reward_std": st.reward.std if n else None,
            "rollout/reward_min": st.reward_min if n else None,
            "rollout/reward_max": st.reward_max if n else None,
        }
        for c in components:
            row[f"rollout/{c}"] = st.component_sums.get(c, 0.0) / n if n else None
        row["rollout/pass_rate"] = st.passed / n if n else None
        row["rollout/response_length"] = st.length_sum / n if n else None
        row["rollout/response_length_max"] = st.length_max if n else None
        row["rollout/stop_frac"] = st.stops / n if n else None
        row["advantage/mean"] = st.adv.mean if st.adv.n else None
        row["advantage/std"] = _none_if_nan(st.adv.std) if st.adv.n else None
        if st.episodes is not None:
            # As step_metrics: only a multi-turn step has these (null without samples).
            row.update(dict.fromkeys(episode_stats.METRICS) | st.episodes.metrics())
        store = StageStore(run.rundir)
        row.update(store.manifest(step, "train").get("metrics", {}))
        for stage in STAGES:
            # A stage without its manifest has not committed: its timing does not exist yet.
            committed = store.is_committed(step, stage)
            secs = generation.stage_seconds(store, step, stage) if committed else None
            row[f"perf/{stage}_s"] = secs
        rows.append(row)
    return rows
