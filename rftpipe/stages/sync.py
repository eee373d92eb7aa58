"""Stage 5, sync: the rollout engine takes the weights just trained and records their version."""

from __future__ import annotations

import torch

from rftpipe.engines.rollout import RolloutEngine


def run(engine: RolloutEngine, model: torch.nn.Module, version: int) -> None:
    """After this, samples from `engine` are drawn from the step-`version` weights."""
    engine.update_weights(model, version)
