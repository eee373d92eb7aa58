"""Build the environment `rollout.env` names: a class by import path (`pkg.mod:Class`),
a registered skyrl-gym environment (`skyrl:<env_id>`), one's own skyrl-gym class
(`skyrl:pkg.mod:Class`) or a TRL-style class (`trl:pkg.mod:Class`); and the environment a
dataset row names in its `env_class` column (`row_env`). Every failure is a one-line
UserError naming `rollout.env.path` (or `rollout.env.kwargs` when the constructor refuses
them, or the row)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from rftpipe.config.schema import EnvConfig
from rftpipe.envs.base import FIELD, Environment, call
from rftpipe.envs.skyrl import SkyRLEnvironment
from rftpipe.envs.tools import ToolEnvironment
from rftpipe.envs.trl import TRLEnvironment
from rftpipe.errors import UserError


def load_environment_class(path: str, needs: tuple[str, ...] = ("reset", "step")) -> type:
    """The class `pkg.mod:Class` names, checked to have the methods `needs`."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise UserError(f"{FIELD}: '{path}' is not 'pkg.mod:Class'")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:  # any failure while importing the user's module
        raise UserError(
            f"{FIELD}: cannot import module '{module}' of '{path}': {type(exc).__name__}: {exc}"
        ) from exc
    for part in name.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{FIELD}: module '{module}' has no attribute '{name}'")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise UserError(f"{FIELD}: '{path}' is a {type(obj).__name__}, not a class")
    missing = [m for m in needs if not callable(getattr(obj, m, None))]
    if missing:
        raise UserError(
            f"{FIELD}: class '{path}' has no {' or '.join(missing)} method{_skyrl_hint(obj, path)}"
        )
    return obj


def _skyrl_hint(cls: type, path: str) -> str:
    """What to write instead when a skyrl-gym environment class (`init`/`step`, no `reset`)
    was named as a plain or TRL-style one."""
    skyrl_gym = sys.modules.get("skyrl_gym")  # imported by the class's module if it is one
    if skyrl_gym is None or not issubclass(cls, skyrl_gym.Env):
        return ""
    return f": it is a skyrl-gym environment, name it 'skyrl:{path.removeprefix('trl:')}'"


def _construct(cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`; kwargs its constructor does not take are a one-line UserError (an
    error raised inside the constructor is the user's own and propagates)."""
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise UserError(
            f"rollout.env.kwargs: {cls.__name__} does not take {sorted(kwargs)}: {exc}"
        ) from exc
    except ValueError:
        pass  # a class without an introspectable signature: the call tells
    return cls(**kwargs)


def make_environment(cfg: EnvConfig) -> Environment:
    """A new environment instance for `cfg` (one per concurrent episode)."""
    kind, _, rest = cfg.path.partition(":")
    if kind == "skyrl":
        # One's own class by path: imported here, so in every environment worker too.
        user = load_environment_class(rest, needs=()) if ":" in rest else None
        return SkyRLEnvironment(rest, cfg.max_turns, dict(cfg.kwargs), user)
    if kind == "trl":
        cls = load_environment_class(rest, needs=("reset",))
        return TRLEnvironment(_construct(cls, dict(cfg.kwargs)), cfg.tool_parser)
    cls = load_environment_class(cfg.path)
    kwargs = dict(cfg.kwargs)
    if issubclass(cls, ToolEnvironment):
        kwargs = {"parser": cfg.tool_parser, **kwargs}
    env: Environment = _construct(cls, kwargs)
    return env


ENV_CLASS_COLUMN = "env_class"
"""The dataset column that names a row's environment (SkyRL's layout)."""


def row_env(cfg: EnvConfig, metadata: Mapping[str, Any], where: str = "") -> EnvConfig:
    """The environment of a row's episodes: what its `env_class` column names, else
    (no column, or null) `cfg`'s own.

    A value without a colon is a skyrl-gym id, as SkyRL's datasets write it (`gsm8k` is
    `skyrl:gsm8k`); any other is a `rollout.env.path` (`skyrl:pkg.mod:Class`,
    `pkg.mod:Class`, ...). `cfg`'s budgets, parser and error policy hold for every row, its
    `kwargs` for its own environment only (another class is made without them). A value
    that is not a path is a one-line UserError naming `where`.

    Usage::

        row_env(EnvConfig(path="skyrl:gsm8k"), {"env_class": "gsm8k_multi_turn"}).path
        # 'skyrl:gsm8k_multi_turn'
    """
    value = metadata.get(ENV_CLASS_COLUMN)
    if value is None:
        return cfg
    if not isinstance(value, str):
        raise UserError(f"{where}: env_class {type(value).__name__} {value!r} is not a string")
    path = value if ":" in value else f"skyrl:{value}"
    if path == cfg.path:
        return cfg
    try:
        return dataclasses.replace(cfg, path=path, kwargs={})
    except ValueError as exc:
        raise UserError(f"{where}: env_class {value!r}: {exc}") from exc


def check_environments(cfg: EnvConfig, rows: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
    """Build and close one environment of `cfg` and one of each other environment the rows
    (`(where, metadata)`) name, so that a path that does not import, a class without
    `step`, kwargs it does not take or an unknown `env_class` fail at start-up, naming the
    first row that names it."""
    call(make_environment(cfg).close)
    seen = {cfg.path}
    for where, metadata in rows:
        env = row_env(cfg, metadata, where)
        if env.path in seen:
            continue
        seen.add(env.path)
        try:
            call(make_environment(env).close)
        except UserError as exc:
            raise UserError(f"{where}: env_class {metadata[ENV_CLASS_COLUMN]!r}: {exc}") from exc
