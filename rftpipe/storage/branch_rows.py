"""An agent episode's sequences (`branch`, `branches`) in committed tables.

An agent episode (`rollout.agent`) is one token sequence until the agent makes a call that
does not extend it (it rewrote or summarised its history, or the chat template re-renders
earlier text); that call starts the episode's next sequence, its next *branch*. Each
sequence is a row, the episode's rows are consecutive in branch order, and the episode is
its last row: that row's response is what the agent ended on and what reward functions
read. The score stage gives every row of an episode the last row's reward columns, the
advantage stage gives every row the advantage its episode's last row gets, and every
per-episode statistic (reward means, `episode/*`, group statistics) counts the last rows
alone. Torch-free, so the run-directory tools can read with it too.
"""

from __future__ import annotations

import pyarrow as pa

BRANCH = "branch"
"""int32: the row's sequence within its episode (0 first)."""
BRANCHES = "branches"
"""int32: how many sequences its episode has (1: it never branched)."""
COLUMNS = (BRANCH, BRANCHES)
"""The columns an agent run's rows add."""


def has_branches(table: pa.Table) -> bool:
    """Whether some episode of `table` has more than one row."""
    if BRANCHES not in table.column_names or table.num_rows == 0:
        return False
    return max(table.column(BRANCHES).to_pylist()) > 1


def last_flags(table: pa.Table) -> list[bool]:
    """Each row: whether it is its episode's last sequence (the episode's own row). Tables
    without the columns (every run but an agent's) hold one row per episode."""
    if BRANCH not in table.column_names:
        return [True] * table.num_rows
    return [
        b == n - 1
        for b, n in zip(
            table.column(BRANCH).to_pylist(), table.column(BRANCHES).to_pylist(), strict=True
        )
    ]


def episode_rows(table: pa.Table) -> pa.Table:
    """One row per episode: its last sequence's."""
    if not has_branches(table):
        return table
    return table.filter(pa.array(last_flags(table), pa.bool_()))


def last_rows(table: pa.Table) -> list[int]:
    """Each row: the index in `table` of its episode's last row. An episode's rows are
    consecutive in branch order (`ValueError` otherwise: a table not written by the
    rollout stage)."""
    if BRANCH not in table.column_names:
        return list(range(table.num_rows))
    branch = table.column(BRANCH).to_pylist()
    count = table.column(BRANCHES).to_pylist()
    keys = list(
        zip(
            table.column("prompt_id").to_pylist(),
            table.column("sample_idx").to_pylist(),
            strict=True,
        )
    )
    out: list[int] = []
    for i, (b, n) in enumerate(zip(branch, count, strict=True)):
        end = i + n - 1 - b
        if not (0 <= b < n and end < len(branch) and keys[end] == keys[i]):
            raise ValueError(
                f"row {i} (prompt_id {keys[i][0]} sample_idx {keys[i][1]}): branch {b} of "
                f"{n} is not followed by its episode's later branches"
            )
        out.append(end)
    return out


def last_row_index(table: pa.Table) -> list[int]:
    """Each row: the index, within `episode_rows(table)`, of its episode's last row."""
    ends = last_rows(table)
    position = {end: j for j, end in enumerate(sorted(set(ends)))}
    return [position[end] for end in ends]
