"""Training engines, and the registry of backends that `train.backend` picks from."""

from __future__ import annotations

from collections.abc import Callable

from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.fsdp2 import FSDP2Engine
from rftpipe.engines.train.single import SingleDeviceEngine


def _deepspeed_engine(*args: object, **kwargs: object) -> TrainEngine:
    # Imported on use: DeepSpeed is an optional dependency with a slow import.
    from rftpipe.engines.train.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(*args, **kwargs)


TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {
    "single": SingleDeviceEngine,
    "fsdp2": FSDP2Engine,
    "deepspeed": _deepspeed_engine,
}
