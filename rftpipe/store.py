"""The run directory: atomic files, stage manifests and the published trajectory dataset.

Layout (one shard per rank, ``K`` = rank)::

    RUN/config.yaml                         resolved config (resume-safe keys may change)
    RUN/config.next.yaml                    a resume's config until its checks pass
    RUN/run.json                            fingerprints of config, model and data
    RUN/stages/step=N/STAGE/part-rK.parquet a stage's rows from rank K
    RUN/stages/step=N/STAGE/part-rK.json    that shard's row count and checksum
    RUN/stages/step=N/STAGE/MANIFEST.json   the commit marker: all shards, checksums, weights
    RUN/trajectories/step=N/part-rK.parquet the user-facing dataset (appears by dir rename)
    RUN/checkpoints/step-N/                 see rftpipe.checkpoint
    RUN/events.jsonl, RUN/metrics.jsonl     diagnostics and per-step metrics

Every file is written under a temporary name, fsynced and renamed; a stage exists only
once its MANIFEST.json exists, and nothing reads a shard that no manifest lists.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from rftpipe.faults import events, fault

Stage = Literal["rollout", "score", "advantage", "train", "sync"]
STAGES: tuple[Stage, ...] = ("rollout", "score", "advantage", "train", "sync")
#: Stages that write Parquet shards under their stage dir; train commits only its manifest,
#: and sync's shards are the published trajectory files.
SHARDED: tuple[Stage, ...] = ("rollout", "score", "advantage")
TRAJECTORY_SCHEMA_VERSION = "1"
TMP_PREFIX = ".tmp-"


class CorruptionError(Exception):
    """A committed file disagrees with its manifest (missing, truncated or bad checksum)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum_file(path: Path) -> str:
    """xxh3-128 of the file: an integrity check (not a security one) at ~15 GB/s, so
    verifying a multi-GB checkpoint costs a fraction of a second instead of seconds."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes, *, fault_mid: str | None = None) -> None:
    """Write `data` to `path` so that readers see either nothing or all of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        if fault_mid:
            # Half the bytes reach the disk before an armed fault kills us.
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            fault(fault_mid)
            f.write(data[len(data) // 2 :])
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, fault_mid: str | None = None) -> None:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, fault_mid=fault_mid)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo:
    """What a manifest records of one shard."""

    file: str
    rows: int
    bytes: int
    xxh3_128: str


def write_parquet_atomic(path: Path, table: pa.Table, metadata: dict[str, str]) -> ShardInfo:
    """Write one Parquet shard atomically and return its checksum record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    meta = dict(table.schema.metadata or {})
    meta.update({k.encode(): v.encode() for k, v in metadata.items()})
    pq.write_table(table.replace_schema_metadata(meta), tmp, compression="zstd")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    info = ShardInfo(
        file=path.name, rows=table.num_rows, bytes=tmp.stat().st_size, xxh3_128=checksum_file(tmp)
    )
    fault("shard_before_rename")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    fault("shard_after_rename")
    return info


def verify_shard(dir_: Path, info: dict[str, Any]) -> None:
    """Raise CorruptionError unless the shard matches its manifest entry."""
    path = dir_ / info["file"]
    if not path.exists():
        raise CorruptionError(path, "listed in the manifest but missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CorruptionError(path, f"size {size} != {info['bytes']} in the manifest (truncated?)")
    if checksum_file(path) != info["xxh3_128"]:
        raise CorruptionError(path, "checksum disagrees with the manifest")


class RunDir:
    """Paths and commit markers of one run directory."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()

    # -- paths -------------------------------------------------------------------------------
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
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    def stage_dir(self, step: int, stage: Stage) -> Path:
        return self.root / "stages" / f"step={step:06d}" / stage

    def manifest_path(self, step: int, stage: Stage) -> Path:
        return self.stage_dir(step, stage) / "MANIFEST.json"

    def shard_path(self, step: int, stage: Stage, rank: int) -> Path:
        return self.stage_dir(step, stage) / f"part-r{rank}.parquet"

    def trajectory_dir(self, step: int) -> Path:
        return self.trajectories / f"step={step}"

    # -- commit markers ----------------------------------------------------------------------
    def is_committed(self, step: int, stage: Stage) -> bool:
        return self.manifest_path(step, stage).exists()

    def manifest(self, step: int, stage: Stage) -> dict[str, Any]:
        return read_json(self.manifest_path(step, stage))

    def committed_steps(self) -> list[int]:
        """Steps whose sync stage committed (the step is complete)."""
        root = self.root / "stages"
        if not root.exists():
            return []
        steps = [int(p.name.split("=")[1]) for p in root.glob("step=*")]
        return sorted(s for s in steps if self.is_committed(s, "sync"))

    def last_commit(self) -> tuple[int, Stage] | None:
        """The newest committed (step, stage), in pipeline order."""
        root = self.root / "stages"
        if not root.exists():
            return None
        steps = sorted((int(p.name.split("=")[1]) for p in root.glob("step=*")), reverse=True)
        for step in steps:
            for stage in reversed(STAGES):
                if self.is_committed(step, stage):
                    return step, stage
        return None

    # -- commit --------------------------------------------------------------------------------
    def write_shard(
        self, step: int, stage: Stage, rank: int, table: pa.Table, metadata: dict[str, str]
    ) -> None:
        """Write this rank's shard plus its checksum record (still uncommitted)."""
        path = self.shard_path(step, stage, rank)
        info = write_parquet_atomic(path, table, metadata)
        atomic_write_json(path.with_suffix(".json"), _shard_dict(info))

    def commit_stage(self, step: int, stage: Stage, world: int, extra: dict[str, Any]) -> None:
        """Write the stage manifest from every rank's checksum record (rank 0 only)."""
        d = self.stage_dir(step, stage)
        shards = (
            [read_json(d / f"part-r{r}.json") for r in range(world)] if stage != "train" else []
        )
        manifest = {"step": step, "stage": stage, "world_size": world, "shards": shards, **extra}
        fault("manifest_before_rename")
        atomic_write_json(self.manifest_path(step, stage), manifest, fault_mid="manifest_mid_write")
        events().write("commit", step=step, stage=stage)
        fault("stage_after_commit")

    def read_stage(self, step: int, stage: Stage, rank: int) -> pa.Table:
        """Read this rank's committed shard, verifying it against the manifest."""
        m = self.manifest(step, stage)
        d = self.stage_dir(step, stage)
        info = m["shards"][rank]
        verify_shard(d, info)
        return pq.read_table(d / info["file"])

    def read_stage_for(
        self, step: int, stage: Stage, rank: int, world: int, prompt_ids: list[int]
    ) -> pa.Table:
        """This rank's rows of a committed stage, even if it was written at another world size.

        A run resumed on fewer or more ranks re-deals the committed rows by prompt: groups
        stay whole and keep the order of this rank's prompt list.
        """
        if self.manifest(step, stage)["world_size"] == world:
            return self.read_stage(step, stage, rank)
        m = self.manifest(step, stage)
        tables = [self.read_stage(step, stage, r) for r in range(m["world_size"])]
        table = pa.concat_tables(tables)
        order = {pid: i for i, pid in enumerate(prompt_ids)}
        keys = [
            (order.get(p, -1), k)
            for p, k in zip(
                table.column("prompt_id").to_pylist(),
                table.column("sample_idx").to_pylist(),
                strict=True,
            )
        ]
        idx = sorted((i for i, key in enumerate(keys) if key[0] >= 0), key=lambda i: keys[i])
        return table.take(pa.array(idx, pa.int64()))

    def verify_stage(self, step: int, stage: Stage) -> None:
        m = self.manifest(step, stage)
        for info in m["shards"]:
            verify_shard(self.stage_dir(step, stage), info)

    def uncommit_stage(self, step: int, stage: Stage) -> None:
        """Drop a stage (its manifest first, so it is never half-visible)."""
        mp = self.manifest_path(step, stage)
        if mp.exists():
            mp.unlink()
            fsync_dir(mp.parent)
        shutil.rmtree(self.stage_dir(step, stage), ignore_errors=True)
        if stage == "sync":
            shutil.rmtree(self.trajectory_dir(step), ignore_errors=True)

    # -- trajectories --------------------------------------------------------------------------
    def staging_dir(self, step: int) -> Path:
        return self.root / ".staging" / f"trajectories-step={step}"

    def publish_trajectories(self, step: int, world: int) -> None:
        """Make step N's trajectory files visible at once by renaming their directory."""
        final = self.trajectory_dir(step)
        staging = self.staging_dir(step)
        for r in range(world):
            if not (staging / f"part-r{r}.parquet").exists():
                raise RuntimeError(f"rank {r} did not stage its trajectories for step {step}")
        if final.exists():
            # Killed after the rename but before the sync commit: the rows are the same
            # (derived seeds), so only a file that differs from the new manifest is swapped.
            for f in staging.iterdir():
                info = read_json(self.stage_dir(step, "sync") / f.with_suffix(".json").name)
                dst = final / f.name
                if not dst.exists() or checksum_file(dst) != info["xxh3_128"]:
                    os.replace(f, dst)
            shutil.rmtree(staging)
            return
        self.trajectories.mkdir(parents=True, exist_ok=True)
        fault("publish_before_rename")
        os.replace(staging, final)
        fsync_dir(self.trajectories)

    def stage_trajectories(
        self, step: int, rank: int, table: pa.Table, metadata: dict[str, str]
    ) -> None:
        """Write this rank's trajectory file into the staging dir (published by rename).

        `step` is left out of the file: it is the hive partition key of the directory, and
        a column of the same name would make pandas and pyarrow refuse to read the dataset.
        """
        path = self.staging_dir(step) / f"part-r{rank}.parquet"
        info = write_parquet_atomic(path, table.drop_columns(["step"]), metadata)
        atomic_write_json(self.stage_dir(step, "sync") / f"part-r{rank}.json", _shard_dict(info))

    # -- cleanup -------------------------------------------------------------------------------
    def clean_uncommitted(self) -> list[Path]:
        """Remove temp files and shards of uncommitted stages; return what was removed."""
        removed: list[Path] = []
        for tmp in self.root.rglob(f"{TMP_PREFIX}*"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
        root = self.root / "stages"
        for step_dir in sorted(root.glob("step=*")) if root.exists() else []:
            for stage_dir in step_dir.iterdir():
                if stage_dir.is_dir() and not (stage_dir / "MANIFEST.json").exists():
                    shutil.rmtree(stage_dir)
                    removed.append(stage_dir)
        staging = self.root / ".staging"
        if staging.exists():
            # Staged trajectories are never read before publishing, and sync re-stages them.
            removed.append(staging)
            shutil.rmtree(staging)
        return removed


def _shard_dict(info: ShardInfo) -> dict[str, Any]:
    return {"file": info.file, "rows": info.rows, "bytes": info.bytes, "xxh3_128": info.xxh3_128}
