"""ReMax's greedy baseline rows (`is_baseline`) in committed tables.

They are scored like any row and set their group's advantages, but they are not the
policy's samples: the train stage and every reward statistic leave them out. Torch-free, so
the run-directory tools can filter with it too.
"""

from __future__ import annotations

import pyarrow as pa

COLUMN = "is_baseline"


def baseline_flags(table: pa.Table) -> list[bool]:
    """Each row's `is_baseline`; shards committed before the column existed have no
    baseline rows (a run resumed across the upgrade reads them too)."""
    if COLUMN not in table.column_names:
        return [False] * table.num_rows
    return table.column(COLUMN).to_pylist()


def without_baseline(table: pa.Table) -> pa.Table:
    """The policy's own samples: the rows the train stage and the reward statistics see."""
    return table.filter(pa.array([not b for b in baseline_flags(table)], pa.bool_()))
