"""User environments and tools for tests/test_envs.py, loaded by import path like a user's."""

from __future__ import annotations

from typing import Any, Literal

from rftpipe.config.schema import ToolParserName
from rftpipe.envs.base import StepResult, Task
from rftpipe.envs.tools import ToolEnvironment


class GuessEnv:
    """Guess the task's answer: a right guess ends the episode with reward 1, a wrong one
    gets 'higher'/'lower' and a reward of -0.1. `offset` shifts the secret (a kwarg)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.secret = 0

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.secret = int(task.answer or 0) + self.offset
        return list(task.messages), {"seed": seed}

    def step(self, action_text: str) -> StepResult:
        guess = int(action_text.strip())
        if guess == self.secret:
            return StepResult(observations=[], reward=1.0, done=True)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(observations=[{"role": "user", "content": hint}], reward=-0.1, done=False)

    def close(self) -> None:
        pass


class AsyncGuessEnv(GuessEnv):
    """GuessEnv with `async def` methods, answering mappings as skyrl-gym does."""

    async def reset(  # type: ignore[override]
        self, task: Task, seed: int
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return GuessEnv.reset(self, task, seed)

    async def step(self, action_text: str) -> dict[str, Any]:  # type: ignore[override]
        r = GuessEnv.step(self, action_text)
        return {"observations": r.observations, "reward": r.reward, "done": r.done, "metadata": {}}

    async def close(self) -> None:  # type: ignore[override]
        pass


class ReturnsThis:
    """An environment whose `step` returns its constructor's `value` (bad returns)."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return list(task.messages), {}

    def step(self, action_text: str) -> Any:
        return self.value


class NoStep:
    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [], {}


NOT_A_CLASS = 3


# ----------------------------------------------------------------------------- tools


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    More text that is not the description.

    Args:
        a: The first number.
        b (int): The second number,
            described on two lines.

    Returns:
        The sum.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def lookup(
    keys: list[str], mode: Literal["first", "last"], strict: bool, limit: int | None = None
) -> str:
    """Look keys up.

    Args:
        keys: Keys to look up.
        mode: Which match to keep.
        strict: Fail on a missing key.
        limit: Most matches.
    """
    return ",".join(keys)


def unannotated(a, b: int) -> int:  # type: ignore[no-untyped-def]
    """Has an unannotated parameter."""
    return int(a) + b


def exact_answer(answer: str, task: Task) -> float:
    """Reward 1 when the final answer is the task's answer."""
    return float(answer.strip() == task.answer)


class Calculator(ToolEnvironment):
    """A ToolEnvironment loaded by path: the loader gives it `parser`."""

    def __init__(self, parser: ToolParserName = "hermes") -> None:
        super().__init__([add, divide], exact_answer, parser)


# ------------------------------------------------------------------- TRL-style classes


class TRLCounter:
    """A TRL-style environment: public methods are tools, `get_reward` scores."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.count = start

    def reset(self, **kwargs: Any) -> str | None:
        self.count = self.start
        return f" (start at {self.count}, answer {kwargs['answer']})"

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: How much to add.
        """
        if by < 0:
            raise ValueError("by must be >= 0")
        self.count += by
        return self.count

    def _helper(self) -> None:
        """Private: not a tool."""

    async def get_reward(self) -> float:
        return float(self.count)


class TRLNoReset:
    def tool(self, x: int) -> int:
        """A tool.

        Args:
            x: A number.
        """
        return x
