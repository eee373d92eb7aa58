"""A user's own skyrl-gym environment, defined outside skyrl-gym and never registered with it:
what `rollout.env.path: skyrl:envs_skyrl_user:GuessNumber` and a dataset row's
`env_class` name (tests/ is on the path of the test processes and of the runs they launch).

`GuessNumber` is "guess a number in [1, 50]": the task's ground truth is the number, a
guess gets "Higher."/"Lower.", a right one ends the episode with reward 1. A random-init
tiny model rarely writes a number, so a wrong or missing guess also earns a dense share:
half the share of the response's characters whose code point is even (`reward`), so its
rewards visibly reach the trajectory.
"""

from __future__ import annotations

import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


def reward(action: str, target: int) -> float:
    """The reward `GuessNumber.step` pays for `action` (tests recompute it from the record)."""
    guess = _guess(action)
    if guess == target:
        return 1.0
    return 0.5 * sum(1 for c in action if ord(c) % 2 == 0) / max(1, len(action))


def _guess(action: str) -> int | None:
    found = re.search(r"\d+", action)
    return int(found.group()) if found else None


class GuessNumber(BaseTextEnv):
    """Guess the row's number in [1, 50] (its `reward_spec.ground_truth`)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.target = int(str(extras["reward_spec"]["ground_truth"]).strip())
        self.max_turns = int(extras.get("max_turns", 4))

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        intro = {"role": "system", "content": "Guess a number in [1, 50]."}
        return [intro, *[m for m in prompt if m["role"] != "system"]], {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        guess = _guess(action)
        paid = reward(action, self.target)
        if guess == self.target:
            return BaseTextEnvStepOutput(
                observations=[], reward=paid, done=True, metadata={"guess": guess}
            )
        if guess is None:
            hint = "Guess a number in [1, 50]."
        else:
            hint = "Higher." if guess < self.target else "Lower."
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": hint}],
            reward=paid,
            done=False,
            metadata={"guess": guess, "env": "GuessNumber"},
        )


class NotAnEnv:
    """A class that is not a skyrl-gym environment (for the loader's error)."""

    def init(self, prompt: Any) -> Any:
        return prompt, {}

    def step(self, action: str) -> Any:
        return {}
