"""Stage 3, advantage: reference logprobs (when a KL term is on) and per-token advantages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import torch

from rftpipe.algos.advantage import AdvantageInputs, Reducer, compute_advantages
from rftpipe.algos.losses import kl_estimate
from rftpipe.config.schema import AdvantageConfig, KLConfig

RefLogprobs = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[list[float]]]


def pad_ragged(
    rows: Sequence[Sequence[float]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged lists to (B, T) with a bool mask."""
    t_max = max(1, max((len(r) for r in rows), default=1))
    out = torch.zeros((len(rows), t_max), dtype=dtype)
    mask = torch.zeros((len(rows), t_max), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
        mask[i, : len(r)] = True
    return out, mask


def unpad(t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(t, mask, strict=True)]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageStageConfig:
    advantage: AdvantageConfig
    kl: KLConfig
    kl_coef: float
    """The controller's coefficient for this step (recorded in the manifest)."""


def run(
    cfg: AdvantageStageConfig,
    scored: pa.Table,
    ref_logprobs: RefLogprobs | None,
    reduce_sum: Reducer,
) -> pa.Table:
    logprobs = scored.column("logprobs").to_pylist()
    old, mask = pad_ragged(logprobs, torch.float64)
    out = scored
    penalty = None
    if cfg.kl.mode != "none":
        assert ref_logprobs is not None, "a KL term needs the reference model"
        ref = ref_logprobs(
            scored.column("prompt_token_ids").to_pylist(),
            scored.column("response_token_ids").to_pylist(),
        )
        out = out.append_column(
            pa.field("ref_logprobs", pa.list_(pa.float32())), pa.array(ref, pa.list_(pa.float32()))
        )
        if cfg.kl.mode == "reward":
            # Read back through float32, exactly as the train stage will see these columns.
            ref_t, _ = pad_ragged(out.column("ref_logprobs").to_pylist(), torch.float64)
            old32, _ = pad_ragged(scored.column("logprobs").to_pylist(), torch.float64)
            penalty = cfg.kl_coef * kl_estimate(old32, ref_t, cfg.kl.estimator) * mask
    group = torch.tensor(scored.column("prompt_id").to_pylist(), dtype=torch.int64)
    inputs = AdvantageInputs(
        rewards=torch.tensor(scored.column("reward").to_pylist(), dtype=torch.float64),
        group_index=group,
        response_mask=mask,
        token_kl_penalty=penalty,
    )
    adv = compute_advantages(
        cfg.advantage.estimator,
        inputs,
        eps=cfg.advantage.eps,
        gamma=cfg.advantage.gamma,
        reduce_sum=reduce_sum,
    )
    return out.append_column(
        pa.field("advantages", pa.list_(pa.float32())),
        pa.array(unpad(adv, mask), pa.list_(pa.float32())),
    )
