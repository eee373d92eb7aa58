"""Rollout-engine interface and its first implementation, HF `generate`.

vLLM and SGLang engines implement the same Protocol: generate one group with per-token
logprobs of the sampling distribution (logits / T, before top-k/top-p), take new weights,
and sleep/wake around training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from transformers import GenerationConfig

from rftpipe.config.schema import RolloutConfig

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupOutput:
    """n samples of one prompt."""

    tokens: list[list[int]]
    """Response token ids per sample, EOS included when generated."""
    logprobs: list[list[float]]
    """log softmax(logits / T) of each sampled token, same lengths as `tokens`."""
    finish_reasons: list[FinishReason]


class RolloutEngine(Protocol):
    weight_version: int

    def generate_groups(
        self, prompts: Sequence[Sequence[int]], n: int, seed: int
    ) -> list[GroupOutput]:
        """n samples of each prompt from one call whose randomness `seed` fully determines."""
        ...

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]: ...

    def update_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int
    ) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class HFGenerateEngine:
    """Generates with `model.generate`, `rollout.groups_per_call` groups per call.

    Which groups share a call is fixed by the step's global prompt order (see the rollout
    stage), so padding and batch shape, and with them the samples, are the same on any
    world size. The engine shares the trainer's module when colocated on one device, which
    makes a weight sync free.
    """

    def __init__(
        self, model: torch.nn.Module, cfg: RolloutConfig, eos_id: int, pad_id: int
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.weight_version = 0
        self.gen_cfg = GenerationConfig(
            do_sample=True,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            min_new_tokens=cfg.min_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )

    def generate_group(self, prompt_ids: Sequence[int], n: int, seed: int) -> GroupOutput:
        return self.generate_groups([prompt_ids], n, seed)[0]

    @torch.no_grad()
    def generate_groups(
        self, prompts: Sequence[Sequence[int]], n: int, seed: int
    ) -> list[GroupOutput]:
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        # Left padding; a single group has none, so its numerics never see padding.
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        was_training = self.model.training
        self.model.eval()
        # Sampling draws from the global generator: fork it so the derived seed fully
        # determines this call and nothing leaks into the caller's RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=self.gen_cfg
            )
        self.model.train(was_training)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / self.cfg.temperature  # (rows, T, V)
        lp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        tokens, logprobs, reasons = [], [], []
        for row, row_lp in zip(new.tolist(), lp.tolist(), strict=True):
            end = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            tokens.append(row[:end])
            logprobs.append(row_lp[:end])
            reasons.append("stop" if end <= len(row) and row[end - 1] == self.eos_id else "length")
        return [
            GroupOutput(
                tokens=tokens[g * n : (g + 1) * n],
                logprobs=logprobs[g * n : (g + 1) * n],
                finish_reasons=reasons[g * n : (g + 1) * n],
            )
            for g in range(len(prompts))
        ]

    @torch.no_grad()
    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch: int = 32
    ) -> list[list[int]]:
        """Greedy completions, left-padded batches (for evaluation, not for training rows)."""
        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            seq = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            for row in seq[:, width:].tolist():
                outs.append(row[: row.index(self.eos_id)] if self.eos_id in row else row)
        self.model.train(was_training)
        return outs

    def update_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Take new weights: free when they are this engine's own module (colocated)."""
        if weights is not self.model:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            self.model.load_state_dict(state)
        self.weight_version = version

    def sleep(self) -> None:
        """Nothing to release: the HF engine shares the trainer's memory."""

    def wake(self) -> None:
        """See `sleep`."""
