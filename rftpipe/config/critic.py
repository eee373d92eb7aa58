"""The `critic` section: the value model of actor-critic PPO, trained beside the actor with
an optimizer and LR schedule of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rftpipe.config.train import LrScheduleName


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticModelConfig:
    path: str = ""
    """Backbone weights of the value model (a local HF directory or a `builtin:` name, as
    model.path; empty: the actor's model.path). A scalar value head per token is added,
    initialised from the run seed; the dtype is model.dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticConfig:
    """The value model of actor-critic PPO (`advantage.estimator=gae`): a train engine of
    the actor's backend (`train.backend`, micro-batching, epochs and mini-batches as the
    actor) with its own AdamW, LR and schedule, checkpointed with the actor."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model's backbone."""

    lr: float = 1e-5
    """Peak learning rate of the critic's AdamW."""

    lr_schedule: LrScheduleName = "constant"
    """Decay after the critic's LR warm-up, over the run's optimizer steps."""

    lr_warmup_steps: int = 0
    """Linear LR warm-up of the critic, in optimizer steps."""

    weight_decay: float = 0.0
    """AdamW weight decay of the critic (matrices only, as the actor)."""

    grad_clip: float = 1.0
    """Clip the critic's global gradient norm to this (0: off)."""

    cliprange_value: float = 0.5
    """A value prediction may move at most this far from the one the step's returns were
    built with before its loss stops rewarding the move (PPO's clipped value loss)."""

    loss_coef: float = 0.5
    """Weight of the value loss (the critic has its own optimizer, so this only scales its
    gradients against `grad_clip` and AdamW's epsilon)."""

    warmup_steps: int = 0
    """During the first this many steps only the critic is trained; the actor is not
    updated, so the value model fits the initial policy before its advantages steer it."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}")
        if not (math.isfinite(self.loss_coef) and self.loss_coef > 0):
            raise ValueError(f"loss_coef must be a finite number > 0, got {self.loss_coef}")
        if self.warmup_steps < 0 or self.lr_warmup_steps < 0:
            raise ValueError("warmup_steps and lr_warmup_steps must be >= 0")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip and weight_decay must be >= 0")
