"""Stage commits that know no stage names: write, commit, publish, verify and read stages.

A stage exists only once its MANIFEST.json exists, and nothing reads a shard that no
manifest lists. `StageStore` writes, commits, publishes, verifies and reads stages by
whatever names the pipeline gives them; the paths are `rftpipe.storage.layout.RunDir`'s.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rftpipe.atomic import (
    TMP_PREFIX,
    atomic_write_json,
    fsync_dir,
    read_json,
    verify_shard,
    write_parquet_atomic,
)
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.space import writing
from rftpipe.storage.branch_rows import BRANCH
from rftpipe.storage.layout import MANIFEST, RunDir, list_steps, step_name

if TYPE_CHECKING:
    import pyarrow as pa


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
        with writing(staging):  # links need directory blocks, a copy needs the bytes
            staging.mkdir(parents=True)
            for info in self.manifest(step, stage)["shards"]:
                _link_or_copy(
                    self.run.stage_dir(step, stage) / info["file"], staging / info["file"]
                )
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

    def shard_files(self, step: int, stage: str) -> list[Path]:
        """The shard files a committed stage's manifest lists, in rank order."""
        d = self.run.stage_dir(step, stage)
        return [d / info["file"] for info in self.manifest(step, stage)["shards"]]

    def read(self, step: int, stage: str, rank: int) -> pa.Table:
        """One committed shard, verified against the manifest as it is read."""
        d = self.run.stage_dir(step, stage)
        info = self.manifest(step, stage)["shards"][rank]
        verify_shard(d, info)
        import pyarrow.parquet as pq  # not at import: `jobs.submit` reads this module

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
        import pyarrow as pa

        # With no rank to read, rank 0's shard still gives the (empty) result its schema.
        table = pa.concat_tables([self.read(step, stage, r) for r in sorted(set(ranks)) or [0]])
        order = {pid: i for i, pid in enumerate(prompt_ids)}
        # An agent episode's sequences stay in branch order (`storage.branch_rows`).
        branch = (
            table.column(BRANCH).to_pylist()
            if BRANCH in table.column_names
            else [0] * table.num_rows
        )
        keys = [
            (order.get(p, -1), k, b)
            for p, k, b in zip(
                table.column("prompt_id").to_pylist(),
                table.column("sample_idx").to_pylist(),
                branch,
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
