"""The critic of actor-critic PPO: a causal LM backbone with a scalar value head per token.

The value model is trained by an engine of the actor's own backend (`train.backend`:
single, fsdp2 or deepspeed; `rftpipe.engines.train`), so sharding, AdamW, clipping, the LR
schedule and DCP checkpoints (resharded across world sizes) are the actor's code. What only
a critic does lives here: a value forward through the engine's wrapped module (so FSDP2's
and ZeRO-3's gathers run) and no-grad scoring of a rank's rows in micro-batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rftpipe.config.schema import CriticConfig, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.train.base import TrainEngine
from rftpipe.engines.train.forward import build_micro_batch, split_micro_batches
from rftpipe.engines.train.vision import build_vision_micro_batch, rows_hidden, vision_lm
from rftpipe.engines.vision import VisionInputs
from rftpipe.seeding import derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def head_seed(run_seed: int) -> int:
    """The seed the value head is drawn from: the same on every rank and every restart."""
    return derive_seed(run_seed, 0, "critic/value_head", 0)


class ValueModel(torch.nn.Module):
    """``V(s_t)`` for every position of a sequence: a decoder and a ``Linear(hidden, 1)``.

    The backbone is held as ``model``, so its parameter names match the causal LM's
    (``model.layers.0...``); FSDP2 shards ``get_decoder().layers`` like the actor's. A
    vision-language backbone (``Qwen2VLModel``: ``model.visual``, ``model.language_model``)
    takes the rows' images as the actor's forward does (`vision.rows_hidden`).
    """

    def __init__(self, backbone: PreTrainedModel, head: torch.nn.Linear) -> None:
        super().__init__()
        self.model = backbone
        self.value_head = head

    def get_decoder(self) -> PreTrainedModel:
        # A text backbone is its own decoder; a vision-language one's is its text model.
        return self.model.get_decoder()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict) -> None:
        """`train.gradient_checkpointing` recomputes the backbone's layers, as the actor's."""
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L) float32 value of each position's state (the prefix up to and including it).

        With `mm_token_type_ids` (a vision-language backbone; `VisionMicroBatch.image_inputs`
        gives the rest) the images' features sit at the image tokens and the text model
        takes the 3-D M-RoPE `position_ids`."""
        if mm_token_type_ids is not None:
            assert position_ids is not None, "the rows' M-RoPE positions"
            hidden = rows_hidden(
                self.model,
                input_ids,
                attention_mask,
                position_ids,
                mm_token_type_ids,
                pixel_values,
                image_grid_thw,
                image_index,
            )
        else:
            hidden = self.model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def load_value_model(path: Path, dtype: str, seed: int) -> ValueModel:
    """The backbone of the causal LM at `path` (its LM head is dropped) and a value head
    drawn from `seed`: weights N(0, initializer_range^2), bias 0, so every rank and every
    restart starts from the same critic."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype))
    backbone.config.use_cache = False
    # A vision-language config nests the text model's sizes (itself for a text model).
    config = backbone.config.get_text_config()
    head = torch.nn.Linear(config.hidden_size, 1, dtype=getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * config.initializer_range)
        head.bias.zero_()
    return ValueModel(backbone, head)


def critic_train_config(train: TrainConfig, critic: CriticConfig) -> TrainConfig:
    """The actor's train config with the critic's optimizer settings: same backend,
    micro-batching, epochs, mini-batches and loss aggregation; no entropy term, no packing
    and no chunked LM head (the value model has no LM head: it runs its own padded
    forward, `run_module`)."""
    return dataclasses.replace(
        train,
        lr=critic.lr,
        lr_schedule=critic.lr_schedule,
        warmup_steps=critic.lr_warmup_steps,
        weight_decay=critic.weight_decay,
        grad_clip=critic.grad_clip,
        entropy_coef=0.0,
        packing=False,
        logprob_chunk_size=0,
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class Critic:
    """The value model's engine and the settings it trains with. A checkpoint `Stateful`
    (its engine's model, AdamW state and LR scheduler)."""

    engine: TrainEngine
    cfg: CriticConfig
    train_cfg: TrainConfig
    """`critic_train_config`: how its micro-batches and updates are cut."""
    dist: Dist

    def values(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        vision: Sequence[VisionInputs | None] | None = None,
    ) -> torch.Tensor:
        """(B, T) value of the state before each response token (the position whose
        logits predict it), with gradients; one full-sequence forward through the engine's
        wrapped module, so every rank issues the same collectives.

        `vision` (a vision-language value model): each row's prompt's images, or None for
        a text row, as the actor's `forward` takes them. A vision-language value model
        takes every forward with its tower (`vision.rows_hidden`), `vision` given or not,
        so ranks whose rows hold images and ranks whose rows hold none gather alike."""
        model = self.engine.model
        if vision_lm(model):
            rows = [None] * len(prompts) if vision is None else list(vision)
            vb = build_vision_micro_batch(model, prompts, responses, rows, pad_id=0)
            mb = vb.mb
            full = self.engine.run_module(input_ids=mb.input_ids, **vb.image_inputs())
        else:
            if vision is not None:
                raise ValueError("images given for a text-only value model")
            mb = build_micro_batch(prompts, responses, pad_id=0)
            full = self.engine.run_module(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        return full.gather(1, mb.response_index.to(full.device))

    def compute_values(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        vision: Sequence[VisionInputs | None] | None = None,
    ) -> list[list[float]]:
        """No-grad values of this rank's rows, in the actor's micro-batches (collective:
        a rank with fewer micro-batches runs padding ones); `vision` as `values`'."""
        splits = split_micro_batches(self.train_cfg, prompts, responses)
        n = int(self.dist.all_reduce_max(torch.tensor([len(splits)]))[0])
        out: list[list[float]] = []
        with self.engine.eval_mode():
            for c in range(n):
                if c >= len(splits):
                    self.values([[0]], [[0]], None if vision is None else [None])
                    continue
                r = [responses[i] for i in splits[c]]
                v = self.values(
                    [prompts[i] for i in splits[c]],
                    r,
                    None if vision is None else [vision[i] for i in splits[c]],
                )
                out.extend(v[i, : len(resp)].tolist() for i, resp in enumerate(r))
        return out

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
