"""The chain of durable stages a step runs, in order (`rftpipe.run.driver` runs it).

A step is one or more generation rounds (rollout, score), then advantage, train and sync;
the held-out evaluation follows sync only on the steps `eval.due` names.
"""

from __future__ import annotations

from rftpipe.stages import GENERATION, ORDER
from rftpipe.stages.advantage import AdvantageStage
from rftpipe.stages.base import Stage
from rftpipe.stages.evaluation import EvalStage
from rftpipe.stages.rollout import RolloutStage
from rftpipe.stages.score import ScoreStage
from rftpipe.stages.sync import SyncStage
from rftpipe.stages.train import TrainStage

EVAL = EvalStage()
"""Not in PIPELINE: the driver runs it only on the steps `eval.due` names."""


def generation_round(r: int) -> tuple[Stage, ...]:
    """The stages of generation round `r` of a step (round 0: the pipeline's first two)."""
    return (RolloutStage(round=r), ScoreStage(round=r))


TRAINING: tuple[Stage, ...] = (AdvantageStage(), TrainStage())
"""The stages that use the trainer's weights, not the rollout engine's."""
SYNC = SyncStage()
AFTER_GENERATION: tuple[Stage, ...] = (*TRAINING, SYNC)
"""The stages that run once per step, on the groups the generation rounds kept."""

PIPELINE: tuple[Stage, ...] = (*generation_round(0), *AFTER_GENERATION)
assert tuple(s.name for s in PIPELINE) == ORDER
assert tuple(s.name for s in generation_round(0)) == GENERATION
