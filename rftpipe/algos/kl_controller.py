"""Controllers for the KL penalty coefficient (beta).

Each controller is an entry of :data:`~rftpipe.algos.variants.KL_CONTROLLERS` (its name and
settings class there) whose factory is attached here; build one with
:func:`make_kl_controller`. Their state is a plain ``{"coef": float}`` dict so it can be
checkpointed alongside the trainer.
"""

from __future__ import annotations

from typing import Protocol

from rftpipe.algos.variants import (
    KL_CONTROLLERS,
    AdaptiveKLSettings,
    FixedKLSettings,
    KLControllerSettings,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "make_kl_controller",
]

# Ziegler et al. (2019) bound the proportional error so one noisy KL estimate cannot move
# the coefficient by more than 20% of the per-horizon step.
_ERROR_CLIP = 0.2


class KLController(Protocol):
    """Interface shared by all KL coefficient controllers."""

    @property
    def coef(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, coef: float) -> None:
        self._coef = float(coef)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient never changes."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": self._coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._coef = float(state["coef"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards ``target`` (Ziegler et al. 2019).

    After each update, ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0.0:
            raise ValueError(f"target KL must be > 0, got {target}")
        if horizon <= 0.0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self._coef = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    @property
    def coef(self) -> float:
        return self._coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after ``n_steps`` samples with mean KL ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
        self._coef *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self._coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._coef = float(state["coef"])


@KL_CONTROLLERS.implements("fixed")
def _make_fixed(init_coef: float, settings: FixedKLSettings) -> KLController:
    return FixedKLController(init_coef)


@KL_CONTROLLERS.implements("adaptive")
def _make_adaptive(init_coef: float, settings: AdaptiveKLSettings) -> KLController:
    return AdaptiveKLController(init_coef, settings.target, settings.horizon)


def make_kl_controller(settings: KLControllerSettings, *, init_coef: float) -> KLController:
    """Build the controller ``settings`` selects (`kl.controller`), starting at ``init_coef``."""
    controller: KLController = KL_CONTROLLERS.function(settings)(init_coef, settings)
    return controller
