"""Stage 2, score: every reward function becomes its own column; `reward` is their weighted sum."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyarrow as pa

from rftpipe.config.schema import RewardConfig
from rftpipe.errors import UserError
from rftpipe.rewards import RewardFn, RewardSample


def run(cfg: RewardConfig, fns: Mapping[str, RewardFn], rollouts: pa.Table) -> pa.Table:
    rows = rollouts.to_pylist()
    weights = cfg.weights or (1.0,) * len(fns)
    total = [0.0] * len(rows)
    out = rollouts
    for (col, fn), w in zip(fns.items(), weights, strict=True):
        values = []
        for i, r in enumerate(rows):
            sample = RewardSample(
                prompt_id=r["prompt_id"],
                sample_idx=r["sample_idx"],
                prompt=r["prompt"],
                response=r["response"],
                answer=r["answer"],
                metadata=json.loads(r["metadata"]),
                response_token_ids=r["response_token_ids"],
                finish_reason=r["finish_reason"],
            )
            try:
                v = float(fn(sample))
            except Exception as exc:
                raise UserError(
                    f"reward.functions: {col[len('reward_') :]} raised on step {r['step']} prompt_id "
                    f"{r['prompt_id']} sample_idx {r['sample_idx']}: {type(exc).__name__}: {exc}"
                ) from exc
            if v != v or v in (float("inf"), float("-inf")):
                raise UserError(
                    f"reward.functions: {col} returned {v} for prompt_id {r['prompt_id']} sample_idx {r['sample_idx']}"
                )
            values.append(v)
            total[i] += w * v
        out = out.append_column(pa.field(col, pa.float64()), pa.array(values, pa.float64()))
    return out.append_column(pa.field("reward", pa.float64()), pa.array(total, pa.float64()))
