"""Reward functions: a registry of built-ins plus user functions loaded by import path.

A reward function maps one ``RewardSample`` to a float. Each configured function becomes
its own ``reward_<name>`` column; ``reward`` is their weighted sum.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rftpipe.config.schema import RewardConfig
from rftpipe.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSample:
    prompt_id: int
    sample_idx: int
    prompt: str
    response: str
    answer: str | None
    metadata: dict[str, Any]
    response_token_ids: list[int]
    finish_reason: str


RewardFn = Callable[[RewardSample], float]
Extractor = Callable[[str], str | None]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

EXTRACTORS: dict[str, Extractor] = {
    # The whole response is the answer: the policy must learn to answer tersely.
    "full": lambda r: r.strip().rstrip(".").strip() or None,
    "last_number": lambda r: m[-1] if (m := _NUMBER.findall(r)) else None,
    "answer_tag": lambda r: m.group(1).strip() if (m := _TAG.search(r)) else None,
}

_FORMAT_CHECKS: dict[str, Callable[[RewardSample], bool]] = {
    "full": lambda s: s.finish_reason == "stop" and "\n" not in s.response.strip(),
    "last_number": lambda s: s.finish_reason == "stop" and bool(_NUMBER.search(s.response)),
    "answer_tag": lambda s: len(_TAG.findall(s.response)) == 1,
}


def _accuracy(cfg: RewardConfig, scorer: Any) -> RewardFn:
    extract = EXTRACTORS[cfg.extractor]

    def accuracy(s: RewardSample) -> float:
        if s.answer is None:
            raise ValueError("accuracy needs an answer column")
        if cfg.require_stop and s.finish_reason != "stop":
            return 0.0
        guess = extract(s.response)
        if scorer is not None and hasattr(scorer, "score_answer"):
            # The dataset's own verifier (reasoning-gym), fed the extracted answer.
            return float(scorer.score_answer(guess, {"answer": s.answer, "metadata": s.metadata}))
        return float(guess is not None and guess == s.answer.strip())

    return accuracy


def _format(cfg: RewardConfig, scorer: Any) -> RewardFn:
    check = _FORMAT_CHECKS[cfg.extractor]
    return lambda s: float(check(s))


def _dense_even_tokens(cfg: RewardConfig, scorer: Any) -> RewardFn:
    """Synthetic dense reward for tiny random models: the share of even token ids.

    A random-init model never earns a verifier reward, so tests use this to get nonzero
    advantage variance in every group and a learnable signal.
    """

    def dense(s: RewardSample) -> float:
        ids = s.response_token_ids
        return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))

    return dense


BUILTIN_REWARDS: dict[str, Callable[[RewardConfig, Any], RewardFn]] = {
    "accuracy": _accuracy,
    "format": _format,
    "dense_even_tokens": _dense_even_tokens,
}


def column_name(spec: str) -> str:
    """`reward_<name>`; import paths use their function name."""
    return "reward_" + spec.rsplit(":", 1)[-1].replace(".", "_")


def resolve(spec: str, cfg: RewardConfig, scorer: Any) -> RewardFn:
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec](cfg, scorer)
    if ":" not in spec:
        raise UserError(
            f"reward.functions: unknown reward '{spec}' (built-ins: {sorted(BUILTIN_REWARDS)}; "
            "or give module:function)"
        )
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"reward.functions: cannot import '{spec}': {exc}") from exc
    if not callable(fn):
        raise UserError(f"reward.functions: '{spec}' is not callable")
    return fn


def resolve_all(cfg: RewardConfig, scorer: Any) -> dict[str, RewardFn]:
    """Column name -> function, validated at start-up (before anything runs)."""
    fns = {column_name(spec): resolve(spec, cfg, scorer) for spec in cfg.functions}
    if len(fns) != len(cfg.functions):
        raise UserError(f"reward.functions: two entries share a column name: {list(cfg.functions)}")
    return fns
