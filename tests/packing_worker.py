"""One rank of the packed-vs-padded test: the same rows through both forwards of a sharded
backend, logprobs and full gradients compared.

    python tests/packing_worker.py OUT_DIR BACKEND[:ZERO_STAGE] ...

For each backend in turn (all in one process group, so one start pays for all), two fresh
engines from the same initial weights, `train.packing` off and on, run one training
forward of this rank's rows (prompt groups of unequal lengths, responses of 1 to 11
tokens; the ranks' rows differ in number and length, so their packed sequences differ in
shape) and the backward of a loss over their logprobs and entropies, then no-grad
`compute_logprobs` of the same rows in micro-batches of 2 (rank 1 has one micro-batch
fewer, so it runs a padding forward to keep pace). Rank 0 writes OUT_DIR/results.json:
per backend, the largest |logprob difference| over all ranks (training and scoring
forwards), the largest relative L2 difference of any parameter's full gradient, and the
smallest gradient norm (that the backward reached every parameter).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from helpers import exit_rank

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import TrainEngine


def rows(rank: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(rank)
    prompts, responses = [], []
    for g in range(3 - rank):
        prompt = [rng.randrange(5, 200) for _ in range(4 + 3 * g + rank)]
        for _ in range(2):
            prompts.append(prompt)
            responses.append([rng.randrange(5, 200) for _ in range(rng.randrange(1, 12))])
    return prompts, responses


def full_grads(engine: TrainEngine, backend: str) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, on every rank (collective, same order on all)."""
    out = {}
    if backend == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        for name, p in engine.model.named_parameters():
            out[name] = safe_get_full_grad(p).detach().float().clone()
        return out
    for name, p in engine.model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.full_tensor().detach().float().clone()  # a DTensor under FSDP2
    return out


def run(cfg: TrainConfig, dist: Dist) -> tuple[torch.Tensor, dict[str, torch.Tensor], list]:
    model = load_causal_lm(prepare_tiny(), "float32")
    engine = TRAIN_ENGINES[cfg.backend](model, cfg, dist, total_updates=1)
    prompts, responses = rows(dist.rank)
    with engine.train_mode():
        lp, ent = engine.forward(prompts, responses, 1.0, with_entropy=True)
        assert ent is not None
        mask = torch.zeros_like(lp, dtype=torch.bool)
        for i, r in enumerate(responses):
            mask[i, : len(r)] = True
        loss = torch.where(mask, lp, 0.0).sum() + 0.1 * torch.where(mask, ent, 0.0).sum()
        if cfg.backend == "deepspeed":
            # The train stage's accumulation boundary is `step()`, which this never calls: the
            # gradients are read right after the backward, so it is the boundary (ZeRO then
            # links them where `safe_get_full_grad` finds them, as in DeepSpeed's own loop).
            engine.ds._is_gradient_accumulation_boundary = True  # type: ignore[attr-defined]
        engine.backward(loss)
    grads = full_grads(engine, cfg.backend)
    scored = engine.compute_logprobs(prompts, responses, 1.0)
    return torch.where(mask, lp, 0.0).detach(), grads, scored


def compare(backend: str, stage: int, dist: Dist) -> dict[str, float]:
    fields = {"backend": backend, "zero_stage": stage, "micro_batch_size": 2}
    # entropy_coef != 0: the entropy is part of the loss, so its graph is compared too.
    padded, packed = (
        run(TrainConfig(packing=on, entropy_coef=0.1, **fields), dist) for on in (False, True)
    )
    lp_diff = float((padded[0] - packed[0]).abs().max())
    for a, b in zip(padded[2], packed[2], strict=True):
        lp_diff = max(lp_diff, max(abs(x - y) for x, y in zip(a, b, strict=True)))
    rel = max(float((packed[1][k] - g).norm() / g.norm()) for k, g in padded[1].items())
    return {
        "lp_max_abs": float(dist.all_reduce_max(torch.tensor([lp_diff]))[0]),
        "grad_max_rel": rel,
        "grad_min_norm": min(float(g.norm()) for g in padded[1].values()),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    results = {}
    for spec in sys.argv[2:]:
        backend, _, stage = spec.partition(":")
        results[spec] = compare(backend, int(stage or 2), dist)
    if dist.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_rank()
