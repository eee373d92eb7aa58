"""A full disk told apart from other failures (`rftpipe.space`). /dev/full answers every
write with a real ENOSPC (only plain writes go to it: a library that writes by replacing the
file would replace the device, as root). The libraries' own ENOSPC (pyarrow's, DCP's, on a
real full file system) and whole runs are in tests/test_full_disk.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rftpipe.atomic import atomic_write_json, write_parquet_atomic
from rftpipe.space import NoSpace, human, no_space_in, writing

FULL = Path("/dev/full")


def _plain_write() -> None:
    with open(FULL, "wb") as f:
        f.write(b"x" * 65536)
        f.flush()


def test_a_real_enospc_is_named_as_no_space() -> None:
    with pytest.raises(OSError) as caught:
        _plain_write()
    assert no_space_in(caught.value) == (errno.ENOSPC, None)
    with pytest.raises(NoSpace) as named, writing(Path("/run/x/model.safetensors")):
        _plain_write()
    line = str(named.value)
    assert line.startswith("no space left on device writing /run/x/model.safetensors: ")
    assert "\n" not in line and " bytes" in line and "free on its file system" in line


def test_a_library_that_kept_only_the_message_is_read_by_it() -> None:
    # safetensors raises SafetensorError("... No space left on device (os error 28)").
    assert no_space_in(
        RuntimeError("Error while serializing: IoError(Os { code: 28 }) (os error 28)")
    ) == (errno.ENOSPC, None)
    assert no_space_in(RuntimeError("write failed: Disk quota exceeded")) == (errno.EDQUOT, None)


def test_other_failures_are_not_no_space(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), writing(tmp_path / "x"):
        open(tmp_path / "missing" / "x")  # noqa: SIM115
    assert no_space_in(RuntimeError("checkpoint write failed: boom")) is None
    wrapped = RuntimeError("checkpoint write failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded", "/q/f")
    assert no_space_in(wrapped) == (errno.EDQUOT, "/q/f")


def test_a_spent_quota_at_a_write_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RFTPIPE_FAULT_QUOTA", "MANIFEST.json")
    with pytest.raises(NoSpace, match=r"disk quota exceeded writing .*MANIFEST\.json: \d+ bytes"):
        atomic_write_json(tmp_path / "s" / "MANIFEST.json", {"a": 1})
    atomic_write_json(tmp_path / "s" / "other.json", {"a": 1})  # not armed
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["other.json"]


def test_a_shard_that_fails_midway_deletes_its_own_file(tmp_path, monkeypatch) -> None:
    """pyarrow fails after it opened the temporary file: that file goes, nothing else."""
    keep = tmp_path / "part-r1.parquet"
    keep.write_bytes(b"committed")

    def full(table, where, **kw) -> None:
        Path(where).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(NoSpace, match="part-r0.parquet"):
        write_parquet_atomic(tmp_path / "part-r0.parquet", pa.table({"a": [1]}), {})
    assert [p.name for p in tmp_path.iterdir()] == ["part-r1.parquet"]


def test_human_sizes() -> None:
    assert human(5) == "5 bytes"
    assert human(1536) == "1536 bytes (1.5 KiB)"
    assert human(85 << 30) == "91268055040 bytes (85.0 GiB)"
