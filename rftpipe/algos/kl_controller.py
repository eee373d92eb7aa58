"""Controllers for the KL penalty coefficient (beta).

Controllers are looked up by name in :data:`KL_CONTROLLERS`; build one with
:func:`make_kl_controller`. Their state is a plain ``{"coef": float}`` dict so it can be
checkpointed alongside the trainer.
"""

from __future__ import annotations

from typing import Protocol

# The names live in the torch-free `variants` module so the config schema can import them.
from rftpipe.algos.variants import KLControllerName

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "KLControllerName",
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


def _make_fixed(*, init_coef: float, target: float, horizon: float) -> KLController:
    # target and horizon only matter to adaptive control; accepted for a uniform signature.
    return FixedKLController(init_coef)


def _make_adaptive(*, init_coef: float, target: float, horizon: float) -> KLController:
    return AdaptiveKLController(init_coef, target, horizon)


class KLControllerFactory(Protocol):
    """Signature shared by all entries of :data:`KL_CONTROLLERS`."""

    def __call__(self, *, init_coef: float, target: float, horizon: float) -> KLController: ...


KL_CONTROLLERS: dict[KLControllerName, KLControllerFactory] = {
    "fixed": _make_fixed,
    "adaptive": _make_adaptive,
}


def make_kl_controller(
    name: KLControllerName, *, init_coef: float, target: float, horizon: float
) -> KLController:
    """Build the controller registered under ``name`` (``target``/``horizon`` unused by fixed)."""
    if name not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {name!r}; known: {list(KL_CONTROLLERS)}")
    return KL_CONTROLLERS[name](init_coef=init_coef, target=target, horizon=horizon)
