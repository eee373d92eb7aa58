"""Room for the next checkpoint, checked before it is begun.

A checkpoint that runs out of space midway costs its write and ends the run at a random
point of it; the free space of its file system, compared with what it will need, stops the
run at the stage boundary instead (`checkpoint.on_no_space=stop`, the one-line error of
`rftpipe.space`), or skips this checkpoint with a warning, an event and the metric
`checkpoint/skipped_no_space` (`skip`; the next one checks again). What it needs: the size
of the last committed checkpoint (every file its COMMITTED.json lists), or for the first,
the state's tensors as DCP writes them (each sharded tensor's shards, a replicated one
once). The older checkpoints `keep_last` retires are deleted only after it commits, so
they do not count as room.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import torch

from rftpipe.atomic import read_json
from rftpipe.checkpoint.folder import CHECKPOINT_COMMIT_FILE
from rftpipe.checkpoint.writer import Checkpoint, Stateful
from rftpipe.dist import Dist
from rftpipe.events import events
from rftpipe.space import NoSpace, free_bytes, human
from rftpipe.storage.layout import step_name

log = logging.getLogger(__name__)


def room_for(
    root: Path,
    step: int,
    done: list[Checkpoint],
    parts: dict[str, Stateful],
    dist: Dist,
    skip: bool,
) -> bool:
    """Whether checkpoint `step` fits under `root` (agreed by every rank). When it does not:
    False with `skip`, else `NoSpace` on every rank."""
    need = needed_bytes(done, parts, dist)
    free = free_bytes(root) if dist.is_main else 0
    short = int(dist.all_reduce_max(torch.tensor([int(need > free) if dist.is_main else 0]))[0])
    if not short:
        return True
    if not skip:
        raise NoSpace(root / step_name(step), errno.ENOSPC, need, collective=True)
    if dist.is_main:
        events().write("checkpoint_skipped", step=step, free=free, needed=need)
        log.warning(
            "checkpoint of step %d skipped (checkpoint.on_no_space=skip): %s needed, %s free "
            "under %s",
            step,
            human(need),
            human(free),
            root,
        )
    return False


def needed_bytes(done: list[Checkpoint], parts: dict[str, Stateful], dist: Dist) -> int:
    if done:
        files = read_json(done[-1].path / CHECKPOINT_COMMIT_FILE)["files"]
        return sum(int(f["bytes"]) for f in files.values())
    local = sum(_tensor_bytes(p.state_dict(), dist.is_main) for p in parts.values())
    return int(dist.all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64))[0])


def _tensor_bytes(value: Any, main: bool) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().nbytes  # every rank writes its own shard
    if isinstance(value, torch.Tensor):
        return value.nbytes if main else 0  # written once
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, main) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v, main) for v in value)
    return 0
