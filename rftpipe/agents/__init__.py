"""Agents users already wrote (`rollout.agent`): a program that calls a model endpoint in its
own loop, trained unchanged. The rollout stage serves an OpenAI-compatible endpoint
(`rftpipe.agents.server`) in front of its engine while it runs, and each episode's agent
runs in a process of its own (`rftpipe.agents.pool`) with a client bound to that episode.

Torch-free: an agent's process imports only this package's `worker` and the agent's module,
possibly under another interpreter (`rollout.agent.python`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentResult:
    """What an agent may return instead of a bare reward: the reward and anything to record
    with the episode (JSON-serialisable; kept in the episode's last call's `turn_infos`)."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
