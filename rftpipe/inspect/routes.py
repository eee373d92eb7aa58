"""The routes of an MoE run's committed rows, read without torch: their check (`verify`)
and each step's expert load (`rftpipe inspect RUN routes`).

A row's routes cell (`rftpipe.stages.routes`) is its (T, layers, top_k) uint8 array in C
order, T = len(prompt_token_ids) + len(response_token_ids) - 1: route j is the experts
that token j of prompt+response was routed to when fed (the last token never was). The
shape is in each shard's Parquet metadata (`rftpipe.routes`) and in the manifest of the
stage that wrote the column. The layout and shape are `rftpipe.storage.routes`'s
(torch-free); the checks here are `rftpipe.storage.routes.decode`'s, vectorised over a
shard's rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rftpipe.storage.routes import ACTOR_ROUTES, COLUMNS, MANIFEST_KEY, ROUTES, RouteShape
from rftpipe.storage.routes import META_KEY as _META
from rftpipe.storage.stage_store import StageStore

META_KEY = _META.encode()
"""`rftpipe.routes` as the bytes key Parquet metadata has."""

MAX_ROWS_NAMED = 5
"""Bad rows named per shard and column; the rest are counted in one more line."""

WHOSE = {
    ROUTES: "the rollout's, replayed by R3",
    ACTOR_ROUTES: "the actor's old-logprob forward's, replayed by R2",
}


def shard_meta(schema: pa.Schema) -> dict[str, Any] | None:
    """A shard's `rftpipe.routes` record (None: absent); ValueError if it is not JSON."""
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"its {META_KEY.decode()} metadata is not JSON: {raw[:80]!r}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"its {META_KEY.decode()} metadata is not a JSON object")
    return meta


def step_shapes(store: StageStore, step: int, stages: Sequence[str]) -> list[dict[str, Any]]:
    """The distinct routes shapes the committed `stages` of `step` record in their
    manifests (one on an MoE run's step with routes; none on a dense run's)."""
    found: dict[str, dict[str, Any]] = {}
    for stage in stages:
        shape = store.manifest(step, stage).get(MANIFEST_KEY)
        if shape is not None:
            found.setdefault(json.dumps(shape, sort_keys=True), shape)
    return list(found.values())


# -- a column's cells, vectorised -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cells:
    """One routes column of a table, per row, and all its bytes in row order."""

    valid: np.ndarray
    """(N,) bool: the row has a cell."""
    nbytes: np.ndarray
    """(N,) int64: the cell's length (0 without one)."""
    top: np.ndarray
    """(N,) int64: the cell's largest expert id (-1 for an empty or missing cell)."""
    data: np.ndarray
    """(sum nbytes,) uint8: the cells concatenated."""


def _chunk_cells(chunk: pa.Array) -> Cells:
    n = len(chunk)
    valid = chunk.is_valid().to_numpy(zero_copy_only=False)
    _, offsets_buf, data_buf = chunk.buffers()
    width = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
    offsets = np.zeros(n + 1, dtype=np.int64)  # an all-null chunk may carry none
    if offsets_buf is not None:
        offsets = np.frombuffer(offsets_buf, width)[chunk.offset : chunk.offset + n + 1].astype(
            np.int64
        )
    spans = np.diff(offsets)
    whole = np.zeros(0, np.uint8) if data_buf is None else np.frombuffer(data_buf, np.uint8)
    # Arrow lets a null slot span bytes: they are no row's routes.
    data = whole[offsets[0] : offsets[-1]][np.repeat(valid, spans)]
    nbytes = np.where(valid, spans, 0)
    top = np.full(n, -1, dtype=np.int64)
    has = nbytes > 0
    if has.any():
        # Each cell's max: reduceat over (start, end) pairs, keeping the even results.
        starts = (np.cumsum(nbytes) - nbytes)[has]
        bounds = np.stack([starts, starts + nbytes[has]], axis=1).ravel()[:-1]
        top[has] = np.maximum.reduceat(data, bounds)[::2]
    return Cells(valid, nbytes, top, data)


def cells(column: pa.ChunkedArray) -> Cells:
    """`column`'s `Cells`; ValueError unless it is binary (or large_binary)."""
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise ValueError(f"its type is {column.type}, not binary")
    parts = [_chunk_cells(c) for c in column.chunks] or [_chunk_cells(pa.array([], pa.binary()))]
    return Cells(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Cells)))


def fed_tokens(table: pa.Table) -> np.ndarray:
    """(N,) int64: the routes each row holds (`rftpipe.storage.routes.fed_tokens`): P + R -
    1, or for a multi-turn row (with `loss_mask`) up to its last sampled token."""

    def length(name: str) -> np.ndarray:
        lens = pc.list_value_length(table.column(name)).fill_null(0)
        return np.asarray(lens.to_numpy(), dtype=np.int64)

    prompt = length("prompt_token_ids")
    if "loss_mask" not in table.column_names:
        return prompt + length("response_token_ids") - 1
    mask = table.column("loss_mask").combine_chunks()
    flags = np.asarray(pc.list_flatten(mask).to_numpy(zero_copy_only=False)) != 0
    parents = np.asarray(pc.list_parent_indices(mask).to_numpy(), dtype=np.int64)
    lens = length("loss_mask")
    index = np.arange(len(flags)) - (np.cumsum(lens) - lens)[parents]
    last = np.full(table.num_rows, -1, dtype=np.int64)
    np.maximum.at(last, parents[flags], index[flags])
    return np.where(last >= 0, prompt + last, 0)


def _trained(table: pa.Table) -> np.ndarray:
    """(N,) bool: rows that are trained on (all but ReMax's greedy baseline rows)."""
    if "is_baseline" not in table.column_names:
        return np.ones(table.num_rows, dtype=bool)
    flags = table.column("is_baseline").fill_null(False).to_numpy(zero_copy_only=False)
    return ~np.asarray(flags, dtype=bool)


def row_problems(table: pa.Table, column: str, shape: RouteShape, where: str) -> Iterator[str]:
    """Why each row of `table` has bad `column` routes: a cell that does not hold exactly
    its fed tokens' routes, an expert id past the model's, or no cell on a trained row.
    `where` names the shard; each line adds the row's prompt_id and sample. ValueError if
    the column is not binary."""
    got = cells(table.column(column))
    fed = fed_tokens(table)
    want = fed * shape.per_token
    bad = (got.valid & ((got.nbytes != want) | (got.top >= shape.experts))) | (
        ~got.valid & _trained(table)
    )
    # Python objects only for the rows named (a sound shard makes none).
    ids = table.select(["prompt_id", "sample_idx"]).to_pydict() if bad.any() else {}
    for i in np.flatnonzero(bad):
        row = f"prompt_id {ids['prompt_id'][i]} sample {ids['sample_idx'][i]}"
        what = f"column {column} of {where} {row}"
        if not got.valid[i]:
            yield f"{what}: no routes for a trained row"
        elif got.nbytes[i] != want[i]:
            yield (
                f"{what}: its routes hold {got.nbytes[i]} bytes, not {want[i]} ({fed[i]} fed "
                f"tokens x {shape.layers} layers x top-{shape.top_k})"
            )
        else:
            yield f"{what}: its routes name expert {got.top[i]} of {shape.experts}"


def shard_problems(
    shard: Path, step: int, stage: str, manifest_shapes: Sequence[dict[str, Any]]
) -> list[str] | None:
    """What is wrong with the routes columns of one committed shard (None: it has none):
    its metadata against the step's manifests, then its rows."""
    schema = pq.read_schema(shard)
    columns = [c for c in COLUMNS if c in schema.names]
    if not columns:
        return None
    where = f"step {step} {stage} {shard.name}"
    head = f"column {columns[0]} of {where}"
    try:
        meta = shard_meta(schema)
    except ValueError as e:
        return [f"{head}: {e}"]
    if meta is None:
        return [f"{head}: no {META_KEY.decode()} metadata"]
    if len(manifest_shapes) != 1:
        return [
            f"{head}: the manifests of step {step} record {len(manifest_shapes)} routes shapes"
            f"{'' if not manifest_shapes else ' ' + str(manifest_shapes)}, not one"
        ]
    if meta != manifest_shapes[0]:
        return [f"{head}: its shape {meta} is not the manifest's {manifest_shapes[0]}"]
    try:
        shape = RouteShape.from_meta(meta)
    except ValueError as e:
        return [f"{head}: {e}"]
    names = ["prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids"]
    names += ["is_baseline"] if "is_baseline" in schema.names else []
    table = pq.read_table(shard, columns=[*names, *columns])
    out: list[str] = []
    for column in columns:
        try:
            bad = list(row_problems(table, column, shape, where))
        except ValueError as e:
            bad = [f"column {column} of {where}: {e}"]
        out += bad[:MAX_ROWS_NAMED]
        if len(bad) > MAX_ROWS_NAMED:
            more = len(bad) - MAX_ROWS_NAMED
            out.append(f"column {column} of {where}: and {more} more row(s) with bad routes")
    return out


# -- a step's expert load -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLoad:
    """One routes column of a step's published rows, counted per layer and expert."""

    step: int
    column: str
    shape: RouteShape
    rows: int
    """Rows with routes."""
    tokens: int
    """Fed tokens routed (each counts top_k selections per layer)."""
    counts: np.ndarray
    """(layers, experts) int64: selections of each expert."""

    @property
    def imbalance(self) -> np.ndarray:
        """(layers,) the busiest expert's selections over the mean (1: even), as
        `moe/load_imbalance/lI` defines it."""
        return self.counts.max(axis=1) / np.maximum(self.counts.mean(axis=1), 1e-12)


def _counts(data: np.ndarray, shape: RouteShape) -> np.ndarray:
    """(layers, experts) selections in `data`, whole (T, layers, top_k) routes."""
    routes = data.reshape(-1, shape.layers, shape.top_k).astype(np.int64)
    # One bincount: layer l's expert e is bin l * experts + e.
    bins = routes + (np.arange(shape.layers) * shape.experts)[None, :, None]
    flat = np.bincount(bins.ravel(), minlength=shape.layers * shape.experts)
    return flat.reshape(shape.layers, shape.experts)


def step_load(step: int, fragments: Sequence[Any]) -> list[StepLoad]:
    """Each routes column of a step's published `fragments` (pyarrow dataset fragments, one
    per rank), counted; [] when they have none. ValueError naming the first bad row."""
    found: dict[str, StepLoad] = {}
    for frag in fragments:
        schema = frag.physical_schema
        for column in (c for c in COLUMNS if c in schema.names):
            meta = shard_meta(schema)
            if meta is None:
                raise ValueError(f"column {column} of step {step}: a shard has no routes shape")
            shape = RouteShape.from_meta(meta)
            names = ["prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids"]
            names += ["is_baseline"] if "is_baseline" in schema.names else []
            table = frag.to_table(columns=[*names, column])
            where = f"step {step} {Path(frag.path).name}"
            if bad := next(row_problems(table, column, shape, where), None):
                raise ValueError(f"{bad} (`verify` lists every bad row)")
            got = cells(table.column(column))
            load = StepLoad(
                step=step,
                column=column,
                shape=shape,
                rows=int(got.valid.sum()),
                tokens=len(got.data) // shape.per_token,
                counts=_counts(got.data, shape),
            )
            if (prev := found.get(column)) is not None:
                if prev.shape != shape:
                    raise ValueError(f"column {column} of step {step}: shards of two shapes")
                load = StepLoad(
                    step=step,
                    column=column,
                    shape=shape,
                    rows=prev.rows + load.rows,
                    tokens=prev.tokens + load.tokens,
                    counts=prev.counts + load.counts,
                )
            found[column] = load
    return list(found.values())


def run_routes(names: Sequence[str], fragments: Sequence[Any]) -> tuple[str, RouteShape] | None:
    """The routes column of a published dataset whose columns are `names` and its shape,
    from the first of its `fragments` that carries it (one model, one shape per run); None
    for a run without routes (no fragment is opened then)."""
    column = next((c for c in COLUMNS if c in names), None)
    if column is None:
        return None
    for frag in fragments:
        schema = frag.physical_schema
        if column in schema.names:
            meta = shard_meta(schema)
            if meta is None:
                raise ValueError(f"{Path(frag.path).name} has column {column} but no shape")
            return column, RouteShape.from_meta(meta)
    return None


def step_report(load: StepLoad, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`rftpipe inspect RUN routes --json`'s record of one routes column of a step: the load
    of its committed routes per layer, beside what the trainer measured that step (its
    train manifest's `metrics`; null where absent: agreement exists only where a forward
    replayed routes)."""
    imbalance = load.imbalance
    per_layer = [
        {
            "layer": i,
            "selections": int(load.counts[i].sum()),
            "imbalance": float(imbalance[i]),
            "train_imbalance": metrics.get(f"moe/load_imbalance/l{i}"),
            "agreement": metrics.get(f"moe/agreement/l{i}"),
            "counts": load.counts[i].tolist(),
        }
        for i in range(load.shape.layers)
    ]
    return {
        "step": load.step,
        "column": load.column,
        "rows": load.rows,
        "tokens": load.tokens,
        "layers": load.shape.layers,
        "experts": load.shape.experts,
        "top_k": load.shape.top_k,
        "imbalance": float(imbalance.mean()),
        "train_imbalance": metrics.get("moe/load_imbalance"),
        "agreement": metrics.get("moe/agreement"),
        "aux_loss": metrics.get("train/moe_aux_loss"),
        "per_layer": per_layer,
    }
