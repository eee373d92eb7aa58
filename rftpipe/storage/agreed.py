"""Writes that every rank waits for, and whose storage failure every rank meets alike.

A full file system or a spent quota (`rftpipe.space.NoSpace`) usually meets one rank first,
or only one: a shard of its own, or a file rank 0 writes for all. Alone, that rank would
say its line and exit while the others died in their next collective with a lost peer's
traceback, or each said a line of its own; agreed, every rank raises the same failure and
rank 0 says it once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rftpipe.dist import Dist
from rftpipe.space import NoSpace


def write_then_agree(
    dist: Dist, write: Callable[[], object] | None, *, main_only: bool = False
) -> None:
    """Run `write` on this rank (None, or `main_only` on another rank than 0: this rank
    writes nothing), then wait for every rank's. A write that found no space, no quota or
    no permission (`NoSpace`) on any rank is raised on every rank alike, naming the lowest
    failing rank's path, as `NoSpace.collective` (said once, by rank 0)."""
    failed: NoSpace | None = None
    if write is not None and (dist.is_main or not main_only):
        try:
            write()
        except NoSpace as exc:
            failed = exc
    if dist.world == 1:
        if failed is not None:
            raise failed
        return
    mine = None if failed is None else (str(failed.path), failed.code, failed.needed)
    said = [x for x in dist.all_gather_object(mine) if isinstance(x, tuple)]
    if said:
        path, code, needed = said[0]
        raise NoSpace(Path(path), code, needed, collective=True) from failed
