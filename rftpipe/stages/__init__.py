"""The five stages of a step (and the held-out evaluation), one module each with one public `run`.

`ORDER` is the pipeline's order of stage names; the last one marks a step complete. It lives
here, free of torch, so that launch tools (``jobs.status``) and the run-directory tools can
read progress without importing the stages themselves.
"""

from __future__ import annotations

import re
from typing import Literal

StageName = Literal["rollout", "score", "advantage", "train", "sync", "eval"]
ORDER: tuple[StageName, ...] = ("rollout", "score", "advantage", "train", "sync")
FINAL: StageName = ORDER[-1]
# `eval` follows sync on the steps `eval.due` names; it is not part of a step's chain (a
# step is complete at sync), so a restart that finds it missing runs it on its own.

GENERATION: tuple[StageName, ...] = ("rollout", "score")
"""The stages a generation round repeats (DAPO's dynamic sampling, `rftpipe.stages.generation`)."""

_ROUND = re.compile(r"^(rollout|score)\.r([1-9][0-9]*)$")


def round_stage(stage: StageName, r: int) -> str:
    """The directory of generation stage `stage` in round `r` of a step: round 0 is the
    stage itself (so a run without dynamic sampling has exactly the five stages), round
    r > 0 is ``STAGE.rR`` beside it."""
    return stage if r == 0 else f"{stage}.r{r}"


def chain_position(name: str) -> tuple[int, int, int] | None:
    """Where a stage directory's name sits in a step's chain of commits, for ordering
    (None: not part of the chain, e.g. `eval`). Generation rounds come first, in round
    order, then the stages after generation."""
    if m := _ROUND.match(name):
        return (0, int(m.group(2)), GENERATION.index(m.group(1)))
    if name in GENERATION:
        return (0, 0, GENERATION.index(name))
    if name in ORDER:
        return (1, 0, ORDER.index(name))
    return None
