"""Atomic files, manifests and leftover cleanup of the run directory."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rftpipe.atomic import CorruptionError, atomic_write_json, read_json
from rftpipe.stages import chain_position
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore


def _table(n: int = 3) -> pa.Table:
    return pa.table({"step": [1] * n, "x": list(range(n))})


def test_commit_and_read_back(tmp_path: Path) -> None:
    store = StageStore(RunDir(tmp_path))
    store.write_shard(1, "rollout", 0, _table(), {"k": "v"})
    assert not store.is_committed(1, "rollout")
    store.commit(1, "rollout", 1, {"extra": 5})
    m = store.manifest(1, "rollout")
    assert m["shards"][0]["rows"] == 3 and m["extra"] == 5
    assert store.read(1, "rollout", 0).column("x").to_pylist() == [0, 1, 2]
    assert store.newest_commit(chain_position) == (1, "rollout")
    assert (tmp_path / "stages" / "step=1" / "rollout" / "MANIFEST.json").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corruption_is_detected(tmp_path: Path, damage: str) -> None:
    run = RunDir(tmp_path)
    store = StageStore(run)
    store.write_shard(1, "score", 0, _table(50), {})
    store.commit(1, "score", 1, {})
    shard = run.shard_path(1, "score", 0)
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[:-7])
    elif damage == "flip":
        shard.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])
    else:
        shard.unlink()
    with pytest.raises(CorruptionError, match="part-r0.parquet"):
        store.read(1, "score", 0)


def test_cleanup_removes_only_uncommitted(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    store = StageStore(run)
    store.write_shard(1, "rollout", 0, _table(), {})
    store.commit(1, "rollout", 1, {})
    store.write_shard(1, "score", 0, _table(), {})  # never committed
    (run.stage_dir(1, "rollout") / ".tmp-part-r0.parquet.123").write_bytes(b"half")
    removed = store.clean_uncommitted("sync")
    assert store.is_committed(1, "rollout") and run.shard_path(1, "rollout", 0).exists()
    assert not run.stage_dir(1, "score").exists()
    assert len(removed) == 2


def test_atomic_json_never_leaves_partial_files(tmp_path: Path) -> None:
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    atomic_write_json(tmp_path / "a.json", {"x": 2})
    assert read_json(tmp_path / "a.json") == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_published_copy_is_checked_unless_it_is_the_committed_file(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    store = StageStore(run)
    store.write_shard(1, "sync", 0, _table(), {})
    store.commit(1, "sync", 1, {}, publish=True)
    published = run.trajectory_dir(1) / "part-r0.parquet"
    assert published.samefile(run.shard_path(1, "sync", 0))  # a hard link, not a copy
    store.verify(1, "sync")
    published.unlink()  # replaced by a different file: that one is read and refused
    published.write_bytes(b"not the committed rows")
    with pytest.raises(CorruptionError, match="trajectories"):
        store.verify(1, "sync")
