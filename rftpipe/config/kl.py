"""The `kl` section: where the KL to the reference model enters the update, its estimator,
and the controller of its coefficient (variants of ``rftpipe.algos.variants``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rftpipe.algos.variants import (
    KL_CONTROLLERS,
    FixedKLSettings,
    K3Settings,
    KLControllerSettings,
    KLEstimatorSettings,
)
from rftpipe.config.loader import MovedKey


@dataclass(frozen=True, kw_only=True, slots=True)
class KLConfig:
    mode: Literal["none", "loss", "reward"] = "none"
    """Where the KL to the reference enters: nowhere, as a loss term, or as a per-token reward penalty."""

    estimator: KLEstimatorSettings = field(default_factory=K3Settings)
    """KL estimator: its name (`k3`), or a mapping of its `type` (`{type: k3}`); see
    "Variants" below."""

    coef: float = 0.0
    """Initial KL coefficient beta."""

    controller: KLControllerSettings = field(
        default_factory=FixedKLSettings,
        # Until issue 22 flat kl settings, read by the adaptive controller.
        metadata={"moved": {"target": MovedKey("target"), "horizon": MovedKey("horizon")}},
    )
    """How the coefficient moves: its name (`fixed`), or a mapping of its `type` and settings
    (`{type: adaptive, target: 0.1, horizon: 10000}`); see "Variants" below."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")
        controller = KL_CONTROLLERS.of(self.controller)
        if self.mode != "none" and self.coef == 0 and not controller.traits.adapts:
            raise ValueError(
                f"mode is '{self.mode}' but coef is 0 with controller={controller.name}"
            )
