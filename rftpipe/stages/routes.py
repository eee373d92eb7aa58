"""The stages' side of the routes columns (their layout: `rftpipe.storage.routes`):
appending a stage's recorded routes, reading a micro-batch's back as tensors, and the
routing metrics of a train stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rftpipe.dist import Dist
from rftpipe.engines.moe import ReplayMode, Routers, decode, encode
from rftpipe.errors import UserError
from rftpipe.stages.base import Runtime
from rftpipe.storage.routes import ACTOR_ROUTES, MANIFEST_KEY, ROUTES, RouteShape, fed_tokens

ROUTE_FIELDS = {
    ROUTES: pa.field(ROUTES, pa.binary()),
    ACTOR_ROUTES: pa.field(ACTOR_ROUTES, pa.binary()),
}

REPLAYED: dict[ReplayMode, str | None] = {"none": None, "r3": ROUTES, "r2": ACTOR_ROUTES}
"""The column each replay mode's training forwards replay."""


def with_routes(table: pa.Table, column: str, routes: Sequence[torch.Tensor | None]) -> pa.Table:
    """`table` with `column` appended: each row's routes (null for a row with none, such
    as ReMax's greedy baseline, never trained on), cut to its `fed_tokens` (a forward that
    fed more, such as a multi-turn call that sampled nothing, leaves no route to a token
    whose output no sampled token used)."""
    names = ["prompt_token_ids", "response_token_ids", "loss_mask"]
    rows = table.select([n for n in names if n in table.column_names]).to_pylist()
    cells: list[bytes | None] = []
    for i, (r, row) in enumerate(zip(routes, rows, strict=True)):
        if r is None:
            cells.append(None)
            continue
        fed = fed_tokens(
            len(row["prompt_token_ids"]), len(row["response_token_ids"]), row.get("loss_mask")
        )
        if r.shape[0] < fed:
            raise ValueError(f"row {i}: routes for {r.shape[0]} of its {fed} fed tokens")
        cells.append(encode(r[:fed]))
    return table.append_column(ROUTE_FIELDS[column], pa.array(cells, pa.binary()))


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteColumn:
    """Reads one routes column back as each row's routes (`fed_tokens` of them: P + R - 1
    for a single-turn row), checked."""

    column: str
    shape: RouteShape

    def of(self, rows: Sequence[Mapping[str, Any]]) -> list[torch.Tensor | None]:
        """The routes of rows read as dicts (a train micro-batch); None for a row without
        (the padding row of a rank with fewer micro-batches)."""
        out: list[torch.Tensor | None] = []
        for row in rows:
            cell = row.get(self.column)
            what = (
                f"column {self.column} of step {row.get('step')} prompt_id "
                f"{row.get('prompt_id')} sample {row.get('sample_idx')}"
            )
            if cell is None:
                if "prompt_id" in row and not row.get("is_baseline"):
                    raise UserError(f"{what}: no routes for a trained row")
                out.append(None)
                continue
            fed = fed_tokens(
                len(row["prompt_token_ids"]), len(row["response_token_ids"]), row.get("loss_mask")
            )
            out.append(decode(cell, fed, self.shape, what))
        return out

    def table(self, table: pa.Table) -> list[torch.Tensor | None]:
        """Every row's routes of a stage's table, as `of`."""
        if self.column not in table.column_names:
            raise ValueError(f"the rows have no column {self.column}")
        names = ["step", "prompt_id", "sample_idx", "is_baseline"]
        names += ["prompt_token_ids", "response_token_ids", "loss_mask"]
        names = [n for n in names if n in table.column_names]
        return self.of(table.select([*names, self.column]).to_pylist())


def committed_column(rt: Runtime, step: int, column: str) -> RouteColumn:
    """Step `step`'s committed routes `column`, to replay on the policy: refused in one line
    when the stage that wrote it recorded another shape than the policy's (a resume with
    another model, past `--allow-fingerprint-mismatch`), before any row is read."""
    assert rt.route_shape is not None, "routes replay on an MoE policy only"
    shape = rt.route_shape
    writer = "rollout" if column == ROUTES else "advantage"
    recorded = rt.store.manifest(step, writer).get(MANIFEST_KEY)
    if recorded is not None and RouteShape.from_meta(recorded) != shape:
        raise UserError(
            f"model: step {step}'s committed routes are of {recorded['layers']} MoE layers, "
            f"top {recorded['top_k']} of {recorded['experts']} experts, the model's "
            f"{shape.layers}, top {shape.top_k} of {shape.experts}; they cannot drive it "
            "(resume with the model that recorded them)"
        )
    return RouteColumn(column=column, shape=shape)


def routing_metrics(routers: Routers | None, dist: Dist) -> dict[str, float]:
    """What an MoE policy's routers saw since the last call, summed over ranks ({} for a
    dense policy; a collective otherwise, so every rank calls it):

    - `moe/agreement`, `moe/agreement/lI`: of the (token, layer) selections the forwards
      replayed, the share the live router chose alike (as a set), before replay: R3, the
      rollout's against the trainer's; R2, the old-logprob forward's against the update's.
      Absent when nothing was replayed.
    - `moe/load/lI/eJ`: expert J's share of layer I's selections over real tokens (the
      selection the forward used), and `moe/load_imbalance` (mean over layers) and
      `moe/load_imbalance/lI`: the busiest expert's load over the mean load (1: even).
    """
    if routers is None:
        return {}
    stats = routers.take_stats()
    layers, experts = stats.load.shape
    flat = np.concatenate([stats.agree, stats.load.reshape(-1), [stats.replayed, stats.tokens]])
    total = dist.all_reduce_sum(torch.tensor(flat, dtype=torch.float64)).numpy()
    agree, load = total[:layers], total[layers : layers + layers * experts].reshape(layers, experts)
    replayed = total[-2]
    out: dict[str, float] = {}
    if replayed:
        share = agree / replayed
        out["moe/agreement"] = float(share.mean())
        out |= {f"moe/agreement/l{i}": float(a) for i, a in enumerate(share)}
    picks = load.sum(axis=1, keepdims=True)
    if picks.sum():
        shares = load / np.maximum(picks, 1.0)
        imbalance = load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12)
        out["moe/load_imbalance"] = float(imbalance.mean())
        out |= {f"moe/load_imbalance/l{i}": float(v) for i, v in enumerate(imbalance)}
        out |= {
            f"moe/load/l{i}/e{j}": float(shares[i, j])
            for i in range(layers)
            for j in range(experts)
        }
    return out
