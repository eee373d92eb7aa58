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

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rftpipe.engines.models import as_causal_lm
from rftpipe.engines.train.forward import (
    MicroBatch,
    _head_logprobs,
    build_micro_batch,
    root_forward_logprobs,
)
from rftpipe.engines.vision import VisionInputs, hf_model, rope_inputs


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
    """The rows' images' patches, in row order (None: no row has images); with
    `image_index`, each distinct prompt's images once."""
    image_grid_thw: torch.Tensor | None
    """(images, 3) their patch grids, in the same order."""
    image_index: torch.Tensor | None = None
    """(row images,) for each image of the rows in row order, its position in
    `pixel_values`' images; None when those hold every row's images in row order. A
    group's rows share their prompt's images: the tower then runs on them once per
    micro-batch, and its features (and their gradients) are shared by the rows."""

    def image_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments beside `input_ids` of a forward over these rows
        (`rows_hidden`'s; the pixels only where a row has images)."""
        out = {
            "attention_mask": self.mb.attention_mask,
            "position_ids": self.position_ids,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        if self.pixel_values is not None and self.image_grid_thw is not None:
            out["pixel_values"] = self.pixel_values
            out["image_grid_thw"] = self.image_grid_thw
        if self.image_index is not None:
            out["image_index"] = self.image_index
        return out

    def to(self, device: torch.device) -> VisionMicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return VisionMicroBatch(
            mb=self.mb.to(device),
            position_ids=self.position_ids.to(device, non_blocking=True),
            mm_token_type_ids=self.mm_token_type_ids.to(device, non_blocking=True),
            pixel_values=move(self.pixel_values),
            image_grid_thw=move(self.image_grid_thw),
            image_index=move(self.image_index),
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
    # The positions need every row's grid; the pixels only each distinct prompt's.
    images = rope_inputs(
        hf_model(model), mb.input_ids, mb.attention_mask, vision, [0] * len(vision)
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
    pixels, grid, index = _distinct_images(vision)
    return VisionMicroBatch(
        mb=mb,
        position_ids=images["position_ids"],
        mm_token_type_ids=images["mm_token_type_ids"],
        pixel_values=pixels,
        image_grid_thw=grid,
        image_index=index,
    )


def _distinct_images(
    vision: Sequence[VisionInputs | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(pixels, grids, index) of the distinct prompts' images among the rows (one
    `VisionInputs` per prompt, shared by its rows: `rftpipe.stages.images.RowImages`), in
    first-seen order, and each row image's position among them; index None when every
    row's images are distinct (pixels and grids are then the rows' own, in row order)."""
    first: dict[int, int] = {}  # id of a prompt's inputs -> its first image's position
    distinct: list[VisionInputs] = []
    index: list[int] = []
    for v in vision:
        if v is None:
            continue
        if id(v) not in first:
            first[id(v)] = sum(len(d.image_grid_thw) for d in distinct)
            distinct.append(v)
        index.extend(range(first[id(v)], first[id(v)] + len(v.image_grid_thw)))
    pixels = torch.cat([d.pixel_values for d in distinct])
    grid = torch.cat([d.image_grid_thw for d in distinct])
    return pixels, grid, None if len(index) == len(grid) else torch.tensor(index, dtype=torch.long)


def vision_lm(model: torch.nn.Module) -> bool:
    """Whether `model` (a causal LM or the critic's `ValueModel`, unwrapped) has a vision
    tower: the sharded backends then run every forward through the tower."""
    inner = getattr(model, "model", None)
    return isinstance(getattr(inner, "visual", None), torch.nn.Module)


def _blank_image(vl: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel values and grid of the smallest image the tower takes: one merged patch of
    zeros (a `spatial_merge_size`-square grid of patches, one temporal patch)."""
    cfg = vl.config.vision_config
    merge = int(cfg.spatial_merge_size)
    width = int(cfg.in_channels) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
    pixels = torch.zeros((merge * merge, width), dtype=like.dtype, device=like.device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=like.device)
    return pixels, grid


def rows_hidden(
    vl: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    image_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, L, hidden) last hidden states of the rows, from a Qwen2-VL-family base model
    `vl` (its `visual` and `language_model`): the tower's merged patch features at the
    rows' image tokens (`mm_token_type_ids` 1), the text model with the M-RoPE
    `position_ids`. With `image_index` the tower runs on distinct images only and each
    row image takes the features of the one it names (`VisionMicroBatch.image_index`).

    The tower runs in every call: on a blank one-patch image when no row has images, its
    output added to the embeddings times zero. So every rank of a sharded backend gathers
    the tower's parameters (ZeRO-3, FSDP2's tower units) and reduces its gradients (zero
    here) in every forward, whatever images its own rows hold; a rank whose rows have none
    while another's have would otherwise leave the other waiting in a collective.
    """
    embeds = vl.get_input_embeddings()(input_ids)
    blank = pixel_values is None
    if blank:
        pixel_values, image_grid_thw = _blank_image(vl, embeds)
    pooled = vl.get_image_features(pixel_values, image_grid_thw, return_dict=True).pooler_output
    if image_index is not None:
        pooled = [pooled[i] for i in image_index.tolist()]
    feats = torch.cat(pooled).to(embeds.dtype)
    if blank:
        embeds = embeds + feats.sum() * 0.0
    else:
        where = mm_token_type_ids == 1
        if int(where.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(where.sum())} image tokens in the rows but {feats.shape[0]} image "
                "features from their pixels"
            )
        embeds = embeds.masked_scatter(where[..., None].expand_as(embeds), feats)
    return vl.language_model(
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).last_hidden_state


def vision_hidden(model: torch.nn.Module, vb: VisionMicroBatch) -> torch.Tensor:
    """(B, L, hidden) last hidden states of the rows (a Qwen2-VL conditional-generation
    model: its `model` holds `visual` and `language_model`); `rows_hidden`."""
    return rows_hidden(hf_model(model).model, vb.mb.input_ids, **vb.image_inputs())


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


@contextlib.contextmanager
def rows_forward(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, `module`'s (a Qwen2-VL-family conditional-generation model's)
    own forward is `rows_hidden` and its LM head: images placed by `mm_token_type_ids`,
    not by token id (a response may hold the image-pad id, which the model's forward
    would count as one more image token and refuse).

    The sharded backends call their wrapped root as for text, so their hooks gather and
    reduce around it (FSDP2's root and tower units, ZeRO-3's per-module gathers inside
    DeepSpeed's forward); only what runs inside the root changes. Set on the instance and
    removed after, so the class and every other module stay as they are.
    """
    model = hf_model(module)

    def forward(
        input_ids: torch.Tensor,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **rows: torch.Tensor,
    ) -> Any:
        """`rows`: `rows_hidden`'s keyword arguments (`VisionMicroBatch.image_inputs`)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = rows_hidden(model.model, input_ids, **rows)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        # A ModelOutput (a dict) as the model's own: DeepSpeed hooks the output's tensors.
        return CausalLMOutputWithPast(logits=as_causal_lm(model).get_output_embeddings()(kept))

    own = vars(model).get("forward")
    vars(model)["forward"] = forward
    try:
        yield
    finally:
        if own is None:
            del vars(model)["forward"]
        else:
            vars(model)["forward"] = own


def root_vision_logprobs(
    runner: torch.nn.Module,
    module: torch.nn.Module,
    vb: VisionMicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vision_response_logprobs` through the sharded backends' wrapped root `runner`
    (whose inner model is `module`): one call of the runner, so every rank issues the same
    collectives (`rows_hidden` runs the tower on every rank)."""
    with rows_forward(module):
        return root_forward_logprobs(
            runner,
            vb.mb,
            temperature,
            with_entropy,
            entropy_grad,
            chunk,
            extra={k: v for k, v in vb.image_inputs().items() if k != "attention_mask"},
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
