"""Encoding prompts with images for processor-based vision-language models (the Qwen2-VL /
Qwen2.5-VL family): chat template, image-pad expansion, pixel values, M-RoPE positions.

transformers' `Qwen2VLProcessor` cannot be built without a video processor, which needs
torchvision (which setup removes), so the tokenizer and the PIL image processor are driven
directly here: the template renders one ``<|image_pad|>`` per image and `encode` repeats
it as many times as the image has tokens (its patch grid over the 2x2 merge).

Usage::

    enc = VisionEncoder.load(resolve_model_path("builtin:tiny-vl"))
    prompt = vision_prompt("<image>What colour?", "cat.png", row="row 3")
    e = enc.encode(prompt)  # e.input_ids holds e.num_image_tokens image-pad ids
    batch = collate([e, enc.encode(text_only)], pad_id=enc.tokenizer.pad_token_id)
    logits = model(**batch).logits
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rftpipe.data.images import LoadedImage, VisionPrompt
from rftpipe.engines.models import is_vision_model, load_tokenizer
from rftpipe.errors import UserError

if TYPE_CHECKING:
    import torch

IMAGE_PAD = "<|image_pad|>"
QWEN_VL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})
"""The `model_type`s whose prompts `VisionEncoder` encodes (one image processor, one
image-pad token, M-RoPE)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EncodedPrompt:
    """One prompt as a vision-language model takes it."""

    input_ids: tuple[int, ...]
    """Chat-templated tokens, each image's pad token repeated once per image token."""
    mm_token_type_ids: tuple[int, ...]
    """1 on image tokens, 0 elsewhere (what M-RoPE groups positions by)."""
    pixel_values: torch.Tensor | None
    """(patches, channels * temporal_patch * patch * patch) of all the prompt's images."""
    image_grid_thw: torch.Tensor | None
    """(images, 3): each image's (time, height, width) patch grid."""
    images: tuple[LoadedImage, ...] = ()
    """The images themselves, in order (what engines that run their own processor take)."""

    @property
    def num_image_tokens(self) -> int:
        return sum(self.mm_token_type_ids)

    def vision_inputs(self) -> VisionInputs | None:
        """What the engines take beside `input_ids` (None for a prompt without images)."""
        if self.pixel_values is None or self.image_grid_thw is None:
            return None
        return VisionInputs(
            pixel_values=self.pixel_values,
            image_grid_thw=self.image_grid_thw,
            mm_token_type_ids=self.mm_token_type_ids,
            images=self.images,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionInputs:
    """One prompt's images as the model's forward takes them, beside its token ids: what a
    rollout engine's prefill and the train forward pass for a prompt with images."""

    pixel_values: torch.Tensor
    """(patches, channels * temporal_patch * patch * patch) of all the prompt's images."""
    image_grid_thw: torch.Tensor
    """(images, 3): each image's (time, height, width) patch grid."""
    mm_token_type_ids: tuple[int, ...]
    """1 on the prompt's image tokens, 0 elsewhere, from the prompt's first token: as long
    as the prompt that was encoded; a later turn's longer prompt (that prompt, the turns
    since) takes the same inputs, its tokens past them text."""
    images: tuple[LoadedImage, ...] = ()
    """The prompt's images as files, in order: what vLLM and SGLang take (they run the
    model's processor themselves); empty where only the tensors are known."""

    def check(self, prompt_len: int, what: str) -> None:
        """Refuse inputs longer than their prompt (a `ValueError` naming `what`)."""
        if len(self.mm_token_type_ids) > prompt_len:
            raise ValueError(
                f"{what}: mm_token_type_ids has {len(self.mm_token_type_ids)} entries for a "
                f"prompt of {prompt_len} tokens"
            )


VISION_TOWER_PREFIXES = ("model.visual.", "visual.")
"""Where a Qwen2-VL-family model's vision tower (patch embedding, blocks, merger) sits in
its tensor names: transformers 5's module (`model.visual.`) and the saved checkpoint's
layout (`visual.`)."""


def is_vision_tower_name(name: str) -> bool:
    """Whether the tensor `name` (a transformers state-dict or checkpoint name) belongs to
    the vision tower."""
    return name.startswith(VISION_TOWER_PREFIXES)


def require_vision_model(model_dir: Path, prompt: VisionPrompt, row: str, field: str) -> None:
    """Exit 2 when `prompt` has images and the model in `model_dir` is text-only."""
    if prompt.images and not is_vision_model(model_dir):
        raise UserError(
            f"{row}: '{field}' holds {len(prompt.images)} images but the model "
            f"'{model_dir}' is text-only (its config.json has no vision_config)"
        )


class VisionEncoder:
    """The tokenizer and image processor of one vision-language model directory."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge = int(image_processor.merge_size)

    @classmethod
    def load(
        cls, model_dir: Path, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> VisionEncoder:
        """The encoder of `model_dir`; `min_pixels`/`max_pixels` override the pixel range
        of its ``preprocessor_config.json`` (each image is resized to lie within it)."""
        # Imported directly: the Auto class would pick the torchvision backend and warn.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        if not is_vision_model(model_dir):
            raise UserError(f"model.path: '{model_dir}' is a text-only model (no vision_config)")
        config = json.loads((model_dir / "config.json").read_text())
        if config.get("model_type") not in QWEN_VL_TYPES:
            # Other families have other processors and token layouts; encoding their
            # prompts with Qwen2-VL's would silently feed the model garbage.
            raise UserError(
                f"model.path: '{model_dir}' is a {config.get('model_type')!r} model; images "
                f"are encoded for {sorted(QWEN_VL_TYPES)} only so far"
            )
        tok = load_tokenizer(model_dir)
        pixels: dict[str, Any] = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        processor = Qwen2VLImageProcessorPil.from_pretrained(
            model_dir, **{k: v for k, v in pixels.items() if v is not None}
        )
        return cls(tok, processor, int(config["image_token_id"]))

    def image_tokens(self, size: tuple[int, int]) -> int:
        """How many tokens an image of (width, height) pixels becomes, without decoding
        it: the patches of its resized size over the merge."""
        patches = self.image_processor.get_number_of_image_patches(size[1], size[0])
        return int(patches) // self.merge**2

    def count_tokens(self, prompt: VisionPrompt, row: str = "prompt") -> int:
        """The prompt's length in tokens, image tokens included (what the prompt-length
        policy and `max_tokens_per_micro_batch` count), from the images' sizes alone."""
        return len(self.template_ids(prompt, row))

    def template_ids(self, prompt: VisionPrompt, row: str = "prompt") -> list[int]:
        """The token ids `encode` gives, from the images' sizes alone (no pixels
        processed): what loading a dataset computes for each image prompt."""
        counts = iter([self.image_tokens(im.size) for im in prompt.images])
        return self.expand(self._template_ids(prompt, row), counts)

    def expand(self, ids: Sequence[int], counts: Any) -> list[int]:
        """`ids` with each image pad repeated `next(counts)` times (one count per image)."""
        out: list[int] = []
        for t in ids:
            out.extend([t] * next(counts) if t == self.image_token_id else [t])
        return out

    def inputs(self, images: Sequence[LoadedImage], input_ids: Sequence[int]) -> VisionInputs:
        """The `VisionInputs` of a prompt whose token ids (`template_ids`, or a committed
        row's `prompt_token_ids`) and images are known: the images processed again (the
        same files and processor settings give the same pixels). A `ValueError` when the
        ids hold other image-token counts than the images make."""
        out = self.image_processor(images=[im.pil() for im in images], return_tensors="pt")
        grid = out["image_grid_thw"]
        mm = tuple(int(t == self.image_token_id) for t in input_ids)
        if sum(mm) != int((grid.prod(-1) // self.merge**2).sum()):
            raise ValueError(
                f"the prompt holds {sum(mm)} image tokens but its {len(images)} images make "
                f"{int((grid.prod(-1) // self.merge**2).sum())} (other pixel settings?)"
            )
        return VisionInputs(
            pixel_values=out["pixel_values"],
            image_grid_thw=grid,
            mm_token_type_ids=mm,
            images=tuple(images),
        )

    def encode(self, prompt: VisionPrompt, row: str = "prompt") -> EncodedPrompt:
        """Token ids, image-token mask, pixel values and patch grids of `prompt` (`row`
        names it in errors)."""
        ids = self._template_ids(prompt, row)
        if not prompt.images:
            return EncodedPrompt(
                input_ids=tuple(ids),
                mm_token_type_ids=(0,) * len(ids),
                pixel_values=None,
                image_grid_thw=None,
            )
        out = self.image_processor(images=[im.pil() for im in prompt.images], return_tensors="pt")
        grid = out["image_grid_thw"]
        expanded = self.expand(ids, iter((grid.prod(-1) // self.merge**2).tolist()))
        return EncodedPrompt(
            input_ids=tuple(expanded),
            mm_token_type_ids=tuple(int(t == self.image_token_id) for t in expanded),
            pixel_values=out["pixel_values"],
            image_grid_thw=grid,
            images=prompt.images,
        )

    def _template_ids(self, prompt: VisionPrompt, row: str) -> list[int]:
        """The chat-templated prompt with one image-pad token per image."""
        text = self.tokenizer.apply_chat_template(
            list(prompt.messages), tokenize=False, add_generation_prompt=True
        )
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        pads = ids.count(self.image_token_id)
        if pads != len(prompt.images):
            # A template that drops image parts, or a prompt whose text spells the token.
            raise UserError(
                f"{row}: model.path's chat template rendered {pads} '{IMAGE_PAD}' tokens "
                f"for a prompt with {len(prompt.images)} images"
            )
        return ids


def collate(encoded: Sequence[EncodedPrompt], pad_id: int, *, left: bool = True) -> dict[str, Any]:
    """One padded batch of `encoded` prompts (left-padded for generation by default),
    with and without images mixed: the images' pixel values and grids are concatenated in
    row order, as the model matches them to the image tokens in that order.

    Returns input_ids, attention_mask, mm_token_type_ids (B, L), and pixel_values /
    image_grid_thw when any prompt has images.
    """
    import torch

    width = max(len(e.input_ids) for e in encoded)

    def pad(seq: Sequence[int], value: int) -> list[int]:
        fill = [value] * (width - len(seq))
        return [*fill, *seq] if left else [*seq, *fill]

    batch: dict[str, Any] = {
        "input_ids": torch.tensor([pad(e.input_ids, pad_id) for e in encoded]),
        "attention_mask": torch.tensor([pad([1] * len(e.input_ids), 0) for e in encoded]),
        "mm_token_type_ids": torch.tensor([pad(e.mm_token_type_ids, 0) for e in encoded]),
    }
    with_images = [e for e in encoded if e.pixel_values is not None]
    if with_images:
        batch["pixel_values"] = torch.cat([e.pixel_values for e in with_images])  # type: ignore[misc]
        batch["image_grid_thw"] = torch.cat([e.image_grid_thw for e in with_images])  # type: ignore[misc]
    return batch


def rope_position_ids(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The 3-D (time, height, width) M-RoPE position ids (3, B, L) of a `collate`d batch,
    from the model's own `get_rope_index` (what a packed or cached forward must pass)."""
    position_ids, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch.get("image_grid_thw"),
        attention_mask=batch["attention_mask"],
    )
    return position_ids


def vision_forward_inputs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: Sequence[VisionInputs | None],
    starts: Sequence[int],
) -> dict[str, torch.Tensor] | None:
    """The image keyword arguments of a padded forward over `input_ids` (B, L), whose row r
    holds its prompt from column `starts[r]` (left padding: the padding's width; right
    padding: 0), with `rows[r]` that prompt's images or None: `rope_inputs`, and the
    pixel_values of the rows with images in row order.

    None when no row has images: the caller's text forward is then unchanged.
    """
    import torch

    out = rope_inputs(model, input_ids, attention_mask, rows, starts)
    if out is not None:
        pixels = [v.pixel_values for v in rows if v is not None]
        out["pixel_values"] = torch.cat(pixels).to(input_ids.device)
    return out


def rope_inputs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: Sequence[VisionInputs | None],
    starts: Sequence[int],
) -> dict[str, torch.Tensor] | None:
    """As `vision_forward_inputs`, without the pixels: image_grid_thw of the rows with
    images in row order, mm_token_type_ids (B, L), and the 3-D M-RoPE position_ids
    (3, B, L) from the model's own `get_rope_index` (0 on padding). None when no row has
    images."""
    import torch

    if all(v is None for v in rows):
        return None
    device = input_ids.device
    mm = torch.zeros_like(input_ids)
    for r, (v, start) in enumerate(zip(rows, starts, strict=True)):
        if v is not None:
            mm[r, start : start + len(v.mm_token_type_ids)] = torch.tensor(
                v.mm_token_type_ids, device=device
            )
    grid = torch.cat([v.image_grid_thw for v in rows if v is not None]).to(device)
    position_ids, _ = _vl_model(model).get_rope_index(
        input_ids, mm_token_type_ids=mm, image_grid_thw=grid, attention_mask=attention_mask
    )
    return {"image_grid_thw": grid, "mm_token_type_ids": mm, "position_ids": position_ids}


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside `module` (a peft model's base model, or itself)."""
    base = getattr(module, "get_base_model", None)
    return base() if callable(base) else module


def _vl_model(model: Any) -> Any:
    """The `Qwen2VLModel` inside a conditional-generation model (or the model itself),
    through a peft model around either."""
    model = hf_model(model)
    inner = getattr(model, "model", None)
    return inner if hasattr(inner, "get_rope_index") else model
