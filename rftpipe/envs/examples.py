"""Example environments: small, deterministic, and used by the multi-turn example config
(`configs/multiturn_smollm2_retry.yaml`)."""

from __future__ import annotations

import re
from typing import Any

from rftpipe.envs.base import StepResult, Task

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RetryArithmetic:
    """A math problem with feedback: a wrong final number is answered "not right, try
    again" and the policy gets another turn; the right one ends the episode.

    The reward of a right answer at turn t (0-based) is `decay ** t`, so a first-try answer
    is worth most and a corrected one still counts; a wrong answer earns 0.
    """

    def __init__(self, decay: float = 0.5, feedback: str | None = None) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.feedback = feedback or (
            "That is not right. Check the arithmetic and reply with only the final number."
        )
        self.answer: str | None = None
        self.turn = 0

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if task.answer is None:
            raise ValueError(f"prompt {task.prompt_id} has no answer to check against")
        self.answer, self.turn = task.answer.strip(), 0
        return [dict(m) for m in task.messages], {}

    def step(self, action_text: str) -> StepResult:
        numbers = _NUMBER.findall(action_text)
        right = bool(numbers) and _same(numbers[-1], self.answer)
        turn, self.turn = self.turn, self.turn + 1
        if right:
            return StepResult(observations=[], reward=self.decay**turn, done=True)
        return StepResult(
            observations=[{"role": "user", "content": self.feedback}],
            reward=0.0,
            done=False,
            info={"guess": numbers[-1] if numbers else None},
        )

    def close(self) -> None:
        """Nothing to release."""


def _same(guess: str, answer: str | None) -> bool:
    if answer is None:
        return False
    try:
        return float(guess) == float(answer)
    except ValueError:
        return guess == answer
