"""Prompts with images: reading the image parts of a prompt in each layout datasets use,
loading the images (Pillow), and storing them once in the run's image store.

Three layouts give the same `VisionPrompt`:

- chat messages whose content holds parts (OpenAI / HF style): ``{"type": "text", ...}``,
  ``{"type": "image", "image" | "path" | "url": X}``, ``{"type": "image_url",
  "image_url": {"url": X}}``; a part without its X takes the next image of the images
  column (TRL's layout);
- verl's: string content with ``<image>`` placeholders and an ``images`` column;
- a plain prompt string with ``<image>`` placeholders and an images column holding a
  path (or a list of them).

An image X is a local path (absolute, or relative to `base_dir`), a ``file://`` URL, a
``data:image/...;base64,`` URI, raw bytes, a HF `datasets` ``Image`` cell
(``{"bytes", "path"}``) or a PIL image. Remote URLs are refused: compute nodes have no
network and a run must not depend on a server's uptime.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rftpipe.errors import UserError
from rftpipe.storage.images import ImageRef, ImageStore

if TYPE_CHECKING:
    from PIL.Image import Image

PLACEHOLDER = "<image>"
"""verl's image placeholder in string content."""

VIDEO_UNSUPPORTED = (
    "videos are not supported (transformers' Qwen2-VL video processor needs torchvision, "
    "which the CPU install lacks); give frames as images"
)
IMAGE_PART = {"type": "image"}
"""The image part of a `VisionPrompt` message; chat templates render it as the model's
image tokens (Qwen2-VL: ``<|vision_start|><|image_pad|><|vision_end|>``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedImage:
    """One image of a prompt: its encoded file bytes (what the store keeps) and format."""

    data: bytes
    ext: str
    """Pillow's format name, lower case (``png``, ``jpeg``, ``webp``)."""
    size: tuple[int, int]
    """(width, height) in pixels, before any resizing."""

    def pil(self) -> Image:
        """The decoded image, RGB."""
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data)).convert("RGB")


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionPrompt:
    """A chat prompt whose image parts are ``{"type": "image"}`` and whose images are
    `images`, in the order the parts appear (no images: a text-only prompt)."""

    messages: tuple[dict[str, Any], ...]
    """{role, content}; content is a string or a list of text and image parts."""
    images: tuple[LoadedImage, ...]

    def store(self, store: ImageStore) -> tuple[ImageRef, ...]:
        """Write the images to the run's store (once per distinct content) and return the
        references a trajectory row holds."""
        return tuple(store.put(im.data, im.ext) for im in self.images)


def vision_prompt(
    prompt: Any,
    images: Any = None,
    *,
    row: str,
    prompt_col: str = "prompt",
    images_col: str = "images",
    base_dir: Path | None = None,
) -> VisionPrompt:
    """The `VisionPrompt` of a row's prompt cell (a string or chat messages) and its images
    cell (None, one image, or a list). Exit 2 naming `row` and the column on a missing or
    unreadable image, or when the images column holds more or fewer images than the
    prompt has placeholders.

    Usage::

        p = vision_prompt("<image>What colour?", "cat.png", row="row 3")
        p.messages  # ({"role": "user", "content": [{"type": "image"}, {"type": "text", ...}]},)
    """
    raw = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(raw, list | tuple) or not raw:
        raise UserError(f"{row}: '{prompt_col}' is neither a string nor chat messages")
    slots: list[tuple[str, Any]] = []  # (where, inline value or None: from the column)
    messages = tuple(_message(m, j, slots, row, prompt_col) for j, m in enumerate(raw))
    column = _as_list(images)
    wanted = sum(1 for _, v in slots if v is None)
    if wanted != len(column):
        raise UserError(
            f"{row}: '{prompt_col}' has {wanted} image placeholders but '{images_col}' "
            f"holds {len(column)} images"
        )
    taken = iter(enumerate(column))
    loaded = []
    for where, value in slots:
        if value is None:
            k, value = next(taken)
            where = f"{row}: '{images_col}'[{k}]"
        loaded.append(load_image(value, where=where, base_dir=base_dir))
    return VisionPrompt(messages=messages, images=tuple(loaded))


def _as_list(images: Any) -> list[Any]:
    if images is None:
        return []
    if isinstance(images, list | tuple):
        return list(images)
    return [images]  # one path, bytes, `Image` cell or PIL image


def _message(m: Any, j: int, slots: list[tuple[str, Any]], row: str, col: str) -> dict[str, Any]:
    """Message j with its image parts normalised; appends each image slot to `slots`."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise UserError(f"{row}: '{col}' message {j} is not {{role, content}} ({m!r:.80})")
    content = m.get("content")
    where = f"{row}: '{col}' message {j}"
    if isinstance(content, str):
        if PLACEHOLDER not in content:
            return {"role": m["role"], "content": content}
        parts: list[dict[str, Any]] = []
        for k, text in enumerate(content.split(PLACEHOLDER)):
            if k:
                parts.append(dict(IMAGE_PART))
                slots.append((where, None))
            if text:
                parts.append({"type": "text", "text": text})
        return {"role": m["role"], "content": parts}
    if not isinstance(content, list):
        raise UserError(f"{where}: content is neither a string nor a list of parts")
    return {
        "role": m["role"],
        "content": [_part(p, f"{where} part {k}", slots) for k, p in enumerate(content)],
    }


def _part(p: Any, where: str, slots: list[tuple[str, Any]]) -> dict[str, Any]:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind == "text" and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    if kind == "image":
        value = next((p[k] for k in ("image", "path", "url") if p.get(k) is not None), None)
    elif kind == "image_url":
        url = p.get("image_url")
        value = url.get("url") if isinstance(url, dict) else url
        if value is None:
            raise UserError(f"{where}: an image_url part without a url")
    elif kind in ("video", "video_url"):
        raise UserError(f"{where}: a video part; {VIDEO_UNSUPPORTED}")
    else:
        raise UserError(f"{where}: not a text or image part ({p!r:.80})")
    slots.append((where, value))
    return dict(IMAGE_PART)


def load_image(value: Any, *, where: str, base_dir: Path | None = None) -> LoadedImage:
    """Read and check one image value (see the module docstring for the kinds)."""
    data = _image_bytes(value, where, base_dir)
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as im:
            im.load()  # decodes the pixels: a truncated file fails here, not mid-rollout
            fmt, size = (im.format or "png").lower(), im.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot decode the image ({exc})") from exc
    return LoadedImage(data=data, ext=fmt, size=size)


def _image_bytes(value: Any, where: str, base_dir: Path | None) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, dict):  # a HF datasets `Image` cell, not decoded
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        value = value.get("path")
    if hasattr(value, "save") and hasattr(value, "mode"):  # a decoded PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: not an image path, data URI, bytes or image ({value!r:.60})")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise UserError(f"{where}: only base64 data URIs are read ({head[:40]!r})")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UserError(f"{where}: the data URI is not valid base64 ({exc})") from exc
    if value.startswith(("http://", "https://")):
        raise UserError(f"{where}: remote image '{value:.80}' (download it; runs read local files)")
    path = Path(value.removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: cannot read image '{value}' ({exc.strerror or exc})") from exc
