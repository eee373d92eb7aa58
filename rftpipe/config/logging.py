"""The `logging` section: the progress bar, the library logger's level, and the metric
trackers (wandb, TensorBoard)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    wandb: Literal["auto", "offline", "online", "off"] = "auto"
    """auto: online if WANDB_API_KEY is set, else offline."""

    wandb_project: str = "rftpipe"
    """wandb project name."""

    tensorboard: bool = True
    """Write TensorBoard event files to RUN/tensorboard (resumed in place after a requeue)."""

    progress: bool = True
    """Show a progress bar per step on rank 0."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the library logger."""
