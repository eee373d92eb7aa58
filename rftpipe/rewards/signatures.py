"""Calling conventions of user reward functions: how a function of each `signature`
(rftpipe, verl, TRL) is called on rows, which rows share a call, what a call may return,
and the start-up check that a function takes its signature's arguments."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from itertools import groupby
from typing import Any

from rftpipe.config.schema import RewardFunctionConfig, RewardSignature
from rftpipe.errors import UserError
from rftpipe.rewards.types import RewardSample


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
    dataset's columns, one list entry per completion. `images` holds each completion's
    prompt's images decoded (PIL, RGB; empty for a text prompt), as TRL passes a VLM
    dataset's `images` column. A group's completions share their prompt's images: each is
    decoded once per call."""
    decoded = {im.sha256: im for s in samples for im in s.images}
    pil = {sha: im.pil() for sha, im in decoded.items()}
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
        "images": [[pil[im.sha256] for im in s.images] for s in samples],
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


# ------------------------------------------------------------------- start-up check


_PROBE: dict[RewardSignature, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "rftpipe": ((None,), {}),
    "verl": ((), dict.fromkeys(("data_source", "solution_str", "ground_truth", "extra_info"))),
    "trl": ((), trl_columns([])),
}


def check_arguments(spec: RewardFunctionConfig, fn: Callable[..., Any]) -> None:
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
