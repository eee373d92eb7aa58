"""Stage 4, train (critic half): the clipped value loss on the committed `values` and
`returns` columns, over the actor's epochs, mini-batches (same global order) and
micro-batches, with global token/sequence normalisation so any world size makes the same
update. Runs after the actor's update in the same train stage, so a replay replays both.
"""

from __future__ import annotations

import torch

from rftpipe.algos.losses import AGGREGATIONS
from rftpipe.algos.value import clipped_value_loss
from rftpipe.dist import Dist
from rftpipe.engines.train.critic import Critic
from rftpipe.stages.batching import (
    TrainInputs,
    mini_batches,
    model_token_mask,
    pad_ragged,
    seeded_rng,
)
from rftpipe.stages.images import Vision

#: Stand-in row for a rank with no rows left in a micro-batch slot (its loss weight is 0).
_PADDING_ROW = {
    "prompt_token_ids": [0],
    "response_token_ids": [0],
    "values": [0.0],
    "returns": [0.0],
}
_SUMS = ("tokens", "vf_loss", "clipped", "vpred", "sq_err", "skipped")


def run(critic: Critic, dist: Dist, inp: TrainInputs) -> dict[str, float]:
    """Train the critic on this rank's committed rows; metrics global over ranks."""
    cfg = critic.train_cfg
    rows = inp.table.to_pylist()
    sums = dict.fromkeys(_SUMS, 0.0)
    grad_norm, updates = 0.0, 0
    lr = critic.engine.current_lr()
    with critic.engine.train_mode(), seeded_rng(inp.run_seed, inp.step, "critic", dist.device):
        for mb in mini_batches(cfg, dist, inp, rows):
            for chunk in mb.micro:
                _micro_step(
                    critic, dist, chunk, mb.counts, inp.response_budget, sums, inp.vision(chunk)
                )
            grad_norm += critic.engine.optimizer_step()
            updates += 1
            critic.engine.lr_scheduler_step()
    total = dist.all_reduce_sum(torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64))
    g = dict(zip(_SUMS, total.tolist(), strict=True))
    tok = max(g["tokens"], 1.0)
    return {
        "critic/vf_loss": g["vf_loss"] / max(updates, 1),
        "critic/vf_clipfrac": g["clipped"] / tok,
        "critic/vpred_mean": g["vpred"] / tok,
        "critic/mse": g["sq_err"] / tok,
        # Each rank sees the same clipped global norm, so no reduction is needed.
        "critic/grad_norm": grad_norm / max(updates, 1),
        "critic/updates": float(updates),
        "critic/skipped_micro_batches": sums["skipped"],
        "critic/lr": lr,
    }


def _micro_step(
    critic: Critic,
    dist: Dist,
    chunk: list[dict],
    count: torch.Tensor,
    response_budget: int,
    sums: dict[str, float],
    vision: Vision = None,
) -> None:
    weight = 1.0 if chunk else 0.0
    chunk = chunk or [_PADDING_ROW]
    vpred = critic.values(
        [r["prompt_token_ids"] for r in chunk],
        [r["response_token_ids"] for r in chunk],
        vision=vision,
    )
    old, mask = pad_ragged([r["values"] for r in chunk], torch.float32)
    mask = model_token_mask([r.get("loss_mask") for r in chunk], mask)
    returns, _ = pad_ragged([r["returns"] for r in chunk], torch.float32)
    old, returns, mask = old.to(vpred.device), returns.to(vpred.device), mask.to(vpred.device)
    out = clipped_value_loss(vpred, old, returns, cliprange=critic.cfg.cliprange_value)
    agg = AGGREGATIONS[critic.train_cfg.loss_agg]
    # The actor's constant length for seq-mean-token-sum-norm (not the micro-batch's padded
    # width, which would scale each micro-batch's loss by how it happened to be cut).
    norm_len = float(response_budget) if response_budget else None
    loss = agg(
        out.loss, mask, num_tokens=float(count[0]), num_seqs=float(count[1]), norm_len=norm_len
    )
    # A non-finite micro-batch on any rank is skipped by all of them together.
    if dist.any(not bool(torch.isfinite(loss))):
        sums["skipped"] += 1
        return
    critic.engine.backward(critic.cfg.loss_coef * loss * weight)
    if not weight:
        return
    with torch.no_grad():
        sums["tokens"] += float(mask.sum())
        sums["vf_loss"] += float(loss)
        sums["clipped"] += float((out.clipped & mask).sum())
        sums["vpred"] += float((vpred * mask).sum())
        sums["sq_err"] += float(((vpred - returns).square() * mask).sum())
