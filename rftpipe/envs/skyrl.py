"""The skyrl-gym adapter (`rollout.env.path: skyrl:<env_id>` or `skyrl:pkg.mod:Class`): an
environment registered with skyrl-gym, or one's own skyrl-gym class by import path, made
afresh for each episode by `skyrl_gym.make` because its constructor takes the task's
ground truth (`extras.reward_spec.ground_truth`)."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from rftpipe.envs.base import FIELD, StepResult, Task, checked_step_result
from rftpipe.errors import UserError


def import_skyrl_gym() -> ModuleType:
    """skyrl_gym, or a one-line UserError saying how to install it."""
    try:
        return importlib.import_module("skyrl_gym")
    except ImportError as exc:
        raise UserError(
            f"{FIELD}: skyrl: environments need the skyrl-gym package (pip install skyrl-gym): {exc}"
        ) from exc


def extras_for(task: Task, max_turns: int) -> dict[str, Any]:
    """skyrl-gym's per-row `extras` for `task`: the row's own fields (a skyrl-format row
    carries `reward_spec` and `extra_info`), else the task's answer as the ground truth;
    `max_turns` is ours, so the environment's last-turn prompt and per-turn scores agree
    with where the rollout stops (and `SkyRLEnvironment.step` keeps the environment from
    calling the cut its own end)."""
    extras = dict(task.metadata)
    extras.setdefault("reward_spec", {"method": "rule", "ground_truth": task.answer})
    extras.setdefault("extra_info", {})
    extras["max_turns"] = max_turns
    return extras


class SkyRLEnvironment:
    """One skyrl-gym environment behind our interface: the one registered as `env_id`, or
    `user_class` (named `env_id`, its `pkg.mod:Class`). skyrl-gym's `init` has no seed: its
    environments draw nothing at random, so `seed` is unused."""

    def __init__(
        self,
        env_id: str,
        max_turns: int,
        env_config: dict[str, Any],
        user_class: type | None = None,
    ) -> None:
        self.skyrl_gym = import_skyrl_gym()
        self.target: Any = env_id
        """What `skyrl_gym.make` takes: the registered id, or a spec of the user's class
        (made as skyrl-gym makes its own, without registering it in this process)."""
        if user_class is not None:
            _check_user_class(self.skyrl_gym, user_class, env_id)
            self.target = self.skyrl_gym.envs.registration.EnvSpec(
                id=env_id, entry_point=user_class
            )
        elif env_id not in self.skyrl_gym.registry:
            raise UserError(
                f"{FIELD}: no skyrl-gym environment 'skyrl:{env_id}' "
                f"(registered: {sorted(self.skyrl_gym.registry)}); for your own skyrl-gym "
                "class, name it 'skyrl:pkg.mod:Class'"
            )
        self.env_id = env_id
        self.max_turns = max_turns
        self.env_config = env_config
        self.env: Any = None
        self.where = ""
        self.turns = 0
        """Steps since the last reset."""

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.close()
        # skyrl's own environments read `env_config` by attribute (an OmegaConf node in
        # SkyRL); omegaconf is a dependency of skyrl-gym.
        from omegaconf import OmegaConf

        self.env = self.skyrl_gym.make(
            self.target,
            env_config=OmegaConf.create(self.env_config),
            extras=extras_for(task, self.max_turns),
        )
        self.where = f"prompt_id {task.prompt_id}"
        self.turns = 0
        messages, metadata = self.env.init([dict(m) for m in task.messages])
        return [dict(m) for m in messages], dict(metadata or {})

    def step(self, action_text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("SkyRLEnvironment.step before reset")
        self.turns += 1
        out = self._step_past_our_limit(action_text)
        return checked_step_result(out, f"skyrl:{self.env_id}", self.where)

    def _step_past_our_limit(self, action_text: str) -> Any:
        """The environment's step, on our last turn with its turn limit lifted by one.
        skyrl-gym's environments end an episode themselves at the `max_turns` we hand them
        (`done = turns >= max_turns or ...`), which would count every episode the rollout
        cuts as `done`; lifted, `done` on the last turn says the environment ended it on its
        own account (a right answer), and an episode it does not end is counted as
        `max_turns` by the rollout. Only the limit we handed it is lifted (a BaseTextEnv's
        `max_turns`), for that step alone. gsm8k_multi_turn scores the turn the same
        either way; search and text2sql score the answer an episode ends with, which a
        last turn they do not end lacks."""
        text_env = importlib.import_module("skyrl_gym.envs.base_text_env").BaseTextEnv
        env = self.env
        if not (
            self.turns == self.max_turns
            and isinstance(env, text_env)
            and env.max_turns == self.max_turns
        ):
            return env.step(action_text)
        env.max_turns = self.max_turns + 1
        try:
            return env.step(action_text)
        finally:
            env.max_turns = self.max_turns

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def _check_user_class(skyrl_gym: ModuleType, cls: type, path: str) -> None:
    """A one-line UserError unless `cls` is a skyrl-gym environment that `skyrl_gym.make`
    can build (`cls(env_config=..., extras=...)`)."""
    if not issubclass(cls, skyrl_gym.Env):
        raise UserError(
            f"{FIELD}: 'skyrl:{path}' is not a skyrl-gym environment (a skyrl_gym.Env "
            "subclass such as BaseTextEnv); name a class with reset(task, seed) as "
            f"'{path}'"
        )
    try:
        inspect.signature(cls).bind(env_config=None, extras={})
    except TypeError as exc:
        raise UserError(
            f"{FIELD}: 'skyrl:{path}' cannot be made as skyrl-gym makes environments, "
            f"{cls.__name__}(env_config=..., extras=...): {exc}"
        ) from exc
    except ValueError:
        pass  # a constructor without an introspectable signature: `make` tells
