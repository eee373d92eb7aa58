"""Small environments for the multi-turn tests (`rollout.env.path=envs_toy:NAME`; tests/ is
on the path of the test processes and of the runs they launch).

A random-init tiny model earns no reward on a real task, so `EvenChars` pays a dense
synthetic reward: the share of a response's characters whose code point is even, which a
policy can learn turn by turn.
"""

from __future__ import annotations

from typing import Any

from rftpipe.envs.base import StepResult, Task


class EvenChars:
    """Rewards even characters; answers every response with feedback until `max_turns`."""

    def __init__(self, feedback: str = "Again, more even.") -> None:
        self.feedback = feedback
        self.turn = 0
        self.closed = False

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.turn = 0
        return [dict(m) for m in task.messages], {"seed": seed}

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        even = sum(1 for c in action_text if ord(c) % 2 == 0) / max(1, len(action_text))
        feedback = f"{self.feedback} (turn {self.turn}: {even:.2f})"
        return StepResult(
            observations=[{"role": "user", "content": feedback}],
            reward=even,
            done=False,
            info={"turn": self.turn},
        )

    def close(self) -> None:
        self.closed = True


class StopsOnA(EvenChars):
    """Done as soon as a response contains an `a`; otherwise as EvenChars."""

    def step(self, action_text: str) -> StepResult:
        out = super().step(action_text)
        if "a" in action_text:
            return StepResult(observations=[], reward=1.0, done=True, info=out.info)
        return out


class Raises(EvenChars):
    """Fails on its second step."""

    def step(self, action_text: str) -> StepResult:
        if self.turn >= 1:
            raise RuntimeError("the environment broke")
        return super().step(action_text)


class WrongTypes(EvenChars):
    """Returns a reward that is not a number."""

    def step(self, action_text: str) -> Any:
        return {"observations": [], "reward": "high", "done": False}


class Drifts(EvenChars):
    """Not deterministic given its seed: its rewards depend on how many were made before."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        Drifts.made += 1
        self.bonus = Drifts.made

    def step(self, action_text: str) -> StepResult:
        out = super().step(action_text)
        return StepResult(observations=out.observations, reward=out.reward + self.bonus, done=False)


class Remembers(Drifts):
    """As Drifts, but declares it: a restart hands it the recorded conversation instead."""

    replayable = False
    restored: list[int] = []

    def restore(self, messages: list[dict[str, Any]], turn_infos: list[str]) -> None:
        Remembers.restored.append(len(messages))


class HangsOnEvenSeeds(EvenChars):
    """Hangs in its second step when reset with an even seed (a stuck tool call)."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.seed = seed
        return super().reset(task, seed)

    def step(self, action_text: str) -> StepResult:
        if self.turn == 1 and self.seed % 2 == 0:
            import time

            time.sleep(600)
        return super().step(action_text)


class EndsFourWays(EvenChars):
    """Each episode ends one way, by its reset seed mod 4: `done` after the first turn, an
    `error` on the second step (under `rollout.env.on_error=end_episode`), a first
    observation too long for a 96-token `rollout.env.max_total_tokens` (`truncated`), or
    EvenChars' feedback until `max_turns`; so one step's rows show every `episode_status`."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.way = seed % 4
        return super().reset(task, seed)

    def step(self, action_text: str) -> StepResult:
        out = super().step(action_text)
        if self.way == 0:
            return StepResult(observations=[], reward=out.reward, done=True, info=out.info)
        if self.way == 1 and self.turn >= 2:
            raise RuntimeError("the environment broke")
        if self.way == 2:
            long = [{"role": "user", "content": "odd " * 60}]
            return StepResult(observations=long, reward=out.reward, done=False, info=out.info)
        return out


class DropsImages(EvenChars):
    """Resets to the task's text alone: an image prompt's image parts are dropped."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        messages, info = super().reset(task, seed)
        for m in messages:
            if isinstance(m["content"], list):
                m["content"] = " ".join(p.get("text", "") for p in m["content"])
        return messages, info


class SpellsImagePad(EvenChars):
    """Answers with text that spells Qwen2-VL's image-pad token."""

    def step(self, action_text: str) -> StepResult:
        out = super().step(action_text)
        return StepResult(
            observations=[{"role": "user", "content": "look: <|image_pad|>"}],
            reward=out.reward,
            done=False,
            info=out.info,
        )


class ReadsAnswer(EvenChars):
    """Reads the task's answer as an integer at `reset` (a number to guess): a row whose
    answer is not one (e.g. "seven") makes `reset` raise."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.target = int(task.answer or "")
        return super().reset(task, seed)


class HangsOnBadAnswer(EvenChars):
    """Hangs in `reset` on a row whose answer is not an integer (a lookup that never
    returns)."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if not (task.answer or "").isdigit():
            import time

            time.sleep(600)
        return super().reset(task, seed)


class ResetsBadly(EvenChars):
    """Returns info that is not a dict from `reset` on a row whose answer is not an
    integer."""

    def reset(self, task: Task, seed: int) -> Any:
        messages, info = super().reset(task, seed)
        return messages, (info if (task.answer or "").isdigit() else "none")
