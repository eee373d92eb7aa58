"""Stage 5, sync: the rollout engine takes the weights just trained and records their version."""

from __future__ import annotations

from rftpipe.engines.rollout import RolloutEngine
from rftpipe.engines.train import TrainEngine


def run(engine: RolloutEngine, trainer: TrainEngine, version: int) -> None:
    """After this, samples from `engine` are drawn from the step-`version` weights.

    Collective under FSDP2 (the full weights are gathered), so every rank calls it.
    """
    engine.update_weights(trainer.rollout_weights(), version)
