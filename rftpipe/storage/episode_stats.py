"""The `episode/*` metrics of a multi-turn step (trajectory schema version 2), from its rows.

One definition for both readers: `rftpipe.run.metrics.step_metrics` (what a run logs) and
`rftpipe.inspect.summary` (recomputed offline, one shard per thread, hence mergeable
counts). A version-1 shard has none of these columns and gets none of these metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rftpipe.storage import branch_rows
from rftpipe.storage.branch_rows import BRANCH, episode_rows
from rftpipe.storage.layout import is_episode_shard

EPISODE_STATUSES = ("done", "max_turns", "truncated", "error")
"""How an episode can end (`episode_status`); each has its `episode/<status>_frac`."""
COLUMNS = ["num_turns", "episode_status", "loss_mask", "turn_infos"]
"""The columns the metrics read (never the token ids or logprobs), and an agent run's
branch columns (`branch_rows.COLUMNS`) where the shard has them."""
METRICS = (
    "episode/turns_mean",
    *(f"episode/{s}_frac" for s in EPISODE_STATUSES),
    "episode/model_tokens_mean",
    "episode/env_tokens_mean",
    "episode/tool_calls_mean",
    "episode/tool_errors_mean",
)
"""The metric names, in the order `EpisodeCounts.metrics` gives them (an agent run's also
`episode/branches_mean`)."""


def columns(names: list[str]) -> list[str]:
    """The columns to read of a shard with these columns."""
    return [*COLUMNS, *(c for c in branch_rows.COLUMNS if c in names)]


def has_episodes(names: list[str]) -> bool:
    """Whether a shard with these columns is a multi-turn one (schema version 2, or 3 with
    the turn structure)."""
    return is_episode_shard(names)


@dataclass(slots=True)
class EpisodeCounts:
    """Sums over a set of episodes; `metrics()` turns them into means."""

    episodes: int = 0
    turns: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    model_tokens: int = 0
    """Tokens the model sampled (`loss_mask` 1)."""
    env_tokens: int = 0
    """Tokens the environment's messages and the chat template added (`loss_mask` 0)."""
    tool_calls: int = 0
    """Tool calls the environments reported (a turn info's `tool_calls`, a list of names)."""
    tool_errors: int = 0
    """Of those, the ones that failed or did not parse (a turn info's `tool_errors`)."""
    branches: int | None = None
    """An agent run's: sequences past each episode's first (calls that did not extend
    their episode); None for an environment's."""

    @classmethod
    def of(cls, rows: pa.Table) -> EpisodeCounts:
        """The counts of `rows` (a table holding at least `COLUMNS`); an agent episode's
        sequences (rows) add up to one episode."""
        agent = BRANCH in rows.column_names
        if rows.num_rows == 0:
            return cls(branches=0 if agent else None)
        episodes = episode_rows(rows)
        mask = rows.column("loss_mask")
        # Sums over the flattened int8 mask widen to int64, so no per-token Python objects.
        total = int(pc.sum(pc.list_value_length(mask)).as_py() or 0)
        model = int(pc.sum(pc.list_flatten(mask)).as_py() or 0)
        counts = pc.value_counts(episodes.column("episode_status")).to_pylist()
        return cls(
            episodes=episodes.num_rows,
            turns=int(pc.sum(rows.column("num_turns")).as_py() or 0),
            statuses={c["values"]: int(c["counts"]) for c in counts if c["values"] is not None},
            model_tokens=model,
            env_tokens=total - model,
            **_tool_counts(rows.column("turn_infos").to_pylist()),
            branches=rows.num_rows - episodes.num_rows if agent else None,
        )

    def merge(self, o: EpisodeCounts) -> EpisodeCounts:
        statuses = dict(self.statuses)
        for k, v in o.statuses.items():
            statuses[k] = statuses.get(k, 0) + v
        return EpisodeCounts(
            self.episodes + o.episodes,
            self.turns + o.turns,
            statuses,
            self.model_tokens + o.model_tokens,
            self.env_tokens + o.env_tokens,
            self.tool_calls + o.tool_calls,
            self.tool_errors + o.tool_errors,
            None
            if self.branches is None and o.branches is None
            else (self.branches or 0) + (o.branches or 0),
        )

    def metrics(self) -> dict[str, Any]:
        """`episode/*` means per episode; empty for no episode (a dynamically sampled step
        may keep none: then these means do not exist, as `rollout/reward_mean` does not)."""
        n = self.episodes
        if n == 0:
            return {}
        return {
            "episode/turns_mean": self.turns / n,
            **{f"episode/{s}_frac": self.statuses.get(s, 0) / n for s in EPISODE_STATUSES},
            "episode/model_tokens_mean": self.model_tokens / n,
            "episode/env_tokens_mean": self.env_tokens / n,
            "episode/tool_calls_mean": self.tool_calls / n,
            "episode/tool_errors_mean": self.tool_errors / n,
            **({} if self.branches is None else {"episode/branches_mean": self.branches / n}),
        }


def _tool_counts(infos: list[list[str] | None]) -> dict[str, int]:
    """Tool calls and tool errors over every turn's info (JSON; environments without tools
    report neither)."""
    calls = errors = 0
    for turns in infos:
        for text in turns or []:
            info = json.loads(text)
            if isinstance(info, dict):
                calls += len(info.get("tool_calls") or [])
                errors += int(info.get("tool_errors") or 0)
    return {"tool_calls": calls, "tool_errors": errors}
