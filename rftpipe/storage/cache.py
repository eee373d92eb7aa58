"""This machine's cache between runs: what any run may rebuild, kept so that the next
process need not (built models, generated task data). Never part of a run's state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """`$RFTPIPE_CACHE/<kind>`, by default `~/.cache/rftpipe/<kind>`."""
    return Path(os.environ.get("RFTPIPE_CACHE", Path.home() / ".cache" / "rftpipe")) / kind
