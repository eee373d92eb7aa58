"""A recorded row's text as the inspector shows it: control bytes made visible, chat
messages (text or content parts), and a multi-turn row (trajectory schema version 2, or 3
with `rollout.env`) cut into its turns. Shared by `samples` (text) and `html` (a page)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

EPISODE_FIELDS = [
    "loss_mask",
    "turn_offsets",
    "turn_rewards",
    "turn_infos",
    "num_turns",
    "env_reward",
    "episode_status",
    "messages",
]
"""What `samples` reads of a multi-turn row (schema version 2) to print it turn by turn."""


def sequence_text(r: dict[str, Any], sep: str) -> str:
    """Which of its episode's sequences an agent row is (`sequence 2 of 3`, after `sep`),
    when the episode has more than one (`rftpipe.storage.branch_rows`); else empty."""
    n = r.get("branches")
    if n is None or n < 2:
        return ""
    return f"{sep}sequence {r['branch'] + 1} of {n}"


def printable(s: str) -> str:
    """`s` with control characters escaped (``\\x03``), newlines and tabs kept."""
    # Untrained models emit control bytes; escape them so they cannot corrupt the terminal.
    return "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in s)


def content_text(content: Any) -> str:
    """A message's content as text: a string as it is; content parts (OpenAI / HF style)
    joined, each image part as ``[image]`` (its file is in the row's `images`, in order)."""
    if not isinstance(content, list):
        return str(content or "")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.append(str(part.get("text") or ""))
        elif kind in ("image", "image_url"):
            out.append("[image]")
        else:
            out.append(json.dumps(part, ensure_ascii=False))
    return "".join(out)


def role(m: dict[str, Any]) -> str:
    """A message's role as shown: ``tool NAME`` for a named tool's answer."""
    return f"{m.get('role')} {m['name']}" if m.get("name") else str(m.get("role"))


def message_line(m: dict[str, Any]) -> str:
    """A chat message as printed: `[role] content` (`[tool NAME]` for a tool's answer)."""
    return f"[{role(m)}] {content_text(m.get('content'))}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of a recorded episode, as `samples` prints it."""

    action: dict[str, Any] | None
    """The model's message (None only if `messages` lacks it)."""
    observations: list[dict[str, Any]]
    """The environment's messages after it: none after the last turn, or when the token
    budget left no room for them."""
    model_tokens: int
    """The turn's tokens with `loss_mask` 1 (sampled)."""
    env_tokens: int
    """The turn's tokens with `loss_mask` 0 (the environment's answer, templated)."""
    reward: float | None
    info: str | None
    """`turn_infos`' JSON: the environment's info, or the error that ended the episode."""
    start: int
    """Where the turn's tokens start in the response (`turn_offsets`)."""
    end: int
    """Where they end: the next turn's offset, or the response's end."""


def episode_turns(r: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Turn]]:
    """A multi-turn row's prompt messages and its turns. The text comes from `messages`,
    not from decoding tokens (no tokenizer is loaded): each assistant message opens a
    turn, since an environment never answers as the assistant. The token counts come from
    `turn_offsets` (where each turn starts) and `loss_mask`."""
    messages = json.loads(r["messages"])
    starts = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    mask, offsets = r["loss_mask"], r["turn_offsets"]
    bounds = [*offsets, len(mask)]
    turns = []
    # An episode that ended at reset has no turn but its error in `turn_infos`: shown as a
    # turn without an action.
    for t in range(max(len(offsets), len(starts), len(r["turn_infos"]))):
        lo, hi = (bounds[t], bounds[t + 1]) if t < len(offsets) else (len(mask), len(mask))
        span = mask[lo:hi]
        end = starts[t + 1] if t + 1 < len(starts) else len(messages)
        turns.append(
            Turn(
                action=messages[starts[t]] if t < len(starts) else None,
                observations=messages[starts[t] + 1 : end] if t < len(starts) else [],
                model_tokens=sum(span),
                env_tokens=len(span) - sum(span),
                reward=r["turn_rewards"][t] if t < len(r["turn_rewards"]) else None,
                info=r["turn_infos"][t] if t < len(r["turn_infos"]) else None,
                start=lo,
                end=hi,
            )
        )
    return messages[: starts[0] if starts else len(messages)], turns
