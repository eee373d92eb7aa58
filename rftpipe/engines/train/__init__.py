"""Training engines, and the registry of backends that `train.backend` picks from."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.train.base import Role, TrainEngine
from rftpipe.engines.train.fsdp2 import FSDP2Engine
from rftpipe.engines.train.single import SingleDeviceEngine


def _deepspeed_engine(
    model: torch.nn.Module,
    cfg: TrainConfig,
    dist: Dist,
    *,
    role: Role = "actor",
    total_updates: int = 0,
) -> TrainEngine:
    # Imported on use: DeepSpeed is an optional dependency with a slow import.
    from rftpipe.engines.train.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(model, cfg, dist, role=role, total_updates=total_updates)


TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {
    "single": SingleDeviceEngine,
    "fsdp2": FSDP2Engine,
    "deepspeed": _deepspeed_engine,
}
