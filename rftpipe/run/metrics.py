"""Per-step metrics derived only from committed files (`rftpipe.observe.trackers` logs them),
and RUN/eval.json, every committed evaluation's metrics by step.

Because a step's metrics are a pure function of its committed manifests and shards, a
restarted run logs exactly the steps that committed, once each, whatever instant it died.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rftpipe.atomic import atomic_write_json
from rftpipe.config.schema import EnvConfig
from rftpipe.envs.loader import ENV_CLASS_COLUMN, row_env
from rftpipe.rewards.types import data_source_of
from rftpipe.stages import ORDER, generation
from rftpipe.storage import episode_stats
from rftpipe.storage.baseline_rows import COLUMN, baseline_flags, without_baseline
from rftpipe.storage.branch_rows import episode_rows
from rftpipe.storage.layout import list_steps
from rftpipe.storage.stage_store import StageStore

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, Codex)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rows: pa.Table, ks: Sequence[int]) -> dict[str, float]:
    """`eval/...` metrics of committed eval rows: greedy accuracy and pass@k for each of
    `ks`, overall and under `eval/<data source>/...`. Episode rows (`rollout.env`) add,
    over the greedy episodes, `greedy_turns_mean` (turns per episode) and
    `greedy_first_turn_accuracy` (correct, and ended after its first turn: right on the
    first try)."""
    episodes = "num_turns" in rows.column_names
    cols = ["prompt_id", "mode", "metadata", "correct", *(["num_turns"] if episodes else [])]
    by_prompt: dict[int, dict[str, Any]] = {}
    for r in rows.select(cols).to_pylist():
        if r["correct"] is None:
            continue  # a data source the metric's reward function does not score
        entry = by_prompt.setdefault(
            r["prompt_id"],
            {
                "source": data_source_of(r, json.loads(r["metadata"])),
                "greedy": 0.0,
                "c": 0,
                "n": 0,
                "turns": 0,
                "first": 0.0,
            },
        )
        if r["mode"] == "greedy":
            entry["greedy"] = float(r["correct"])
            if episodes:
                entry["turns"] = r["num_turns"]
                entry["first"] = float(r["correct"] and r["num_turns"] == 1)
        else:
            entry["c"] += int(r["correct"])
            entry["n"] += 1
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in by_prompt.values():
        groups["eval"].append(entry)
        if entry["source"]:
            groups[f"eval/{entry['source']}"].append(entry)
    out: dict[str, float] = {}
    for prefix, entries in sorted(groups.items()):
        out[f"{prefix}/problems"] = len(entries)
        out[f"{prefix}/greedy_accuracy"] = sum(e["greedy"] for e in entries) / len(entries)
        if episodes:
            out[f"{prefix}/greedy_turns_mean"] = sum(e["turns"] for e in entries) / len(entries)
            out[f"{prefix}/greedy_first_turn_accuracy"] = sum(e["first"] for e in entries) / len(
                entries
            )
        for k in ks:
            out[f"{prefix}/pass@{k}"] = sum(pass_at_k(e["n"], e["c"], k) for e in entries) / len(
                entries
            )
    return out


def eval_metrics(store: StageStore, step: int) -> dict[str, Any]:
    """eval/* metrics of a committed eval stage, from its rows."""
    manifest = store.manifest(step, "eval")
    rows = pa.concat_tables([store.read(step, "eval", r) for r in range(len(manifest["shards"]))])
    return {
        **summarize(rows, manifest["k"]),
        "eval/overlap_with_train": manifest["overlap_with_train"],
        "perf/eval_s": manifest.get("seconds", 0.0),
        **manifest.get("memory", {}),
    }


def write_summary(store: StageStore, path: Path) -> None:
    """{"steps": {step: eval/* metrics}, "before": step 0's, "after": the newest's}; the
    committed eval stages are the record, this file only gathers them (rewritten whole)."""
    steps = {
        s: {k: v for k, v in eval_metrics(store, s).items() if k.startswith("eval/")}
        for s in list_steps(store.run.stages)
        if store.is_committed(s, "eval")
    }
    if not steps:
        return
    summary = {"steps": {str(s): m for s, m in steps.items()}}
    if 0 in steps:
        summary["before"] = steps[0]
    summary["after"] = steps[max(steps)]
    atomic_write_json(path, summary)


def per_env_metrics(rows: Sequence[pa.Table], env: EnvConfig) -> dict[str, Any]:
    """`episode/<env>/episodes`, `.../reward_mean` and the `episode/*` means of each
    environment's episodes (`<env>` its `rollout.env.path` form, `row_env`), when any row
    names its own (`env_class`); none otherwise."""
    metadata = [[json.loads(m) for m in t.column("metadata").to_pylist()] for t in rows]
    if not any(m.get(ENV_CLASS_COLUMN) is not None for ms in metadata for m in ms):
        return {}
    named = [[row_env(env, m).path for m in ms] for ms in metadata]
    out: dict[str, Any] = {}
    for path in sorted({p for paths in named for p in paths}):
        mine = [
            t.filter(pa.array([p == path for p in paths]))
            for t, paths in zip(rows, named, strict=True)
        ]
        counts = episode_stats.EpisodeCounts()
        for t in mine:
            counts = counts.merge(episode_stats.EpisodeCounts.of(t))
        reward = np.concatenate([t.column("reward").to_numpy() for t in mine])
        out[f"episode/{path}/episodes"] = counts.episodes
        out[f"episode/{path}/reward_mean"] = float(reward.mean())
        for name, value in counts.metrics().items():
            out[name.replace("episode/", f"episode/{path}/", 1)] = value
    return out


@dataclass(frozen=True, slots=True)
class _StepShards:
    """A committed step's advantage-stage rows, as its metrics read them."""

    tables: list[pa.Table]
    """Every row of each shard, ReMax's greedy baseline rows included."""
    every: list[pa.Table]
    """The policy's samples: `tables` without the baseline rows."""
    rows: list[pa.Table]
    """One row per sample: an agent episode's last row (its sequences share its reward)."""
    reward_cols: list[str]
    """The numeric `reward_*` components."""
    status: bool
    """Whether the rows carry `reward_status`."""
    version: bool
    """Whether the rows carry `weight_version`."""
    episodes: bool
    """Whether the rows are multi-turn episodes (schema version 2)."""


def _read_step_shards(store: StageStore, step: int, env: EnvConfig | None) -> _StepShards:
    """The columns of step `step`'s committed advantage shards that its metrics read (with
    `env`, the rows' metadata too)."""
    files = [
        store.run.stage_dir(step, "advantage") / s["file"]
        for s in store.manifest(step, "advantage")["shards"]
    ]
    cols = ["reward", "response_length", "finish_reason", "advantages"]
    schema = pq.read_schema(files[0])
    # Numeric components only (`reward_status`, `reward_error` and text entries of a
    # function's dict are not means); shards committed before statuses existed have none.
    reward_cols = [
        f.name for f in schema if f.name.startswith("reward_") and pa.types.is_floating(f.type)
    ]
    status = ["reward_status"] if "reward_status" in schema.names else []
    version = ["weight_version"] if "weight_version" in schema.names else []
    baseline = [COLUMN] if COLUMN in schema.names else []
    # Multi-turn steps (schema version 2) also get episode/*; version 1 reads what it did.
    episodes = (
        episode_stats.columns(schema.names) if episode_stats.has_episodes(schema.names) else []
    )
    if episodes and env is not None:
        episodes = [*episodes, "metadata"]  # the rows' `env_class`
    tables = [
        pq.read_table(f, columns=cols + reward_cols + status + version + baseline + episodes)
        for f in files
    ]
    # ReMax's greedy rows are the baseline, not the policy's samples: kept out of the means.
    every = [without_baseline(t) for t in tables]
    # An agent episode's sequences are one sample, its last row (they share its reward);
    # the advantages and episode counts read every row.
    rows = [episode_rows(t) for t in every]
    return _StepShards(
        tables=tables,
        every=every,
        rows=rows,
        reward_cols=reward_cols,
        status=bool(status),
        version=bool(version),
        episodes=bool(episodes),
    )


def step_metrics(store: StageStore, step: int, env: EnvConfig | None = None) -> dict[str, Any]:
    """rollout/*, advantage/*, train/*, perf/*, (multi-turn) episode/* and (when it ran)
    eval/* metrics of a committed step; step 0 has only the evaluation of the initial
    weights. With `env` (`rollout.env`), a step whose rows name their environments
    (`env_class`) also gets `episode/<env>/*` per environment."""
    evaluated = eval_metrics(store, step) if store.is_committed(step, "eval") else {}
    if step == 0:
        return {"step": 0, **evaluated}
    shards = _read_step_shards(store, step, env)
    out: dict[str, Any] = {"step": step}
    out.update(_sample_metrics(shards))
    out.update(_provenance_metrics(shards, step))
    if shards.episodes:
        out.update(_episode_metrics(store, step, shards, env))
    out.update(_stage_metrics(store, step))
    return {**out, **evaluated}


def _sample_metrics(shards: _StepShards) -> dict[str, Any]:
    """advantage/* over every row, and rollout/* means of the rewards, their numeric
    components, response lengths and stops over the samples."""
    rows = shards.rows
    reward = np.concatenate([t.column("reward").to_numpy() for t in rows])
    length = np.concatenate([t.column("response_length").to_numpy() for t in rows])
    stops = sum(t.column("finish_reason").to_pylist().count("stop") for t in rows)
    adv = np.concatenate(
        [np.asarray(t.column("advantages").combine_chunks().flatten()) for t in shards.every]
    )
    out: dict[str, Any] = {
        "advantage/mean": float(adv.mean()) if adv.size else 0.0,
        "advantage/std": float(adv.std()) if adv.size else 0.0,
    }
    if len(reward):
        # A dynamically sampled step may keep no group at all: then these means do not
        # exist, and are left out rather than written as NaN (not JSON).
        out["rollout/reward_mean"] = float(reward.mean())
        out["rollout/reward_std"] = float(reward.std())
        out["rollout/response_length"] = float(length.mean())
        out["rollout/stop_frac"] = stops / len(reward)
    for c in shards.reward_cols if len(reward) else []:
        # nan-mean: a dict entry that some rows lack is null there.
        values = np.concatenate([t.column(c).to_numpy(zero_copy_only=False) for t in rows])
        out[f"rollout/{c}"] = float(np.nanmean(values)) if np.isfinite(values).any() else 0.0
    return out


def _provenance_metrics(shards: _StepShards, step: int) -> dict[str, Any]:
    """What else the rows record of how they were sampled and scored: ReMax's greedy
    baseline reward, the weights that sampled them, and the reward functions' failures."""
    out: dict[str, Any] = {}
    greedy = [
        r
        for t in shards.tables
        for r, b in zip(t["reward"].to_pylist(), baseline_flags(t), strict=True)
        if b
    ]
    if greedy:
        out["rollout/baseline_reward_mean"] = float(np.mean(greedy))
    versions = [
        v for t in shards.rows if shards.version for v in t.column("weight_version").to_pylist()
    ]
    if versions:
        # The oldest weights that sampled the step, and how many train steps they lag the
        # ones it trains (step - 1): rollout.staleness, or less for the first steps.
        oldest = min(versions)
        out["rollout/weight_version"] = oldest
        out["rollout/staleness"] = step - 1 - oldest
    if shards.status:
        codes = [s for t in shards.rows for s in t.column("reward_status").to_pylist()]
        out["rollout/reward_errors"] = codes.count("error")
        out["rollout/reward_timeouts"] = codes.count("timeout")
    return out


def _episode_metrics(
    store: StageStore, step: int, shards: _StepShards, env: EnvConfig | None
) -> dict[str, Any]:
    """A multi-turn step's episode/* (per environment too, with `env`), the seconds spent
    waiting for environments, and an agent stage's perf/agent_s and agent/*."""
    counts = episode_stats.EpisodeCounts()
    for t in shards.every:
        counts = counts.merge(episode_stats.EpisodeCounts.of(t))
    out: dict[str, Any] = dict(counts.metrics())
    if env is not None:
        out.update(per_env_metrics(shards.rows, env))
    # Rank 0's seconds waiting for environments, over the step's generation rounds.
    rounds = generation.committed_rounds(store, step, "rollout")
    out["perf/env_s"] = sum(store.manifest(step, r).get("env_s", 0.0) for r in rounds)
    manifest = store.manifest(step, "rollout")
    if "agent_s" in manifest:
        # An agent stage's (rank 0's): seconds its agents ran, calls a restart answered
        # from the record, and engine calls per call index.
        out["perf/agent_s"] = manifest["agent_s"]
        out["agent/from_record"] = manifest["agent_from_record"]
        out["agent/engine_calls"] = sum(manifest["agent_engine_calls"])
        # Calls that did not extend their episode, each a new sequence (row).
        out["agent/branches"] = counts.branches or 0
    return out


def _stage_metrics(store: StageStore, step: int) -> dict[str, Any]:
    """What the step's stage manifests report: the advantage and train stages' metrics,
    the KL coefficient, each stage's seconds and peak memory, and the generation summary."""
    # The advantage stage's own (rollout/logprob_abs_diff_* when the actor recomputes the
    # old logprobs); manifests committed before it reported any have none.
    out: dict[str, Any] = dict(store.manifest(step, "advantage").get("metrics", {}))
    out.update(store.manifest(step, "train")["metrics"])
    out["train/kl_coef"] = store.manifest(step, "advantage").get("kl_coef", 0.0)
    out.update(_decode_metrics(store, step))
    for stage in ORDER:
        out[f"perf/{stage}_s"] = generation.stage_seconds(store, step, stage)
        # Rank 0's peak memory in the stage (the first round's, under dynamic sampling).
        out.update(store.manifest(step, stage).get("memory", {}))
    out.update(generation.step_summary(store, step))
    return out


def _decode_metrics(store: StageStore, step: int) -> dict[str, int]:
    """The HF loop's decode forwards and rows fed, against the static batch's, over the
    step's generation rounds (none for engines that batch requests themselves, nor for
    rollouts committed before they were counted)."""
    found = [
        store.manifest(step, r).get("decode")
        for r in generation.committed_rounds(store, step, "rollout")
    ]
    counts = [c for c in found if c is not None]
    if not counts or len(counts) < len(found):
        return {}
    return {f"rollout/decode_{k}": sum(c[k] for c in counts) for k in generation.DECODE_KEYS}
