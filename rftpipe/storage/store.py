"""The run directory: its path layout, atomic files, and stage commits that know no stage names.

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

Every file is written under a temporary name, fsynced and renamed; a stage exists only
once its MANIFEST.json exists, and nothing reads a shard that no manifest lists.
`RunDir` is the layout alone; `StageStore` writes, commits, publishes, verifies and reads
stages by whatever names the pipeline gives them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from rftpipe.faults import events, fault

TRAJECTORY_SCHEMA_VERSION = "1"
RUN_LAYOUT_VERSION = 2
"""Version 2: every step directory is spelled ``step=N`` (1 mixed three spellings)."""
TMP_PREFIX = ".tmp-"
MANIFEST = "MANIFEST.json"


class CorruptionError(Exception):
    """A committed file disagrees with its manifest (missing, truncated or bad checksum)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why

    def __reduce__(self) -> tuple[type, tuple[Path, str]]:
        # DCP gathers every rank's failure to all ranks (pickled), so this must round-trip.
        return (CorruptionError, (self.path, self.why))


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "rows": self.rows,
            "bytes": self.bytes,
            "xxh3_128": self.xxh3_128,
        }


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
    verify_file(dir_ / info["file"], info)


def verify_file(path: Path, info: dict[str, Any]) -> None:
    """Raise CorruptionError unless `path` has the size and xxh3-128 that `info` records."""
    if not path.exists():
        raise CorruptionError(path, "listed in its manifest but missing")
    # The size first: a truncated file is refused without reading it.
    _check_record(path, path.stat().st_size, None, info)
    _check_record(path, info["bytes"], checksum_file(path), info)


def read_verified(path: Path, info: dict[str, Any]) -> bytes:
    """A small file's bytes, checked against its record before anyone deserializes them."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptionError(path, "listed in its manifest but missing") from None
    _check_record(path, len(data), xxhash.xxh3_128_hexdigest(data), info)
    return data


def _check_record(path: Path, size: int, digest: str | None, info: dict[str, Any]) -> None:
    if size != info["bytes"]:
        raise CorruptionError(path, f"size {size} != {info['bytes']} in the manifest (truncated?)")
    if digest is not None and digest != info["xxh3_128"]:
        raise CorruptionError(path, "checksum disagrees with the manifest")


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


class StageStore:
    """Commits, publication and reads of stages; the stage names and their order are the
    caller's (the pipeline's), never this class's."""

    def __init__(self, run: RunDir) -> None:
        self.run = run

    # -- commit markers ----------------------------------------------------------------------
    def is_committed(self, step: int, stage: str) -> bool:
        return self.run.manifest_path(step, stage).exists()

    def manifest(self, step: int, stage: str) -> dict[str, Any]:
        return read_json(self.run.manifest_path(step, stage))

    def newest_complete_step(self, final_stage: str) -> int:
        """The newest step whose final stage committed (0: none); looks at the newest only."""
        for step in reversed(list_steps(self.run.stages)):
            if self.is_committed(step, final_stage):
                return step
        return 0

    def committed_stages(self, step: int) -> list[str]:
        """Names of the committed stages of `step` (any order)."""
        d = self.run.step_dir(step)
        if not d.is_dir():
            return []
        return [s.name for s in d.iterdir() if (s / MANIFEST).exists()]

    def newest_commit(
        self, position: Callable[[str], tuple[int, ...] | None]
    ) -> tuple[int, str] | None:
        """The newest committed (step, stage): the newest step with a commit, and in it the
        stage of the highest `position` (None: a stage outside the chain, ignored)."""
        for step in reversed(list_steps(self.run.stages)):
            ranked = [(pos, s) for s in self.committed_stages(step) if (pos := position(s))]
            if ranked:
                return step, max(ranked)[1]
        return None

    # -- writing and committing ----------------------------------------------------------------
    def write_shard(
        self, step: int, stage: str, rank: int, table: pa.Table, metadata: dict[str, str]
    ) -> None:
        """Write this rank's shard plus its checksum record (still uncommitted)."""
        path = self.run.shard_path(step, stage, rank)
        info = write_parquet_atomic(path, table, metadata)
        atomic_write_json(path.with_suffix(".json"), info.as_dict())

    def commit(
        self, step: int, stage: str, world: int, extra: dict[str, Any], *, publish: bool = False
    ) -> None:
        """Write the stage manifest from every rank's checksum record (rank 0 only).

        A stage that wrote no shards commits a manifest with none. With `publish`, its
        shards become the step's dataset right after the commit (see `publish`).
        """
        d = self.run.stage_dir(step, stage)
        records = [d / f"part-r{r}.json" for r in range(world)]
        present = [p.exists() for p in records]
        if any(present) and not all(present):
            missing = [r for r, ok in enumerate(present) if not ok]
            raise RuntimeError(f"step {step} {stage}: ranks {missing} wrote no shard")
        shards = [read_json(p) for p in records] if all(present) else []
        manifest = {
            "step": step,
            "stage": stage,
            "world_size": world,
            "shards": shards,
            "published": publish,
            **extra,
        }
        fault("manifest_before_rename")
        atomic_write_json(
            self.run.manifest_path(step, stage), manifest, fault_mid="manifest_mid_write"
        )
        events().write("commit", step=step, stage=stage)
        fault("stage_after_commit")
        if publish:
            self.publish(step, stage)

    def publish(self, step: int, stage: str) -> None:
        """Make a committed stage's shards the step's dataset, all at once (a dir rename).

        The files are hard links to the committed shards (no second copy on disk; a copy
        where the file system has no hard links). Idempotent: a restart that finds the
        newest commit unpublished calls it again.
        """
        final = self.run.trajectory_dir(step)
        if final.exists():
            return
        staging = self.run.staging / step_name(step)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for info in self.manifest(step, stage)["shards"]:
            _link_or_copy(self.run.stage_dir(step, stage) / info["file"], staging / info["file"])
        fsync_dir(staging)
        self.run.trajectories.mkdir(parents=True, exist_ok=True)
        fault("publish_before_rename")
        os.replace(staging, final)
        fsync_dir(self.run.trajectories)

    def uncommit(self, step: int, stage: str) -> None:
        """Drop a stage (its manifest first, so it is never half-visible) and its dataset."""
        mp = self.run.manifest_path(step, stage)
        if mp.exists():
            published = read_json(mp).get("published", False)
            mp.unlink()
            fsync_dir(mp.parent)
            if published:
                shutil.rmtree(self.run.trajectory_dir(step), ignore_errors=True)
        shutil.rmtree(self.run.stage_dir(step, stage), ignore_errors=True)

    # -- reading and verifying -------------------------------------------------------------------
    def verify(self, step: int, stage: str) -> None:
        """Check every shard of a committed stage (and its published copy) against its manifest."""
        m = self.manifest(step, stage)
        stage_dir, published = self.run.stage_dir(step, stage), self.run.trajectory_dir(step)
        for info in m["shards"]:
            verify_shard(stage_dir, info)
            if not (m.get("published") and published.exists()):
                continue
            # The published file is normally a hard link to the shard just checked: only a
            # real copy (a file system without hard links) needs reading again.
            copy = published / info["file"]
            if not (copy.exists() and os.path.samefile(copy, stage_dir / info["file"])):
                verify_shard(published, info)

    def read(self, step: int, stage: str, rank: int) -> pa.Table:
        """One committed shard, verified against the manifest as it is read."""
        d = self.run.stage_dir(step, stage)
        info = self.manifest(step, stage)["shards"][rank]
        verify_shard(d, info)
        return pq.read_table(d / info["file"])

    def read_for(
        self, step: int, stage: str, rank: int, world: int, prompt_ids: list[int]
    ) -> pa.Table:
        """This rank's rows of a committed stage, even if it was written at another world size.

        A run resumed on fewer or more ranks re-deals the committed rows by prompt: groups
        stay whole and keep the order of this rank's prompt list.
        """
        written = self.manifest(step, stage)["world_size"]
        if written == world:
            return self.read(step, stage, rank)
        return self.read_prompts(step, stage, prompt_ids, range(written))

    def read_prompts(
        self, step: int, stage: str, prompt_ids: Sequence[int], ranks: Iterable[int]
    ) -> pa.Table:
        """The rows of `prompt_ids` found in the shards of `ranks` of a committed stage, in the
        order of `prompt_ids` (groups whole, by sample index within a group)."""
        # With no rank to read, rank 0's shard still gives the (empty) result its schema.
        table = pa.concat_tables([self.read(step, stage, r) for r in sorted(set(ranks)) or [0]])
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

    # -- cleanup -------------------------------------------------------------------------------
    def clean_uncommitted(self, final_stage: str) -> list[Path]:
        """Remove temp files and uncommitted stages; return what was removed.

        Work is bounded by what can be uncommitted, not by the run's length: temp files live
        only in the run root, the checkpoint folder, the staging folder and the stage dirs of
        steps after the newest complete one (a committed stage is never written again).
        """
        run = self.run
        removed: list[Path] = []
        folders = [run.root, run.checkpoints, run.trajectories]
        last = self.newest_complete_step(final_stage)
        # The newest complete step too: its evaluation (after its sync) may be uncommitted.
        open_steps = [s for s in list_steps(run.stages) if s >= last]
        for step in open_steps:
            for stage_dir in run.step_dir(step).iterdir():
                if not (stage_dir / MANIFEST).exists():
                    removed.append(stage_dir)
                else:
                    folders.append(stage_dir)
        for folder in folders:
            removed += [p for p in folder.glob(f"{TMP_PREFIX}*")] if folder.exists() else []
        if run.staging.exists():
            # Staged datasets are never read before their rename, and publish restages them.
            removed.append(run.staging)
        for p in removed:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return removed


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK):
            raise
        shutil.copy2(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
