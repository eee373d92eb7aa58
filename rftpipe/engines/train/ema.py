"""An exponential moving average of the actor's parameters (`train.ema_decay`).

After every optimizer step, ``ema = decay * ema + (1 - decay) * param`` for every trainable
parameter, from the initial weights. The average lives next to the parameters it follows:
on the actor's device, and under FSDP2 as DTensors sharded like them (each rank averages
its own shard, so the update needs no communication). It is a checkpoint part of its own
(`rftpipe.run.driver.stateful_parts`), written and resharded by DCP like the actor's weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class ParameterEMA:
    """Stateful EMA of a module's trainable parameters, by parameter name.

    >>> lin = torch.nn.Linear(1, 1, bias=False)
    >>> with torch.no_grad():
    ...     _ = lin.weight.fill_(1.0)
    >>> ema = ParameterEMA(lin, decay=0.5)
    >>> with torch.no_grad():
    ...     _ = lin.weight.fill_(3.0)
    >>> ema.update()
    >>> ema.params["weight"].item()
    2.0
    """

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self._live = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # clone, not a view: the optimizer changes the parameters in place.
        self.params: dict[str, torch.Tensor] = {
            n: p.detach().clone() for n, p in self._live.items()
        }
        """Name -> the average (a DTensor under FSDP2, placed like its parameter)."""

    @torch.no_grad()
    def update(self) -> None:
        """Fold the parameters' current values in (after an optimizer step)."""
        for name, avg in self.params.items():
            # Elementwise on each shard: bitwise repeatable on any thread count and on a
            # replay, so a resumed run's average equals an uninterrupted one's.
            avg.mul_(self.decay).add_(self._live[name].detach(), alpha=1.0 - self.decay)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The averages themselves (views that DCP saves and loads into in place)."""
        return {"params": self.params}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if "params" not in state:
            return
        with torch.no_grad():
            for name, value in state["params"].items():
                if value is not self.params[name]:  # DCP loaded in place already
                    self.params[name].copy_(value)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Unsharded averages on every rank (collective under FSDP2)."""
        return {
            name: avg.full_tensor() if isinstance(avg, DTensor) else avg
            for name, avg in self.params.items()
        }
