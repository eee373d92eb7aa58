"""The reward data types: the row a function scores (`RewardSample`), what it made of the
row (`Outcome`), and the protocol every configured reward component follows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rftpipe.config.schema import RewardFunctionConfig


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
    messages: list[dict[str, Any]] | None = None
    """A multi-turn episode's whole conversation (`rollout.env`), whose last assistant
    message is `response`; None for a single-turn row."""

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
