"""The run directory's path layout: `RunDir`, the one spelling of a step, the versions.

Layout (one spelling of a step everywhere, ``step=N``, unpadded, so pyarrow, pandas, polars
and DuckDB all read the hive key as an integer; ``K`` = rank)::

    RUN/config.yaml                        resolved config (resume-safe keys may change)
    RUN/config.next.yaml                   a resume's config until its checks pass
    RUN/run.json                           fingerprints of config, model and data
    RUN/stages/step=N/STAGE/part-rK.parquet a stage's rows from rank K
    RUN/stages/step=N/STAGE/part-rK.json   that shard's row count and checksum
    RUN/stages/step=N/STAGE/MANIFEST.json  the commit marker: all shards, checksums, extras
    RUN/trajectories/step=N/part-rK.parquet the published dataset (a publishing stage's shards)
    RUN/checkpoints/step=N/                see rftpipe.checkpoint.writer
    RUN/events.jsonl, RUN/metrics.jsonl    diagnostics and per-step metrics
    RUN/superseded/TIME/                   files of an earlier start that committed nothing
    RUN/.live.lock                         flocked (shared) by every live worker
    RUN/.holder.json, RUN/.holder.lock     the job that runs the directory (rftpipe.run.holder)

Every file is written under a temporary name, fsynced and renamed (`rftpipe.atomic`);
a stage exists only once its MANIFEST.json exists, and nothing reads a shard that no manifest
lists (`rftpipe.storage.stage_store`). `RunDir` is the layout alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from rftpipe.atomic import fsync_dir

TRAJECTORY_SCHEMA_VERSION = "1"
"""`rftpipe.schema_version` in the Parquet metadata of a single-turn run's stage shards."""
EPISODE_SCHEMA_VERSION = "2"
"""A multi-turn run's (`rollout.env`): version 1's columns plus the turn structure
(`loss_mask`, `turn_offsets`, `turn_rewards`, `turn_infos`, `num_turns`, `env_reward`,
`episode_status`, `messages`). Readers take a shard without them as single-turn."""
VISION_SCHEMA_VERSION = "3"
"""A run whose model takes images: version 2's columns (the turn structure only with
`rollout.env`) plus `images`. Readers take a shard without `images` as text-only."""
IMAGES_COLUMN = "images"
"""list<string>: each image the row's prompt showed, in the order of its image parts, as
its path under the run directory (`rftpipe.storage.images.ImageRef.relpath`,
``images/ab/<sha256>.<ext>``); empty for a text prompt of a vision run."""


def schema_version(columns: list[str]) -> str:
    """The trajectory schema version of a shard with these columns."""
    if IMAGES_COLUMN in columns:
        return VISION_SCHEMA_VERSION
    return EPISODE_SCHEMA_VERSION if is_episode_shard(columns) else TRAJECTORY_SCHEMA_VERSION


def is_episode_shard(columns: list[str]) -> bool:
    """Whether a shard's rows are multi-turn episodes (they carry the turn structure)."""
    return "loss_mask" in columns


RUN_LAYOUT_VERSION = 2
"""Version 2: every step directory is spelled ``step=N`` (1 mixed three spellings)."""
MANIFEST = "MANIFEST.json"


def step_name(step: int) -> str:
    """The one spelling of a step directory."""
    return f"step={step}"


def parse_step(name: str) -> int | None:
    """The step of a ``step=N`` name; None for anything else (temp files, strays)."""
    key, sep, value = name.partition("=")
    return int(value) if key == "step" and sep and value.isdigit() else None


def list_steps(folder: Path) -> list[int]:
    """Steps with a ``step=N`` entry in `folder`, ascending (names only: no per-step stat)."""
    if not folder.exists():
        return []
    return sorted(s for s in (parse_step(n) for n in os.listdir(folder)) if s is not None)


class RunDir:
    """The path layout of one run directory; reads and writes nothing itself."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def pending_config_path(self) -> Path:
        """Config of a resume that has not yet passed its checks (see `promote_pending_config`)."""
        return self.root / "config.next.yaml"

    def active_config_path(self) -> Path:
        return self.pending_config_path if self.pending_config_path.exists() else self.config_path

    def promote_pending_config(self) -> None:
        if self.pending_config_path.exists():
            os.replace(self.pending_config_path, self.config_path)
            fsync_dir(self.root)

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def stages(self) -> Path:
        return self.root / "stages"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def staging(self) -> Path:
        """Where a step's dataset is assembled before it appears by one rename."""
        return self.root / ".staging"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def superseded(self) -> Path:
        """Files of earlier starts that committed nothing (`rftpipe.storage.fresh_start`)."""
        return self.root / "superseded"

    @property
    def live_lock_path(self) -> Path:
        """Every live worker holds a shared flock on it (`rftpipe.storage.fresh_start`)."""
        return self.root / ".live.lock"

    @property
    def holder_path(self) -> Path:
        """The job that runs the directory: its Slurm job id or host and pid
        (`rftpipe.run.holder`)."""
        return self.root / ".holder.json"

    @property
    def holder_lock_path(self) -> Path:
        """Flocked (exclusive) by the holding job's first rank for its whole life."""
        return self.root / ".holder.lock"

    def step_dir(self, step: int) -> Path:
        return self.stages / step_name(step)

    def stage_dir(self, step: int, stage: str) -> Path:
        return self.step_dir(step) / stage

    def manifest_path(self, step: int, stage: str) -> Path:
        return self.stage_dir(step, stage) / MANIFEST

    def shard_path(self, step: int, stage: str, rank: int) -> Path:
        return self.stage_dir(step, stage) / f"part-r{rank}.parquet"

    def trajectory_dir(self, step: int) -> Path:
        return self.trajectories / step_name(step)
