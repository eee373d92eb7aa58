"""The routes columns of an MoE run's trajectory rows: names, shape, cell layout (torch-free).

A route is, for one token fed to the model, the top-k expert ids its MoE layers selected.
A row's cell is its (T, layers, top_k) uint8 array in C order, T = len(prompt_token_ids) +
len(response_token_ids) - 1 (the last sampled token is never fed); a multi-turn row's
covers every token before its last sampled one (`fed_tokens`). `routes` (R3) holds the
rollout's, written by the rollout stage; `actor_routes` (R2) the advantage stage's
old-logprob forward's; later stages carry them along. The shape is in the writing stage's
manifest (`routes`) and in each shard's Parquet metadata (`rftpipe.routes`). The training
side (`rftpipe.engines.moe`, `rftpipe.stages.routes`) and the inspector read them through
this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rftpipe.errors import UserError

ROUTES = "routes"
"""The rollout's routes (R3)."""
ACTOR_ROUTES = "actor_routes"
"""The actor's old-logprob forward's selection (R2)."""
COLUMNS = (ROUTES, ACTOR_ROUTES)
META_KEY = "rftpipe.routes"
"""The shard metadata key holding the shape as JSON (`RouteShape.to_meta`)."""
MANIFEST_KEY = "routes"
"""The stage manifest field holding the same."""
ROUTE_DTYPE = np.uint8
"""Expert ids are stored as uint8: every model we accept has at most 256 experts."""
MAX_EXPERTS = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteShape:
    """What one token's route holds: `layers` MoE layers, each `top_k` of `experts` ids."""

    layers: int
    experts: int
    top_k: int

    @property
    def per_token(self) -> int:
        """Bytes a token's route takes (one uint8 per layer and selected expert)."""
        return self.layers * self.top_k

    def to_meta(self) -> dict[str, object]:
        return {
            "dtype": "uint8",
            "layout": "(T, layers, top_k) C-order",
            "layers": self.layers,
            "experts": self.experts,
            "top_k": self.top_k,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RouteShape:
        """From a `rftpipe.routes` record; ValueError naming what is wrong with it."""
        try:
            sizes = {k: meta[k] for k in ("layers", "experts", "top_k")}
        except KeyError as e:
            raise ValueError(f"the routes' shape {dict(meta)} lacks {e}") from None
        if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            raise ValueError(f"the routes' shape {dict(meta)} has a size that is not a count")
        return cls(**sizes)


def fed_tokens(prompt: int, response: int, loss_mask: Sequence[int] | None = None) -> int:
    """How many routes a row holds: one per token before its last sampled one, the tokens
    whose routes shaped a sampled token. A single-turn row (no `loss_mask`): P + R - 1. A
    multi-turn row (`loss_mask` 1 on sampled tokens): up to its last sampled token, so a
    running episode's committed row (environment tokens after its last turn, not fed yet)
    holds fewer than P + R - 1; one with no sampled token holds none."""
    if loss_mask is None:
        return prompt + response - 1
    last = next((i for i in range(len(loss_mask) - 1, -1, -1) if loss_mask[i]), -1)
    return prompt + last if last >= 0 else 0


def encode(routes: np.ndarray) -> bytes:
    """A row's (T, L, k) routes as the bytes of its Parquet cell."""
    return np.ascontiguousarray(routes, dtype=ROUTE_DTYPE).tobytes()


def decode(cell: bytes, tokens: int, shape: RouteShape, what: str) -> np.ndarray:
    """A row's Parquet cell back to its (tokens, L, k) routes; `what` names the row in the
    one-line error when the cell does not hold exactly `tokens` routes of `shape`."""
    want = tokens * shape.per_token
    if len(cell) != want:
        raise UserError(
            f"{what}: its routes hold {len(cell)} bytes, not {want} ({tokens} fed tokens x "
            f"{shape.layers} layers x top-{shape.top_k}); the shard is corrupt or was edited"
        )
    arr = np.frombuffer(cell, dtype=ROUTE_DTYPE).reshape(tokens, shape.layers, shape.top_k)
    if tokens and int(arr.max()) >= shape.experts:
        raise UserError(
            f"{what}: its routes name expert {int(arr.max())} of {shape.experts}; "
            "the shard is corrupt or was edited"
        )
    return arr
