"""`data.balance_by`: each dataset's rows regrouped by the value of one field, every value a
part of the prompt stream with an equal share of its dataset's weight.

The sampler mixes parts laid out one after another in the prompt list (`mixed_window`),
so a balanced stream is a mix whose parts are (dataset, value) pairs: which part position
p of the stream belongs to is a function of p alone, and each part runs through its own
shuffled epochs, as a dataset of a plain mix does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

from rftpipe.config.data import MAX_BALANCE_VALUES
from rftpipe.data.sources import RawRow, cell
from rftpipe.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    """Rows grouped part after part (each row's `source` its part), and per part its
    mixing weight and its name in error messages."""

    rows: list[RawRow]
    weights: list[float]
    names: list[str]


def balance(rows: Sequence[RawRow], weights: Sequence[float], field: str) -> Parts:
    """`rows` (of `data.datasets`, dataset after dataset; `source` the dataset's index)
    regrouped by their value of `field` (`answer`, or a column of the row, dotted for a
    struct field), values in order of first appearance, rows in data order within one."""
    out = Parts(rows=[], weights=[], names=[])
    for k, weight in enumerate(weights):
        groups: dict[str, list[RawRow]] = {}
        for row in rows:
            if row.source == k:
                groups.setdefault(_value(row, field), []).append(row)
        if len(groups) > MAX_BALANCE_VALUES:
            raise UserError(
                f"data.balance_by: data.datasets[{k}] has {len(groups)} distinct values of "
                f"'{field}' > {MAX_BALANCE_VALUES}; balance by a label with few values"
            )
        for value, members in groups.items():
            part = len(out.weights)
            out.rows.extend(dataclasses.replace(r, source=part) for r in members)
            out.weights.append(weight / len(groups))
            out.names.append(f"data.datasets[{k}] rows whose {field} is {value}")
    return out


def _value(row: RawRow, field: str) -> str:
    value = row.answer if field == "answer" else cell(row.metadata, field)
    if value is None:
        raise UserError(f"data.balance_by: {row.where} has no value of '{field}'")
    return json.dumps(value, sort_keys=True, default=str)
