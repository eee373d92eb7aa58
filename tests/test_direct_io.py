"""O_DIRECT checkpoint files: exact bytes, digests taken in flight, buffered fallback."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rftpipe.atomic import checksum_file
from rftpipe.space import NoSpace
from rftpipe.storage import direct_io
from rftpipe.storage.direct_io import CHUNK, DirectFile, VerifyingReader, storage_writer


@pytest.mark.parametrize("direct", [True, False])
def test_direct_file_writes_exact_bytes_and_digest(tmp_path: Path, direct: bool) -> None:
    rng = torch.Generator().manual_seed(0)
    # Pieces of awkward sizes cross chunk boundaries and leave an unaligned tail.
    pieces = [
        torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes()
        for n in (1, 4095, CHUNK - 7, CHUNK + 13, 3 * 4096, 17)
    ]
    path = tmp_path / "f.bin"
    f = DirectFile(path, direct)
    for p in pieces:
        assert f.write(p) == len(p)
    size = f.tell()
    f.close()
    data = b"".join(pieces)
    assert size == len(data) == path.stat().st_size
    assert path.read_bytes() == data
    assert f.digest() == checksum_file(path)


def test_pieces_follow_the_device_and_only_the_last_partial_block_is_buffered(
    tmp_path: Path, monkeypatch
) -> None:
    """Each O_DIRECT write should take about PIECE_S: pieces grow on a fast device and
    shrink on a slow one; a file's tail goes O_DIRECT but for its last partial block."""
    real_write = os.write
    sizes: list[tuple[int, bool]] = []
    delay = {"s": 0.0}

    def watched(fd, data):  # noqa: ANN001 (os.write's signature)
        sizes.append((len(data), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        time.sleep(delay["s"])
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", watched)
    data = os.urandom(3 * CHUNK + 3 * 4096 + 5)
    f = DirectFile(tmp_path / "p.bin")
    if not f.direct:
        pytest.skip("this file system refuses O_DIRECT")  # tmpfs: no pieces to size
    f.write(data[:CHUNK])
    f._wait()
    assert sizes[0][0] == direct_io.FIRST_PIECE and max(n for n, _ in sizes) > sizes[0][0]
    # Now each write takes 1.5 x PIECE_S: every piece is half the one before, to the least.
    monkeypatch.setattr(direct_io, "PIECE_S", 0.01)
    delay["s"] = 0.015
    sizes.clear()
    f.write(data[CHUNK:])
    f.close()
    assert (tmp_path / "p.bin").read_bytes() == data
    assert sizes[-1] == (5, False) and all(d for _, d in sizes[:-1]), sizes
    pieces = [n for n, _ in sizes[:-1]]
    assert pieces == sorted(pieces, reverse=True) and direct_io.MIN_PIECE in pieces, pieces


def test_an_abandoned_file_stops_at_its_next_piece(tmp_path: Path) -> None:
    abandon = threading.Event()
    f = DirectFile(tmp_path / "a.bin", abandon=abandon)
    f.write(b"a" * (CHUNK + 4096))
    f._wait()  # the first chunk is on disk
    abandon.set()
    f.write(b"b" * CHUNK)
    with pytest.raises(direct_io.Abandoned):
        f.close()
    assert (tmp_path / "a.bin").stat().st_size == CHUNK  # nothing after the abandonment


def test_refused_o_direct_falls_back_to_buffered(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def refuse_direct(path, flags, *args):  # noqa: ANN001 (os.open's signature)
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # what tmpfs and some FUSE mounts say
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    f = DirectFile(tmp_path / "g.bin")
    f.write(b"x" * 5000)
    f.close()
    assert not f.direct and (tmp_path / "g.bin").read_bytes() == b"x" * 5000


def test_failed_background_chunk_write_is_raised_to_the_writer(tmp_path: Path, monkeypatch) -> None:
    """A chunk goes to disk on a helper thread; its failure (disk full) must not be lost."""
    real_write = os.write

    def disk_full(fd, data):  # noqa: ANN001 (os.write's signature)
        if len(data) > 4096:  # a piece of a chunk, on the helper thread
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    f = DirectFile(tmp_path / "h.bin")
    with pytest.raises(OSError, match="No space left"):
        for _ in range(4):  # the second chunk waits for the first one's write
            f.write(b"y" * CHUNK)
        f.close()
    with pytest.raises(OSError, match="No space left"):
        f.write(b"z")  # nothing is appended after the hole
    f.close()  # closing after the failure releases everything and raises nothing new


def test_disk_full_inside_torch_save_is_reported_as_such(tmp_path: Path, monkeypatch) -> None:
    """torch.save swallows its file object's write error and reports a zip offset instead;
    the file system keeps the real cause for the checkpoint writer to raise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    real_write = os.write
    calls = []

    def disk_full(fd, data):  # noqa: ANN001 (os.write's signature)
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_full)
    writer, fs = storage_writer(tmp_path / "ck")
    with pytest.raises(CheckpointException, match="unexpected pos"):
        dcp.save({f"t{i}": torch.randn(3_000_000) for i in range(4)}, storage_writer=writer)
    # Named after its file (DCP pickles each rank's failure, and an OSError's name with it).
    assert isinstance(fs.write_error, NoSpace) and fs.write_error.code == 28
    assert fs.write_error.path.parent == tmp_path / "ck"


def test_dcp_through_direct_writer_round_trips_and_records_digests(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    import xxhash

    # 12 MB: two digest blocks, the second one short.
    state = {"w": torch.randn(1000, 3000), "b": torch.arange(11.0), "meta": {"step": 3}}
    writer, fs = storage_writer(tmp_path / "ck")
    dcp.save(state, storage_writer=writer)
    files = sorted((tmp_path / "ck").iterdir())
    assert {f.name for f in files} == {".metadata", "__0_0.distcp"}
    for f in files:  # every file DCP wrote, the renamed metadata included, has its digests
        d = fs.written[str(f.resolve())]
        assert (d.bytes, d.xxh3_128) == (f.stat().st_size, checksum_file(f))
        data = f.read_bytes()
        blocks = [xxhash.xxh3_64_hexdigest(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
        assert list(d.blocks_xxh3_64) == blocks
    assert len(fs.written[str(files[1].resolve())].blocks_xxh3_64) == 2
    # Loaded through the verifying reader, from the digests the writer recorded.
    listed = {Path(k).name: v.as_dict() for k, v in fs.written.items()}
    back = {"w": torch.zeros(1000, 3000), "b": torch.zeros(11), "meta": {"step": 0}}
    dcp.load(back, storage_reader=VerifyingReader(tmp_path / "ck", listed))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert back["meta"] == {"step": 3}
