"""Reward functions: one registry of built-ins, user functions loaded by import path, and
the resolver that turns `reward.functions` into components.

Each configured function becomes a `RewardComponent` (`rftpipe.rewards.types`) that scores
a shard's rows into one `Outcome` per row (ok with the returned value, or timeout /
error). In-process built-ins (`rftpipe.rewards.builtin`) run in this process; import-path
functions run in worker processes that are killed on timeout (`rftpipe.rewards.pool`);
`remote` posts each row to a server (`rftpipe.rewards.remote`); `reward_model` runs a
sequence-classification model, or a vision-language model as a judge
(`rftpipe.rewards.model`). The score stage
(`rftpipe.stages.score`) turns outcomes into columns and applies `reward.on_error`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rftpipe.config.schema import RewardConfig, RewardFunctionConfig
from rftpipe.errors import UserError
from rftpipe.rewards import builtin
from rftpipe.rewards.signatures import check_arguments
from rftpipe.rewards.types import RewardComponent, RewardFn

log = logging.getLogger(__name__)

#: How a registered name becomes its component, from (spec, reward config, the dataset's
#: scorer, rollout.max_new_tokens or None, this rank's device: a torch.device or its name).
Builder = Callable[[RewardFunctionConfig, RewardConfig, Any, int | None, Any], RewardComponent]


def _no_signature(spec: RewardFunctionConfig) -> None:
    if spec.signature != "rftpipe":
        raise UserError(f"reward.functions: built-in '{spec.path}' has no signature to set")


def _in_process(make: Callable[[RewardConfig, Any], RewardFn]) -> Builder:
    """An in-process built-in: ours, fast, and (`accuracy`) holding the dataset's scorer
    object, which no worker process could import by path."""

    def build(
        spec: RewardFunctionConfig,
        cfg: RewardConfig,
        scorer: Any,
        response_budget: int | None,
        device: Any,
    ) -> RewardComponent:
        _no_signature(spec)
        return builtin.InProcess(spec, make(cfg, scorer))

    return build


def _length_scored(make: Callable[[RewardConfig, int], RewardFn]) -> Builder:
    """An in-process built-in scored by the response length against the rollout's budget
    (rollout.max_new_tokens), which the reward config alone does not know."""

    def build(
        spec: RewardFunctionConfig,
        cfg: RewardConfig,
        scorer: Any,
        response_budget: int | None,
        device: Any,
    ) -> RewardComponent:
        _no_signature(spec)
        if response_budget is None:
            raise UserError(f"reward.functions: '{spec.path}' needs rollout.max_new_tokens")
        return builtin.InProcess(spec, make(cfg, response_budget))

    return build


def _pooled(path: str, module: str, package: str) -> Builder:
    """A built-in run in the killable worker processes, by its import `path`; it needs
    `module`, which the package `package` provides."""

    def build(
        spec: RewardFunctionConfig,
        cfg: RewardConfig,
        scorer: Any,
        response_budget: int | None,
        device: Any,
    ) -> RewardComponent:
        _no_signature(spec)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UserError(
                f"reward.functions: built-in '{spec.path}' needs the {package} package "
                f"(pip install {package}): {exc}"
            ) from exc
        from rftpipe.rewards.pool import Pooled, shared_pool

        # The worker imports it by path; the column keeps the built-in's name.
        pooled = replace(spec, path=path, name=spec.name or spec.path)
        return Pooled(pooled, spec.timeout_s or cfg.timeout_s, shared_pool(cfg.workers))

    return build


def _remote(
    spec: RewardFunctionConfig,
    cfg: RewardConfig,
    scorer: Any,
    response_budget: int | None,
    device: Any,
) -> RewardComponent:
    from rftpipe.rewards.remote import RemoteReward

    return RemoteReward(spec, cfg.remote)


def _reward_model(
    spec: RewardFunctionConfig,
    cfg: RewardConfig,
    scorer: Any,
    response_budget: int | None,
    device: Any,
) -> RewardComponent:
    # Imported on use: it loads transformers, which a config without a model never needs.
    from rftpipe.rewards import model

    return model.build(spec, device)


#: Every name `reward.functions` takes besides `module:function` -> its builder.
BUILTINS: dict[str, Builder] = {
    "accuracy": _in_process(builtin.accuracy),
    "format": _in_process(builtin.format_reward),
    "dense_even_tokens": _in_process(builtin.dense_even_tokens),
    "overlong": _length_scored(builtin.overlong),
    "math_verify": _pooled(
        "rftpipe.rewards.builtin:math_verify_score", "math_verify", "math-verify"
    ),
    "remote": _remote,
    "reward_model": _reward_model,
}


def builtin_names() -> list[str]:
    """Every built-in name `reward.functions` takes."""
    return sorted(BUILTINS)


def _import(spec: RewardFunctionConfig) -> Callable[..., Any]:
    """Import `module:function` here, so a bad path fails at start-up, not in a worker."""
    module, _, name = spec.path.partition(":")
    try:
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"reward.functions: cannot import '{spec.path}': {exc}") from exc
    if not callable(fn):
        raise UserError(f"reward.functions: '{spec.path}' is not callable")
    check_arguments(spec, fn)
    return fn


def resolve(
    spec: RewardFunctionConfig,
    cfg: RewardConfig,
    scorer: Any,
    response_budget: int | None = None,
    device: Any = "cpu",
) -> RewardComponent:
    if spec.path in BUILTINS:
        return BUILTINS[spec.path](spec, cfg, scorer, response_budget, device)
    if ":" not in spec.path:
        raise UserError(
            f"reward.functions: unknown reward '{spec.path}' (built-ins: {builtin_names()}; "
            "or give module:function)"
        )
    _import(spec)
    from rftpipe.rewards.pool import Pooled, shared_pool

    return Pooled(spec, spec.timeout_s or cfg.timeout_s, shared_pool(cfg.workers))


def applies(spec: RewardFunctionConfig, data_source: str) -> bool:
    """Whether `spec` scores rows of `data_source` (no declared sources: every row)."""
    return not spec.data_sources or data_source in spec.data_sources


def check_coverage(cfg: RewardConfig, data_sources: set[str]) -> None:
    """Refuse data whose rows of some source no reward function would score (their reward
    would be a silent 0); warn about declared sources the data does not have."""
    specs = cfg.specs()
    uncovered = sorted(d for d in data_sources if not any(applies(s, d) for s in specs))
    # No function at all: a multi-turn environment's rewards score every row (the config
    # refuses an empty list without one).
    if uncovered and specs:
        raise UserError(
            f"reward.functions: no function scores data source {uncovered[0]!r} (the data "
            f"has {sorted(data_sources)}); add it to a function's `data_sources`, or leave "
            "one function's `data_sources` empty to score every source"
        )
    for s in specs:
        if missing := sorted(set(s.data_sources) - data_sources):
            log.warning(
                "reward.functions: %s declares data sources %s the data lacks", s.path, missing
            )


def resolve_all(
    cfg: RewardConfig, scorer: Any, response_budget: int | None = None, device: Any = "cpu"
) -> dict[str, RewardComponent]:
    """Column name -> component, validated at start-up (before anything runs).

    `response_budget` is rollout.max_new_tokens, which the length-scored built-ins need; a
    reward model is loaded onto `device` (this rank's)."""
    return {
        spec.column: resolve(spec, cfg, scorer, response_budget, device) for spec in cfg.specs()
    }
