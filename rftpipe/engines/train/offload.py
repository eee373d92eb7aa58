"""Moving an actor's optimizer state to host memory between train stages
(`train.offload_between_stages`).

The train stage is the only one that reads AdamW's moments (and, under DeepSpeed, the fp32
master partitions), yet they hold two to three times the parameters' bytes on the device
through rollout, scoring and advantages. An engine with the option on moves them to a
separate host copy when its `train_mode()` ends and back to fresh device tensors when the
next `train_mode()` begins. The copies are plain `copy_`s, so the state that comes back is
bitwise the state that left, and the next update equals one without offload.

On a CPU-only machine the "device" is the host too: the same code still makes a separate
host copy and, on the way back, a fresh one, so what runs (and what the tests check) is the
real movement; only the memory it frees is the same memory.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass(slots=True)
class OffloadRecord:
    """What the engine's last offload and reload moved, for the train stage's metrics."""

    bytes: int = 0
    """Bytes the last offload copied to host memory (this rank's shards)."""
    offload_s: float = 0.0
    """Seconds the last offload took."""
    reload_s: float = 0.0
    """Seconds the last reload took (0 before the first one)."""


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` with `t`'s values, layout and, for a DTensor, placement."""
    if isinstance(t, DTensor):
        local = _copy_to(t._local_tensor, device)
        # As FSDP2 builds its CPU-offloaded shards: `DTensor.from_local` would move a host
        # tensor back to the mesh's device.
        return DTensor(local, t._spec, requires_grad=False)  # type: ignore[call-arg]
    # Pinned host pages make the copy back a DMA; they exist only with CUDA.
    pin = device.type == "cpu" and t.device.type == "cuda"
    out = torch.empty_like(t, device=device, pin_memory=pin)
    out.copy_(t)
    return out


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard, for a DTensor)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def move_state(state: MutableMapping[Any, dict[str, Any]], device: torch.device) -> int:
    """Replace every tensor of an optimizer's per-parameter state with a copy on `device`
    (the old tensors are freed with their last reference); returns the bytes copied."""
    moved = 0
    for per_param in state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                per_param[key] = _copy_to(value, device)
                moved += local_bytes(value)
    return moved


def move_data(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Move each tensor's storage to a copy on `device` in place (`.data`), keeping the
    tensor objects, which other structures hold (DeepSpeed's flat partitions are the keys
    of its optimizer's state and the params of its param groups); returns the bytes."""
    moved = 0
    for t in tensors:
        t.data = _copy_to(t.data, device)
        moved += local_bytes(t)
    return moved
