"""The rollout-engine interface and what its engines share.

Every engine (the HF loop in `hf`, vLLM in `vllm`, SGLang in `sglang`) implements the same
Protocol: generate one group with per-token logprobs of the sampling distribution
(logits / T, before top-k/top-p), generate one sample per row for multi-turn episodes
(`generate_rows`, and `greedy_rows` for their held-out evaluation; HF and vLLM), take new weights, and sleep/wake around training.
`rftpipe.engines.rollout.ROLLOUT_ENGINES` builds one by `rollout.engine`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from rftpipe.engines.vision import VisionInputs

FinishReason = Literal["stop", "length"]
Vision = Sequence[VisionInputs | None] | None
"""Per prompt of a call, its images (None: a text prompt); None for a call without any."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupOutput:
    """n samples of one prompt."""

    tokens: list[list[int]]
    """Response token ids per sample, EOS included when generated."""
    logprobs: list[list[float]]
    """log softmax(logits / T) of each sampled token, same lengths as `tokens`."""
    finish_reasons: list[FinishReason]
    routes: list[torch.Tensor] | None = None
    """An MoE policy's recorded routes per sample (`rftpipe.engines.moe`): (P + R - 1, L,
    k) uint8, the experts each fed token (the prompt's, then every sampled token but the
    last) was routed to; None when the engine records none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleOutput:
    """One sample of one prompt (a multi-turn episode's turn)."""

    tokens: list[int]
    """Sampled token ids, EOS included when generated."""
    logprobs: list[float]
    """log softmax(logits / T) of each sampled token."""
    finish_reason: FinishReason
    routes: torch.Tensor | None = None
    """An MoE policy's routes under R3 (`rftpipe.engines.moe`): (P + R - 1, L, k) uint8
    over the row's prompt and its sampled tokens but the last (P when none was sampled);
    None when the engine records none."""


@dataclass(slots=True)
class DecodeCounts:
    """The HF loop's decode forwards and the rows they fed, against what a static batch
    would have fed (every call row at every forward): `rollout/decode_row_steps`."""

    forwards: int = 0
    row_steps: int = 0
    static_row_steps: int = 0

    def add(self, forwards: int, row_steps: int, rows: int) -> None:
        """Count a call's `forwards`, feeding `row_steps` rows in all, of its `rows` rows."""
        self.forwards += forwards
        self.row_steps += row_steps
        self.static_row_steps += forwards * rows


class RolloutEngine(Protocol):
    weight_version: int
    """The train step whose weights the engine samples from (0: the initial ones)."""

    @property
    def groups_per_call(self) -> int:
        """How many groups the rollout stage hands over at once."""
        ...

    @property
    def collective(self) -> bool:
        """Ranks share the engine (tensor parallelism): each must make the same number of
        `generate_groups` and `greedy` calls, together, even with nothing to ask."""
        ...

    def generate_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seeds: Sequence[int],
        *,
        vision: Vision = None,
    ) -> list[GroupOutput]:
        """n samples of each prompt; `seeds[g]` is group g's seed, derived from (run seed,
        step, stage, prompt id). An engine seeds each sample from its group's seed and its
        index (`rftpipe.seeding.sample_seed`), or (the HF loop with
        `rollout.compact_decode=off`) draws from one generator per call, seeded by the first
        group's seed. `vision`:
        each prompt's images (a vision-language model), also in the other generating
        calls."""
        ...

    def generate_rows(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_new: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        *,
        vision: Vision = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleOutput]:
        """One sample of each prompt (a multi-turn episode's next turn): row r drawn from
        `seeds[r]` alone (from run seed, step, stage, prompt id, sample, turn) and cut at
        `max_new[r]` new tokens (0: not generated, an empty `length` sample), so a row does
        not depend on the other rows' seeds. `keys` name each row's episode, for an engine
        that `continues_turns`; the others ignore them. `routes`: each row's routes
        recorded so far over its prompt's first tokens (an engine that records routes
        forces them; the others ignore them). SGLang raises NotImplementedError."""
        ...

    @property
    def continues_turns(self) -> bool:
        """Whether the engine keeps each episode's computation between turns (the HF loop's
        KV cache) by `generate_rows`' keys: a resumed stage must then replay the committed
        turns through it (`max_new` 0) before the next. vLLM's prefix cache needs no keys."""
        ...

    def end_episodes(self, keys: Iterable[Hashable] | None = None) -> None:
        """Free what is kept for the episodes `keys` (None: all); a no-op for engines that
        keep nothing."""
        ...

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, vision: Vision = None
    ) -> list[list[int]]:
        """Greedy completions without their EOS (evaluation)."""
        ...

    def greedy_rows(
        self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], *, vision: Vision = None
    ) -> list[SampleOutput]:
        """The greedy continuation of each prompt (a held-out evaluation episode's next
        turn), as `generate_rows` gives a sample: EOS kept, cut at `max_new[r]` new tokens
        (0: an empty `length` row), ended by a stop string; logprobs 0 (not recorded).
        SGLang raises NotImplementedError."""
        ...

    def update_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor] | Path, version: int
    ) -> None:
        """Sample from `weights` from now on; wakes a sleeping engine first. A `Path` is a
        directory of safetensors (`rollout.inference.weight_sync=disk`), which only engines
        that hold their own copy of the weights (vLLM, SGLang) take."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds on the accelerator while the trainer runs (idempotent)."""
        ...

    def wake(self) -> None:
        """Undo `sleep` (idempotent); generating wakes the engine by itself."""
        ...

    def close(self) -> None:
        """Release the engine and end any process of its own; it is not used again."""
        ...

    def take_decode_counts(self) -> DecodeCounts | None:
        """Decode forwards and rows fed since the last call (the HF loop's; None for an
        engine that schedules its own batches, where an ended request leaves at once)."""
        ...


def split_groups(
    tokens: list[list[int]],
    logprobs: list[list[float]],
    reasons: list[FinishReason],
    n: int,
    routes: list[torch.Tensor] | None = None,
) -> list[GroupOutput]:
    """Rows of consecutive groups of n samples, as one `GroupOutput` per group."""
    return [
        GroupOutput(
            tokens=tokens[i : i + n],
            logprobs=logprobs[i : i + n],
            finish_reasons=reasons[i : i + n],
            routes=None if routes is None else routes[i : i + n],
        )
        for i in range(0, len(tokens), n)
    ]
