"""Reward functions: a registry of built-ins, user functions loaded by import path, and
the `remote` reward server.

Each configured function becomes a `RewardComponent` that scores a shard's rows into one
`Outcome` per row (ok with the returned value, or timeout / error). Built-ins run in this
process; import-path functions run in worker processes that are killed on timeout
(`rftpipe.rewards.pool`); `remote` posts each row to a server (`rftpipe.rewards.remote`).
The score stage (`rftpipe.stages.score`) turns outcomes into columns and applies
`reward.on_error`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any, Literal, Protocol

from rftpipe.config.schema import RewardConfig, RewardFunctionConfig, RewardSignature
from rftpipe.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSample:
    """One row to score (picklable: it crosses to the worker processes as is)."""

    step: int
    prompt_id: int
    sample_idx: int
    prompt: str
    response: str
    answer: str | None
    data_source: str
    """Which dataset the row came from (verl's `data_source`)."""
    metadata: dict[str, Any]
    response_token_ids: list[int]
    finish_reason: str

    @property
    def where(self) -> str:
        """The row, as error messages name it."""
        return f"step {self.step} prompt_id {self.prompt_id} sample_idx {self.sample_idx}"


def data_source_of(row: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """Which dataset a committed row came from ("" if unknown)."""
    # reasoning-gym names its dataset `source_dataset`; verl-format rows `data_source`.
    return str(
        row.get("data_source") or metadata.get("data_source") or metadata.get("source_dataset", "")
    )


Status = Literal["ok", "timeout", "error"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one function made of one row."""

    status: Status
    value: Any = None
    """The returned value (status ok): a number, or a dict with a numeric `score`."""
    error: str = ""
    """Why it failed (`Type: message`), for status timeout or error."""


class RewardComponent(Protocol):
    """One configured reward function, ready to score rows."""

    spec: RewardFunctionConfig

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        """One outcome per sample, in order. With `fail_fast` it may stop after the first
        failed row, leaving None for the rows it did not score."""
        ...


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


def _overlong(cfg: RewardConfig, response_budget: int) -> RewardFn:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", arXiv:2503.14476, Eq. 13).

    With ``L_max = rollout.max_new_tokens`` and ``L_cache = reward.overlong_buffer``:
    0 up to ``L_max - L_cache`` tokens, then falling linearly to ``-overlong_penalty`` at
    ``L_max`` (and ``-overlong_penalty`` beyond, which our engines never produce). Added to
    the task reward, it tells a truncated response from a wrong one without the cliff of a
    hard length penalty.
    """
    if not 1 <= cfg.overlong_buffer <= response_budget:
        raise UserError(
            f"reward.overlong_buffer={cfg.overlong_buffer} must be in [1, "
            f"rollout.max_new_tokens={response_budget}]"
        )
    start = response_budget - cfg.overlong_buffer

    def overlong(s: RewardSample) -> float:
        excess = min(len(s.response_token_ids) - start, cfg.overlong_buffer)
        return -cfg.overlong_penalty * max(0, excess) / cfg.overlong_buffer

    return overlong


#: Built-ins scored by the response length against the rollout's budget
#: (rollout.max_new_tokens), which the reward config alone does not know.
BUILTIN_LENGTH_REWARDS: dict[str, Callable[[RewardConfig, int], RewardFn]] = {
    "overlong": _overlong,
}


def math_verify_score(s: RewardSample) -> float:
    """1.0 if the response's final mathematical answer equals the reference by
    math-verify (parse both, then verify: LaTeX, fractions, decimals, sets, boxed answers;
    `\\frac{1}{2}` equals 0.5), else 0.0. Runs in the worker pool (`POOLED_BUILTINS`):
    sympy can take unbounded time on adversarial input, and the pool kills it."""
    from math_verify import parse, verify

    if s.answer is None:
        raise ValueError("math_verify needs an answer column")
    gold = parse(s.answer)
    if not gold:
        raise ValueError(f"math_verify cannot parse the reference answer {s.answer!r}")
    return float(verify(gold, parse(s.response)))


#: Built-ins that run in the killable worker processes: name -> (import path, the module
#: it needs, the package that provides it).
POOLED_BUILTINS: dict[str, tuple[str, str, str]] = {
    "math_verify": ("rftpipe.rewards.resolve:math_verify_score", "math_verify", "math-verify")
}

#: In-process built-ins: ours, fast, and `accuracy` holds the dataset's scorer object,
#: which no worker process could import by path.
BUILTIN_REWARDS: dict[str, Callable[[RewardConfig, Any], RewardFn]] = {
    "accuracy": _accuracy,
    "format": _format,
    "dense_even_tokens": _dense_even_tokens,
}


# ----------------------------------------------------------------- calling conventions


def _call_rftpipe(fn: Callable[..., Any], samples: Sequence[RewardSample]) -> list[Any]:
    return [fn(s) for s in samples]


def _call_verl(fn: Callable[..., Any], samples: Sequence[RewardSample]) -> list[Any]:
    # verl passes these by keyword (`default_compute_score(data_source=..., ...)`).
    return [
        fn(
            data_source=s.data_source,
            solution_str=s.response,
            ground_truth=s.answer,
            extra_info=s.metadata.get("extra_info", s.metadata),
        )
        for s in samples
    ]


def _call_trl(fn: Callable[..., Any], samples: Sequence[RewardSample]) -> Any:
    # The return value is checked in the parent (`split_batch`): a wrong one fails the run.
    return fn(**trl_columns(samples))


def trl_columns(samples: Sequence[RewardSample]) -> dict[str, list[Any]]:
    """TRL's keyword arguments: `prompts`, `completions`, `completion_ids`, then the
    dataset's columns, one list entry per completion."""
    return {
        "prompts": [s.prompt for s in samples],
        "completions": [s.response for s in samples],
        "completion_ids": [s.response_token_ids for s in samples],
        "answer": [s.answer for s in samples],
        "data_source": [s.data_source for s in samples],
        "metadata": [s.metadata for s in samples],
        "prompt_id": [s.prompt_id for s in samples],
        "sample_idx": [s.sample_idx for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
    }


#: signature -> how one call scores a batch of rows (one row, or TRL's one group).
SIGNATURES: dict[RewardSignature, Callable[[Callable[..., Any], Sequence[RewardSample]], Any]] = {
    "rftpipe": _call_rftpipe,
    "verl": _call_verl,
    "trl": _call_trl,
}


def batches(signature: RewardSignature, samples: Sequence[RewardSample]) -> list[list[int]]:
    """Row indices of each call: one row per call, or (trl) each group's rows per call."""
    if signature != "trl":
        return [[i] for i in range(len(samples))]
    order = sorted(range(len(samples)), key=lambda i: samples[i].prompt_id)
    return [list(g) for _, g in groupby(order, key=lambda i: samples[i].prompt_id)]


def split_batch(signature: RewardSignature, value: Any, n: int) -> list[Any]:
    """One call's return value as one value per row; TypeError if it is not that."""
    if signature == "trl" and not (isinstance(value, list | tuple) and len(value) == n):
        raise TypeError(
            f"returned {_describe(value)}; a trl function returns a list of {n} values, "
            "one per completion"
        )
    return list(value)


# ------------------------------------------------------------------------ return values


def parse_value(value: Any) -> tuple[float, dict[str, Any]]:
    """A returned value as (score, extra components); TypeError/ValueError if malformed."""
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' entry (keys {sorted(value)})")
        extra = {str(k): v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {_describe(value)}, not a number or a dict with 'score'")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}")
    return score, extra


def _describe(value: Any) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


# ------------------------------------------------------------------------ components


@dataclass(slots=True)
class InProcess:
    """A built-in, called in this process (ours, fast, never hangs)."""

    spec: RewardFunctionConfig
    fn: RewardFn

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        out: list[Outcome | None] = []
        for s in samples:
            try:
                out.append(Outcome("ok", self.fn(s)))
            except Exception as exc:
                out.append(Outcome("error", error=f"{type(exc).__name__}: {exc}"))
                if fail_fast:
                    return out + [None] * (len(samples) - len(out))
        return out


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
    _check_arguments(spec, fn)
    return fn


_PROBE: dict[RewardSignature, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "rftpipe": ((None,), {}),
    "verl": ((), dict.fromkeys(("data_source", "solution_str", "ground_truth", "extra_info"))),
    "trl": ((), trl_columns([])),
}


def _check_arguments(spec: RewardFunctionConfig, fn: Callable[..., Any]) -> None:
    """Refuse a function that cannot take its declared signature's arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function without introspection: the first call tells
    args, kwargs = _PROBE[spec.signature]
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise UserError(
            f"reward.functions: '{spec.path}' cannot be called with the {spec.signature} "
            f"signature ({exc}); set its `signature` to rftpipe, verl or trl"
        ) from exc


def _reward_model(spec: RewardFunctionConfig, cfg: RewardConfig, device: Any) -> RewardComponent:
    # Imported on use: it loads transformers, which a config without a model never needs.
    from rftpipe.rewards.model import RewardModel

    return RewardModel.build(spec, device)


#: Built-ins that are components of their own (a model, rather than a function per row),
#: built from (spec, reward config, this rank's device: a torch.device or its name).
BUILTIN_COMPONENTS: dict[
    str, Callable[[RewardFunctionConfig, RewardConfig, Any], RewardComponent]
] = {
    "reward_model": _reward_model,
}


def builtin_names() -> list[str]:
    """Every built-in name `reward.functions` takes."""
    tables = (BUILTIN_REWARDS, BUILTIN_LENGTH_REWARDS, POOLED_BUILTINS, BUILTIN_COMPONENTS)
    return sorted([*(name for t in tables for name in t), "remote"])


def resolve(
    spec: RewardFunctionConfig,
    cfg: RewardConfig,
    scorer: Any,
    response_budget: int | None = None,
    device: Any = "cpu",
) -> RewardComponent:
    if spec.path in BUILTIN_COMPONENTS:
        return BUILTIN_COMPONENTS[spec.path](spec, cfg, device)
    builtin = spec.path in BUILTIN_REWARDS or spec.path in BUILTIN_LENGTH_REWARDS
    if builtin and spec.signature != "rftpipe":
        raise UserError(f"reward.functions: built-in '{spec.path}' has no signature to set")
    if spec.path in BUILTIN_REWARDS:
        return InProcess(spec, BUILTIN_REWARDS[spec.path](cfg, scorer))
    if spec.path in BUILTIN_LENGTH_REWARDS:
        if response_budget is None:
            raise UserError(f"reward.functions: '{spec.path}' needs rollout.max_new_tokens")
        return InProcess(spec, BUILTIN_LENGTH_REWARDS[spec.path](cfg, response_budget))
    if spec.path in POOLED_BUILTINS:
        if spec.signature != "rftpipe":
            raise UserError(f"reward.functions: built-in '{spec.path}' has no signature to set")
        path, module, package = POOLED_BUILTINS[spec.path]
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
    if spec.path == "remote":
        from rftpipe.rewards.remote import RemoteReward

        return RemoteReward(spec, cfg.remote)
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
    if uncovered:
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
