"""The environment interface: what a multi-turn rollout hands an environment (`Task`), what
the environment answers after each response (`StepResult`), the `Environment` protocol,
`call` (plain or `async def` methods alike) and the checks on what a user's environment
returned."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rftpipe.errors import UserError

#: Roles an environment may answer with (the policy's own turns are `assistant`).
OBSERVATION_ROLES = frozenset({"user", "tool", "system"})

#: The config field every environment error names.
FIELD = "rollout.env.path"

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """One dataset prompt, as an environment sees it at `reset`."""

    prompt_id: int
    messages: list[dict[str, Any]]
    """The dataset prompt as chat messages (`{"role", "content"}`). An image prompt's
    content is a list of parts, its images as `{"type": "image"}` (no pixels): `reset`
    returns them in place, in order, for the policy to see the images."""
    answer: str | None = None
    """The reference answer, if the dataset has one."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (e.g. verl's `extra_info`, skyrl's `reward_spec`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What an environment answers to one policy response."""

    observations: list[dict[str, Any]]
    """Messages appended after the response (`{"role", "content"}`, role user/tool/system);
    empty when the episode is done."""
    reward: float
    """This turn's reward."""
    done: bool
    """Whether the episode ended with this response."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything the environment wants recorded (skyrl-gym's `metadata`)."""
    postprocessed_action: str | None = None
    """The response as the environment rewrote it (skyrl-gym, e.g. cut at a stop tag); the
    rollout keeps the generated tokens and records this beside them."""


class Environment(Protocol):
    """A multi-turn environment. Any method may be `async def`; call them through `call`."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Start an episode for `task`: the chat messages the policy sees first, and info.

        `seed` derives from (run seed, step, prompt id, sample), never the rank, so an
        episode redone after a restart draws the same randomness."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Answer one policy response."""
        ...

    def close(self) -> None:
        """Free what the episode holds (processes, connections)."""
        ...


# ---------------------------------------------------------------------------- calling

_loops = threading.local()


def _private_loop() -> asyncio.AbstractEventLoop:
    # One loop per thread, kept for the process: an async environment may hold objects
    # bound to the loop that created them (an HTTP session), which asyncio.run's fresh
    # loop per call would break on the second step.
    loop: asyncio.AbstractEventLoop | None = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        _loops.loop = loop
    return loop


def call(fn: Callable[..., T | Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, run to completion on this thread's private event loop if it
    returns an awaitable (an `async def` method). Not for use inside a running loop."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        return _private_loop().run_until_complete(_awaited(out))
    return out  # type: ignore[return-value]


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


# ----------------------------------------------------------------------------- checks


def message_problem(
    messages: Any, roles: frozenset[str] = OBSERVATION_ROLES, parts: bool = False
) -> str | None:
    """Why `messages` is not a list of chat messages with string `content` (or, with
    `parts`, a list of typed content parts: a task's image parts) and a role in `roles`
    (None: it is)."""
    if not isinstance(messages, list):
        return f"{_describe(messages)}, not a list of {{role, content}} messages"
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, Mapping) else None
        typed = parts and isinstance(content, list) and all(_is_part(c) for c in content)
        if not (isinstance(content, str) or typed):
            kind = "str or content-part list" if parts else "str"
            return (
                f"message {i} {_describe(m)}, not a {{role, content}} message with {kind} content"
            )
        if m.get("role") not in roles:
            return f"message {i} has role {m.get('role')!r}, not one of {sorted(roles)}"
    return None


def _is_part(part: Any) -> bool:
    """A chat content part: a mapping with a string `type` (`text`, `image`, ...)."""
    return isinstance(part, Mapping) and isinstance(part.get("type"), str)


def checked_step_result(obj: Any, env_name: str, where: str) -> StepResult:
    """What a user's `step` returned (a StepResult, or a mapping with its keys; skyrl-gym's
    `metadata` is taken as `info`) as a StepResult; a one-line UserError naming the
    environment class, the sample (`where`) and what is wrong otherwise."""

    def fail(problem: str) -> UserError:
        return UserError(f"{FIELD}: {env_name}.step returned {problem} ({where})")

    if isinstance(obj, StepResult):
        fields: Mapping[str, Any] = {
            "observations": obj.observations,
            "reward": obj.reward,
            "done": obj.done,
            "info": obj.info,
            "postprocessed_action": obj.postprocessed_action,
        }
    elif isinstance(obj, Mapping):
        missing = [k for k in ("observations", "reward", "done") if k not in obj]
        if missing:
            raise fail(f"a mapping without {missing} (keys {sorted(map(str, obj))})")
        fields = {**obj, "info": obj.get("info", obj.get("metadata")) or {}}
    else:
        raise fail(f"{_describe(obj)}, not a StepResult or a mapping with its keys")
    reward = fields["reward"]
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise fail(f"reward {_describe(reward)}, not a number")
    if not math.isfinite(float(reward)):
        raise fail(f"reward {float(reward)}, not a finite number")
    if not isinstance(fields["done"], bool):
        raise fail(f"done {_describe(fields['done'])}, not a bool")
    if (problem := message_problem(fields["observations"])) is not None:
        raise fail(f"observations {problem}")
    if not isinstance(fields["info"], Mapping):
        raise fail(f"info {_describe(fields['info'])}, not a dict")
    action = fields.get("postprocessed_action")
    if action is not None and not isinstance(action, str):
        raise fail(f"postprocessed_action {_describe(action)}, not a str or None")
    return StepResult(
        observations=[dict(m) for m in fields["observations"]],
        reward=float(reward),
        done=fields["done"],
        info=dict(fields["info"]),
        postprocessed_action=action,
    )


def checked_reset(
    obj: Any, env_name: str, where: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What a user's `reset` returned, checked like `checked_step_result`: (messages,
    info), the messages in any chat role but the policy's own."""
    if not (isinstance(obj, tuple) and len(obj) == 2):
        raise UserError(
            f"{FIELD}: {env_name}.reset returned {_describe(obj)}, not (messages, info) ({where})"
        )
    messages, info = obj
    # A task's image parts come back in its messages (`Task.messages`); observations are
    # text only.
    roles = OBSERVATION_ROLES | {"assistant"}
    if (problem := message_problem(messages, roles, parts=True)) is not None:
        raise UserError(f"{FIELD}: {env_name}.reset returned messages {problem} ({where})")
    if not isinstance(info, Mapping):
        raise UserError(
            f"{FIELD}: {env_name}.reset returned info {_describe(info)}, not a dict ({where})"
        )
    return [dict(m) for m in messages], dict(info)


def _describe(value: Any) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"
