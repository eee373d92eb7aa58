"""The train forward of rows whose prompts hold images (a Qwen2-VL / Qwen2.5-VL policy): a
right-padded forward with the model's 3-D M-RoPE positions, and freezing the vision tower.

Rows with images take a padded forward, not the packed one or the prefix forest: their
rotary positions are 3-D and the vision tower's patches are not a per-token sequence
that packing could cut. Right padding, as `MicroBatch`: each row's tokens sit at columns
0.., its pads after it (masked, position 0, never attended by a real token).

The images enter as the model's forward does it (the vision tower's merged patch
features replace the image-pad tokens' embeddings), but placed by the prompt's
`mm_token_type_ids` rather than by token id: a sampled response may hold the image-pad id
(a random or badly trained policy emits it), which the model's own forward would count as
one more image token and refuse.

Usage::

    vb = build_vision_micro_batch(model, prompts, responses, vision, pad_id)
    lp, ent = vision_response_logprobs(model, vb, temperature=1.0, with_entropy=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rftpipe.engines.train.forward import MicroBatch, _head_logprobs, build_micro_batch
from rftpipe.engines.vision import VisionInputs, vision_forward_inputs


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionMicroBatch:
    """A right-padded `MicroBatch` and its rows' images."""

    mb: MicroBatch
    position_ids: torch.Tensor
    """(3, B, L) M-RoPE positions from the model's `get_rope_index` (0 on padding); for
    rows without images, their arange on all three axes."""
    mm_token_type_ids: torch.Tensor
    """(B, L) 1 on the prompts' image tokens."""
    pixel_values: torch.Tensor | None
    """The rows' images' patches, in row order (None: no row has images)."""
    image_grid_thw: torch.Tensor | None
    """(images, 3) their patch grids, in the same order."""

    def to(self, device: torch.device) -> VisionMicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return VisionMicroBatch(
            mb=self.mb.to(device),
            position_ids=self.position_ids.to(device, non_blocking=True),
            mm_token_type_ids=self.mm_token_type_ids.to(device, non_blocking=True),
            pixel_values=move(self.pixel_values),
            image_grid_thw=move(self.image_grid_thw),
        )


def build_vision_micro_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    vision: Sequence[VisionInputs | None],
    pad_id: int,
) -> VisionMicroBatch:
    """Right-padded prompt+response rows, `vision[r]` row r's prompt's images (None: a
    text prompt), with their M-RoPE positions."""
    mb = build_micro_batch(prompts, responses, pad_id)
    for r, (p, v) in enumerate(zip(prompts, vision, strict=True)):
        if v is not None:
            v.check(len(p), f"row {r}")
    images = vision_forward_inputs(
        model, mb.input_ids, mb.attention_mask, vision, [0] * len(vision)
    )
    if images is None:
        pos = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        return VisionMicroBatch(
            mb=mb,
            position_ids=pos[None].expand(3, -1, -1),
            mm_token_type_ids=torch.zeros_like(mb.input_ids),
            pixel_values=None,
            image_grid_thw=None,
        )
    return VisionMicroBatch(
        mb=mb,
        position_ids=images["position_ids"],
        mm_token_type_ids=images["mm_token_type_ids"],
        pixel_values=images["pixel_values"],
        image_grid_thw=images["image_grid_thw"],
    )


def vision_hidden(model: torch.nn.Module, vb: VisionMicroBatch) -> torch.Tensor:
    """(B, L, hidden) last hidden states of the rows (a Qwen2-VL conditional-generation
    model: its `model` holds `visual` and `language_model`)."""
    vl: Any = model.model  # type: ignore[union-attr]
    embeds = vl.get_input_embeddings()(vb.mb.input_ids)
    if vb.pixel_values is not None:
        feats = vl.get_image_features(vb.pixel_values, vb.image_grid_thw, return_dict=True)
        feats = torch.cat(feats.pooler_output).to(embeds.dtype)
        where = vb.mm_token_type_ids == 1
        if int(where.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(where.sum())} image tokens in the rows but {feats.shape[0]} image "
                "features from their pixels"
            )
        embeds = embeds.masked_scatter(where[..., None].expand_as(embeds), feats)
    return vl.language_model(
        inputs_embeds=embeds,
        attention_mask=vb.mb.attention_mask,
        position_ids=vb.position_ids,
        use_cache=False,
    ).last_hidden_state


def vision_response_logprobs(
    model: torch.nn.Module,
    vb: VisionMicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs (and entropies) of the response tokens under logits / T, from one
    padded forward of rows with and without images: `response_logprobs` for VLM rows."""
    hidden = vision_hidden(model, vb)
    idx = vb.mb.response_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return _head_logprobs(
        model,
        hidden.gather(1, idx),
        vb.mb.response_ids,
        temperature,
        with_entropy,
        entropy_grad,
        chunk,
    )


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower (with its patch merger) of a Qwen2-VL-family model."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None)
    if not isinstance(tower, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no vision tower (model.visual)")
    return tower


def freeze_vision(model: torch.nn.Module) -> int:
    """Freeze the vision tower: its parameters stop requiring gradients, so the backends'
    optimizer (`adamw` takes trainable parameters only) holds no state for them and a
    checkpoint's trainable-parameter state leaves them out. Returns how many parameters
    it froze. Call before the train engine builds its optimizer."""
    frozen = 0
    for p in vision_tower(model).parameters():
        p.requires_grad_(False)
        frozen += p.numel()
    return frozen
