"""The HF loop's decode batch: which of a call's rows it still feeds, and when ended rows
leave it (`rollout.compact_decode`).

A row that ended (EOS, a stop string, its own limit) would otherwise be fed a pad at every
decode step until the call's last row ends. Leaving costs one exact row selection of the
KV cache (each kept row's values copied, unchanged); staying costs that row's share of
every later decode forward. Measured on SmolLM2-135M in float32 on the 2-core development
machine (2026-12-02, `python -m tools.bench decode_batch --costs`): a decode forward over a
64-position cache took 414 ms for 48 rows, 328 ms for 24, 263 ms for 4 (a fixed part for
the weights plus a few ms a row), while selecting 36 of the 48 rows took 12 ms (55 ms at
256 positions). So a selection pays for itself within about two decode forwards once an
eighth of the batch has ended: `AUTO` selects then, not at each row's end (a copy per
row would cost more than the row saves near the call's end).

The kept rows' logits are not always bitwise those of the larger batch: the CPU matmul
kernels block a batch of M rows differently for different M (SmolLM2: up to 4e-5 in a
logit; the tiny test model: up to 3e-7), so a sampled token whose draw falls that close
to a boundary of its cumulative distribution can differ (docs/engines.md states the bound
tests/test_decode_batch.py checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass(frozen=True, slots=True)
class CompactRule:
    """When ended rows leave the decode batch: once they are at least `min_ended` of its
    rows (and at least one)."""

    min_ended: float

    def due(self, ended: int, batch: int) -> bool:
        return ended > 0 and ended >= self.min_ended * batch


AUTO = CompactRule(1 / 8)
"""`rollout.compact_decode=auto` (see the module docstring for why an eighth)."""
EVERY = CompactRule(0.0)
"""Each ended row leaves at once (tests: the most selections)."""
STATIC = CompactRule(math.inf)
"""No row leaves: the static batch, with each row's own draws (tests compare against it)."""


@dataclass(kw_only=True)
class DecodeBatch:
    """A call's rows in the decode batch, with the cache, attention mask and positions of
    those rows. `hold`: the width of a kept session cache (`HFGenerateEngine._continue`):
    rows that leave keep their first `hold` positions aside, and `restore` puts every row
    back in the call's order, cropped to `hold`, as the static batch's cache would be."""

    cache: DynamicCache
    mask: torch.Tensor
    pos: torch.Tensor
    rows: torch.Tensor
    """(batch,): the call's index of each row in the batch, ascending."""
    hold: int | None = None
    forwards: int = 0
    """Decode forwards run."""
    row_steps: int = 0
    """Rows fed over those forwards (the static batch feeds every row at each)."""
    _parked: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = field(
        default_factory=list
    )
    _size: int = 0

    def __post_init__(self) -> None:
        self._size = int(self.rows.numel())

    @classmethod
    def of(
        cls, cache: DynamicCache, mask: torch.Tensor, pos: torch.Tensor, hold: int | None
    ) -> DecodeBatch:
        rows = torch.arange(mask.shape[0], device=mask.device)
        return cls(cache=cache, mask=mask, pos=pos, rows=rows, hold=hold)

    def can_leave(self) -> bool:
        """Whether rows can leave: a kept session cache is put back layer by layer, which
        only plain `DynamicLayer`s (no sliding window, no linear attention) allow."""
        return self.hold is None or all(type(x) is DynamicLayer for x in self.cache.layers)

    def _held(self) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
        """Each layer of a held cache (plain `DynamicLayer`s, see `can_leave`) with its
        keys and values."""
        out = []
        for layer in self.cache.layers:
            x = cast(DynamicLayer, layer)
            assert x.keys is not None and x.values is not None, "a prefilled cache"
            out.append((x, x.keys, x.values))
        return out

    def leave(self, keep: torch.Tensor) -> None:
        """Keep the batch rows where `keep` (bool, (batch,)) holds; the others leave."""
        idx = keep.nonzero().flatten()
        if self.hold is not None:
            gone = (~keep).nonzero().flatten()
            h = self.hold
            held = [(k[gone, :, :h].clone(), v[gone, :, :h].clone()) for _, k, v in self._held()]
            self._parked.append((self.rows[gone], held))
        self.cache.batch_select_indices(idx)
        self.mask, self.pos, self.rows = self.mask[idx], self.pos[idx], self.rows[idx]

    def advance(self) -> None:
        """Before a decode forward: extend the mask and positions by one token, and count
        the forward and its rows."""
        self.forwards += 1
        self.row_steps += int(self.rows.numel())
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        self.pos = self.pos + 1

    def restore(self) -> None:
        """Crop the cache to `hold` positions and put the rows that left back in place."""
        assert self.hold is not None, "restore is for kept session caches"
        grown = self.cache.get_seq_length() - self.hold
        if grown > 0:
            self.cache.crop(-grown)
        if not self._parked:
            return
        for i, (x, k, v) in enumerate(self._held()):
            keys = k.new_empty((self._size, *k.shape[1:]))
            values = v.new_empty((self._size, *v.shape[1:]))
            keys[self.rows], values[self.rows] = k, v
            for rows, held in self._parked:
                keys[rows], values[rows] = held[i]
            x.keys, x.values = keys, values
        self.rows = torch.arange(self._size, device=self.rows.device)
        self._parked.clear()
