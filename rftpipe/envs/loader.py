"""Build the environment `rollout.env` names: a class by import path (`pkg.mod:Class`),
a registered skyrl-gym environment (`skyrl:<env_id>`) or a TRL-style class
(`trl:pkg.mod:Class`). Every failure is a one-line UserError naming `rollout.env.path`
(or `rollout.env.kwargs` when the constructor refuses them)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rftpipe.config.schema import EnvConfig
from rftpipe.envs.base import FIELD, Environment
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
        raise UserError(f"{FIELD}: class '{path}' has no {' or '.join(missing)} method")
    return obj


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
        return SkyRLEnvironment(rest, cfg.max_turns, dict(cfg.kwargs))
    if kind == "trl":
        cls = load_environment_class(rest, needs=("reset",))
        return TRLEnvironment(_construct(cls, dict(cfg.kwargs)), cfg.tool_parser)
    cls = load_environment_class(cfg.path)
    kwargs = dict(cfg.kwargs)
    if issubclass(cls, ToolEnvironment):
        kwargs = {"parser": cfg.tool_parser, **kwargs}
    env: Environment = _construct(cls, kwargs)
    return env
