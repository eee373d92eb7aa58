"""Per-step metrics derived only from committed files, and the trackers that receive them.

Because a step's metrics are a pure function of its committed manifests and shards, a
restarted run logs exactly the steps that committed, once each, whatever instant it died.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rftpipe.rewards.resolve import data_source_of
from rftpipe.stages import ORDER, generation
from rftpipe.storage.atomic import atomic_write_bytes
from rftpipe.storage.baseline_rows import COLUMN, baseline_flags, without_baseline
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, Codex)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rows: pa.Table, ks: Sequence[int]) -> dict[str, float]:
    """`eval/...` metrics of committed eval rows: greedy accuracy and pass@k for each of
    `ks`, overall and under `eval/<data source>/...`."""
    by_prompt: dict[int, dict[str, Any]] = {}
    for r in rows.select(["prompt_id", "mode", "metadata", "correct"]).to_pylist():
        if r["correct"] is None:
            continue  # a data source the metric's reward function does not score
        entry = by_prompt.setdefault(
            r["prompt_id"],
            {"source": data_source_of(r, json.loads(r["metadata"])), "greedy": 0.0, "c": 0, "n": 0},
        )
        if r["mode"] == "greedy":
            entry["greedy"] = float(r["correct"])
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
    }


def step_metrics(store: StageStore, step: int) -> dict[str, Any]:
    """rollout/*, advantage/*, train/*, perf/* and (when it ran) eval/* metrics of a
    committed step; step 0 has only the evaluation of the initial weights."""
    evaluated = eval_metrics(store, step) if store.is_committed(step, "eval") else {}
    if step == 0:
        return {"step": 0, **evaluated}
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
    baseline = [COLUMN] if COLUMN in schema.names else []
    tables = [pq.read_table(f, columns=cols + reward_cols + status + baseline) for f in files]
    # ReMax's greedy rows are the baseline, not the policy's samples: kept out of the means.
    rows = [without_baseline(t) for t in tables]
    reward = np.concatenate([t.column("reward").to_numpy() for t in rows])
    length = np.concatenate([t.column("response_length").to_numpy() for t in rows])
    stops = sum(t.column("finish_reason").to_pylist().count("stop") for t in rows)
    adv = np.concatenate(
        [np.asarray(t.column("advantages").combine_chunks().flatten()) for t in rows]
    )
    out: dict[str, Any] = {
        "step": step,
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
    for c in reward_cols if len(reward) else []:
        # nan-mean: a dict entry that some rows lack is null there.
        values = np.concatenate([t.column(c).to_numpy(zero_copy_only=False) for t in rows])
        out[f"rollout/{c}"] = float(np.nanmean(values)) if np.isfinite(values).any() else 0.0
    greedy = [
        r
        for t in tables
        for r, b in zip(t["reward"].to_pylist(), baseline_flags(t), strict=True)
        if b
    ]
    if greedy:
        out["rollout/baseline_reward_mean"] = float(np.mean(greedy))
    if status:
        codes = [s for t in rows for s in t.column("reward_status").to_pylist()]
        out["rollout/reward_errors"] = codes.count("error")
        out["rollout/reward_timeouts"] = codes.count("timeout")
    # The advantage stage's own (rollout/logprob_abs_diff_* when the actor recomputes the
    # old logprobs); manifests committed before it reported any have none.
    out.update(store.manifest(step, "advantage").get("metrics", {}))
    out.update(store.manifest(step, "train")["metrics"])
    out["train/kl_coef"] = store.manifest(step, "advantage").get("kl_coef", 0.0)
    for stage in ORDER:
        out[f"perf/{stage}_s"] = generation.stage_seconds(store, step, stage)
    out.update(generation.step_summary(store, step))
    return {**out, **evaluated}


class Tracker(Protocol):
    """A metrics sink. `log` is called once per committed step, in step order; a tracker
    skips steps it already holds, so restarts can offer it every committed step."""

    def has(self, step: int) -> bool: ...

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    def has(self, step: int) -> bool:
        return True

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Tracking switched off."""

    def close(self) -> None:
        """Nothing to close."""


class JsonlTracker:
    """RUN/metrics.jsonl, one line per committed step; cut back to committed steps on resume.

    It is the last tracker written for a step, so a step that has its line was delivered to
    every tracker and a step that lacks it is offered to all of them again on restart.
    """

    def __init__(self, path: Path, last_committed: int) -> None:
        self.path = path
        self.records: dict[int, dict[str, Any]] = {}
        if path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a kill mid-append
                if rec.get("step", 0) <= last_committed and rec["step"] not in self.records:
                    kept.append(line)
                    self.records[rec["step"]] = rec
            atomic_write_bytes(path, "".join(k + "\n" for k in kept).encode())

    def has(self, step: int) -> bool:
        return step in self.records

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.records:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[step] = metrics

    def close(self) -> None:
        """Every line is already on disk."""


class WandbTracker:
    """wandb with one run id per run directory, resumed across requeues.

    A SIGKILLed process loses whatever wandb-core had not yet written, so the steps wandb
    already holds are read back rather than assumed: the history in the run files under
    RUN/wandb (offline and online runs both keep one per process start), plus, online,
    everything below the server's resumed step. Only the other committed steps are logged.
    """

    def __init__(self, run: RunDir, mode: str, project: str, config: dict[str, Any]) -> None:
        import wandb

        from rftpipe.observe.wandb_log import logged_steps

        id_file = run.root / "wandb_id"
        if not id_file.exists():
            atomic_write_bytes(id_file, secrets.token_hex(4).encode())
        run_id = id_file.read_text().strip()
        self.have = set(logged_steps(run.root / "wandb", run_id))
        self.wandb = wandb
        self.run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(run.root),
            config=config,
        )
        # The server refuses steps below the one it resumed at.
        self.have.update(range(self.run.starting_step))

    def has(self, step: int) -> bool:
        return step in self.have

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.have:
            return
        self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        self.have.add(step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """RUN/tensorboard, reopened after a restart with `purge_step` at the first step it will
    log again, so events a killed process wrote for that step or later are dropped."""

    def __init__(self, run: RunDir, have: set[int], first_missing: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.have = set(have)
        self.writer = SummaryWriter(str(run.root / "tensorboard"), purge_step=first_missing)

    def has(self, step: int) -> bool:
        return step in self.have

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step in self.have:
            return
        for k, v in metrics.items():
            if k != "step" and isinstance(v, int | float):
                self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()
        self.have.add(step)

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The run's trackers, JSONL last (see JsonlTracker)."""

    def __init__(self, trackers: list[Any], jsonl: JsonlTracker | None = None) -> None:
        self.trackers = trackers
        self.jsonl = jsonl

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def log_committed(self, store: StageStore, steps: range) -> None:
        """Offer committed steps again; each tracker logs only what it lacks, so steps a kill
        kept from (or cost) a tracker end up logged exactly once. The JSONL line, when there
        is one, is what the other trackers missed; otherwise the step's files are."""
        for step in steps:
            if all(t.has(step) for t in self.trackers):
                continue
            rec = self.jsonl.records.get(step) if self.jsonl else None
            self.log(rec if rec is not None else step_metrics(store, step), step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def wandb_mode(setting: str) -> str | None:
    if setting == "off":
        return None
    if setting == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return setting
