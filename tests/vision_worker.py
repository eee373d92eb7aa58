"""One rank of the sharded vision-language backend test: `builtin:tiny-vl` rows with and
without images through a sharded train engine, its reference engine and its critic.

    python tests/vision_worker.py OUT VARIANT...   (VARIANTS' names)

Every variant, in turn, on the same process group: the actor's no-grad logprobs of this
rank's rows (`SHARES`; rank 1 has one micro-batch more than rank 0, rank 0 runs a padding
one), one AdamW step on the rows of `TRAIN` (rank 1's without images), the logprobs again,
the checkpoint state's keys, a `role="reference"` engine's logprobs and a critic's values.
Each rank writes OUT/VARIANT/rank<R>.json; rank 0 also the full weights after the step
(OUT/VARIANT/weights.safetensors). Then each rank computes the same on all the rows with
`train.backend=single` (rank 0 with a frozen tower, rank 1 with a trained one; `single_name`)
and rank 0 writes the initial weights (OUT/initial.safetensors).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from helpers import exit_rank, png
from safetensors.torch import save_file

from rftpipe.config.schema import CriticConfig, TrainConfig
from rftpipe.data.images import vision_prompt
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines.models import prepare_tiny_vl
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.critic import Critic, critic_train_config, load_value_model
from rftpipe.engines.train.vision import freeze_vision
from rftpipe.engines.vision import VisionEncoder, VisionInputs

VARIANTS: dict[str, dict[str, Any]] = {
    "fsdp2": {"backend": "fsdp2"},
    "fsdp2-tower": {"backend": "fsdp2", "freeze": False},
    "zero2-tower": {"backend": "deepspeed", "zero_stage": 2, "freeze": False},
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
}
"""A frozen tower unless `freeze` is False (then the tower trains: its gradients reduce
while rank 1's training rows have no image)."""
TOWER_CHUNK = 5
"""`train.logprob_chunk_size` of the variants with a trained tower (and of their single
baseline): the LM head returns chunked logprobs from inside the root's image forward."""
ADAM_EPS = 1e-3
"""AdamW's eps in every variant: its first step moves a weight by lr * g / (|g| + eps), so
with the default 1e-8 a gradient near 1e-8 turns its last-bit differences between
backends into moves of up to lr (ZeRO-3 differed from single by 2.8e-5 so, tried
2026-11-26); with 1e-3 the step's differences are the gradients' own."""

SHARES = ((0, 1), (2, 3, 4))
"""Each rank's rows (of `rows()`) for the no-grad scoring: micro-batches of 2, so rank 0's
one mixes an image row with a text row while rank 1's first holds no image, and rank 1's
second (the two-image row) meets rank 0's padding micro-batch."""
TRAIN = ((0, 1), (2, 3))
"""Each rank's rows of the one training micro-batch: rank 1's hold no image."""


def rows(
    image_dir: Path,
) -> tuple[list[tuple[int, ...]], list[list[int]], list[VisionInputs | None]]:
    """Five rows: a 1-image prompt, two text prompts, a text prompt whose response holds
    the image-pad id (a policy may sample it), and a 2-image prompt; unequal lengths."""
    enc = VisionEncoder.load(prepare_tiny_vl())
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (w, h) in enumerate([(56, 56), (80, 60), (40, 90)]):
        paths.append(image_dir / f"im{i}.png")
        # Every rank writes them: by rename, so no rank reads a half-written file.
        tmp = paths[-1].with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(png(i, w, h))
        os.replace(tmp, paths[-1])
    pad = enc.image_token_id
    prompts = [
        enc.encode(vision_prompt("<image>What is it?", str(paths[0]), row="r0")),
        enc.encode(vision_prompt("only some text", row="r1")),
        enc.encode(vision_prompt("more text, and longer than that", row="r2")),
        enc.encode(vision_prompt("text again", row="r3")),
        enc.encode(vision_prompt("<image> or <image>?", [str(paths[1]), str(paths[2])], row="r4")),
    ]
    responses = [[40, 41, 42, 43], [50, 51], [60, 61, 62, 63, 64, 65], [70, pad, 72], [80, 81]]
    return [e.input_ids for e in prompts], responses, [e.vision_inputs() for e in prompts]


def load_vl(freeze: bool) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(prepare_tiny_vl(), dtype=torch.float32)
    model.config.use_cache = False
    if freeze:
        freeze_vision(model)
    return model


def train_loss(lp: torch.Tensor, responses: Sequence[Sequence[int]]) -> torch.Tensor:
    """A fixed weighted sum of the rows' logprobs (each row's weights from -1 to 1)."""
    return -sum(
        (lp[i, : len(r)] * torch.linspace(-1, 1, len(r))).sum() for i, r in enumerate(responses)
    )  # type: ignore[return-value]


def full_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    w = engine.rollout_weights()
    w = w.state_dict() if isinstance(w, torch.nn.Module) else w
    return {k: v.detach().float().clone().contiguous() for k, v in w.items()}


def optim_keys(state: dict) -> list[str]:
    """The parameter names the checkpoint's optimizer state holds (DCP's layout: per
    parameter under "state"; DeepSpeed's: per moment)."""
    optim = state["optim"]
    return sorted(optim["state"] if "state" in optim else optim["exp_avg"])


def run(variant: str, dist: Dist, image_dir: Path, take: Sequence[Sequence[int]]) -> dict:
    """The variant's results for this rank's rows `take[rank]` (all rows: one rank)."""
    spec = VARIANTS[variant]
    freeze = spec.get("freeze", True)
    stage = {"zero_stage": spec["zero_stage"]} if "zero_stage" in spec else {}
    cfg = TrainConfig(
        backend=spec["backend"],
        lr=1e-3,
        adam_eps=ADAM_EPS,
        micro_batch_size=2,
        logprob_chunk_size=0 if freeze else TOWER_CHUNK,
        **stage,
    )
    prompts, responses, vision = rows(image_dir)
    mine = take[dist.rank]

    def pick(seq: Sequence[Any], idx: Sequence[int]) -> list[Any]:
        return [seq[i] for i in idx]

    # One rank trains on every rank's training rows: the sum of the ranks' losses.
    train_rows = list(TRAIN[dist.rank]) if dist.world > 1 else [i for s in TRAIN for i in s]
    engine = TRAIN_ENGINES[cfg.backend](load_vl(freeze), cfg, dist, total_updates=1)
    scored = (pick(prompts, mine), pick(responses, mine), pick(vision, mine))
    before = engine.compute_logprobs(scored[0], scored[1], 1.0, scored[2])
    with engine.train_mode():
        lp, _ = engine.forward(
            pick(prompts, train_rows),
            pick(responses, train_rows),
            1.0,
            with_entropy=False,
            vision=pick(vision, train_rows),
        )
        engine.backward(train_loss(lp, pick(responses, train_rows)))
        engine.optimizer_step()
    after = engine.compute_logprobs(scored[0], scored[1], 1.0, scored[2])
    state = engine.state_dict()
    weights = full_weights(engine)
    reference = TRAIN_ENGINES[cfg.backend](load_vl(True), cfg, dist, role="reference")
    ref = reference.compute_logprobs(scored[0], scored[1], 1.0, scored[2])
    critic_cfg = CriticConfig()
    value_model = load_value_model(prepare_tiny_vl(), "float32", seed=0)
    critic = Critic(
        engine=TRAIN_ENGINES[cfg.backend](
            value_model, critic_train_config(cfg, critic_cfg), dist, total_updates=1
        ),
        cfg=critic_cfg,
        train_cfg=critic_train_config(cfg, critic_cfg),
        dist=dist,
    )
    values = critic.compute_values(scored[0], scored[1], scored[2])
    return {
        "before": before,
        "after": after,
        "reference": ref,
        "values": values,
        "optim_keys": optim_keys(state),
        "model_keys": sorted(state["model"]),
        "weights": weights,
    }


def save(out: Path, name: str, res: dict, rank: int) -> None:
    """`run`'s results as OUT/NAME/rank<R>.json, its weights as weights.safetensors."""
    weights = res.pop("weights")
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps(res))
    if rank == 0:
        save_file(weights, d / "weights.safetensors")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist = init_from_env(require_group=True)
    for variant in sys.argv[2:]:
        t0 = time.perf_counter()
        save(out, variant, run(variant, dist, out / "images", SHARES), dist.rank)
        logging.info("%s: %.1f s", variant, time.perf_counter() - t0)
    # The single backend's results on all the rows, a tower setting per rank (at once).
    freeze = dist.rank == 0
    spec = {"backend": "single", "freeze": freeze}
    name = single_name(freeze)
    VARIANTS[name] = spec
    everything = [[i for share in SHARES for i in share]]
    save(out, name, run(name, Dist(), out / "images", everything), 0)
    if dist.rank == 0:
        initial = {k: v.detach().clone() for k, v in load_vl(False).state_dict().items()}
        save_file(initial, out / "initial.safetensors")


def single_name(freeze: bool) -> str:
    """Where `main` saves the single backend's results with the tower frozen or not."""
    return "single-frozen" if freeze else "single-tower"


if __name__ == "__main__":
    main()
    exit_rank()
