"""The TRL-style adapter (`rollout.env.path: trl:pkg.mod:Class`), following TRL's
`GRPOTrainer(environment_factory=...)` (trl 1.16): the class is built without arguments
(here with `rollout.env.kwargs`); `reset(**row)` returns None or text appended to the last
prompt message; every public function of the class but `reset` and `get_reward` is a tool;
tool calls are answered with their results, an exception as `{'error': ...}`; the episode
ends at a response without tool calls, and `get_reward()` (optional, may be async) is its
reward (0.0 without one: the run's reward functions score it)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

from rftpipe.config.schema import ToolParserName
from rftpipe.envs.base import FIELD, Task, call
from rftpipe.envs.tools import ToolEnvironment
from rftpipe.errors import UserError

#: Functions of a TRL environment class that are not tools.
NOT_TOOLS = frozenset({"reset", "get_reward"})


def tool_methods(env: Any) -> list[Any]:
    """The tools of a TRL environment instance: its class's public functions (listed on
    the class, as TRL does, so properties are not evaluated), bound to it."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


class TRLEnvironment(ToolEnvironment):
    """A TRL-style environment instance behind our interface."""

    def __init__(self, env: Any, parser: ToolParserName = "hermes") -> None:
        self.env = env
        self.name = type(env).__name__
        super().__init__(tool_methods(env), self._final_reward, parser)

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        # TRL passes the dataset row as keyword arguments; ours are its prompt, answer and
        # other columns. TRL's environments draw no seed, so `seed` is unused.
        row = {**task.metadata, "prompt": [dict(m) for m in task.messages], "answer": task.answer}
        extra = call(self.env.reset, **row)
        messages = [dict(m) for m in task.messages]
        if extra is not None:
            if not isinstance(extra, str):
                raise UserError(
                    f"{FIELD}: {self.name}.reset returned {type(extra).__name__}, not None or a str"
                )
            if not messages:
                raise UserError(f"{FIELD}: {self.name}.reset: the task has no prompt message")
            messages[-1]["content"] = f"{messages[-1]['content']}{extra}"
        return super().reset(replace(task, messages=messages), seed)

    def _final_reward(self, answer: str, task: Task) -> Any:
        get_reward = getattr(self.env, "get_reward", None)
        return 0.0 if get_reward is None else call(get_reward)
