"""Read the steps a wandb run file holds (RUN/wandb/*run-*-ID/run-ID.wandb).

A SIGKILLed process loses what wandb-core had buffered, so on restart the tracker reads
which steps earlier processes really wrote and logs only the missing committed ones.
wandb >= 0.19 ships no Python reader for this transaction log: a 7-byte header (":W&B",
magic, version), then LevelDB-log framing in 32 KiB blocks (4-byte checksum, 2-byte
length, 1-byte type: full/first/middle/last) around protobuf `Record`s.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from google.protobuf.message import DecodeError

# wandb ships py.typed but no stubs for its generated protobuf modules, whose message
# classes protobuf's builder creates at import time: `Record` is invisible to mypy (Any).
from wandb.proto.wandb_internal_pb2 import Record  # type: ignore[attr-defined]

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Record]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        return []  # empty or never started
    out, pos, chunks = [], HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):
            break  # a record torn by a kill mid-write
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            chunks = payload
        elif kind == FIRST:
            chunks = payload
            continue
        elif kind == MIDDLE:
            chunks += payload
            continue
        elif kind == LAST:
            chunks += payload
        else:
            break  # zero padding at the end of a file a killed process left
        rec = Record()
        try:
            rec.ParseFromString(chunks)
        except DecodeError:
            break
        out.append(rec)
    return out


def run_id(path: Path) -> str:
    return next(r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run")


def logged_steps(wandb_dir: Path, run_id: str) -> list[int]:
    """Every `_step` that earlier processes of run `run_id` wrote, in file order."""
    steps: list[int] = []
    for f in sorted(wandb_dir.glob(f"*run-*-{run_id}/run-{run_id}.wandb")):
        steps += [int(row["_step"]) for row in history(f) if "_step" in row]
    return steps


def history(path: Path) -> list[dict]:
    """Each logged row as {key: value}, with `_step`."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") != "history":
            continue
        rows.append(
            {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        )
    return rows
