"""Sampling seeds derived from (run seed, step, stage, prompt id).

Never from rank or batch position: a re-run stage reproduces its rows, a group's tokens
do not depend on the world size, and a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, step: int, stage: str, key: int | str) -> int:
    """A 63-bit seed, stable across Python processes (unlike hash())."""
    text = f"{run_seed}/{step}/{stage}/{key}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)


def sample_seed(group_seed: int, sample_idx: int) -> int:
    """The seed of one sample of a group, for engines that seed every sample on its own:
    a function of its group's seed (itself from run seed, step, stage and prompt id) and
    its index only, so it cannot depend on which requests share its batch."""
    return derive_seed(group_seed, 0, "sample", sample_idx)
