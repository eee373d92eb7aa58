"""Image prompts in the stages (a vision-language policy): the generating stages store each
prompt's images and reference them from its rows; the stages that run the model on
committed rows (advantage, train, critic) rebuild each row's `VisionInputs` from them.

A committed row never holds pixels: its `images` column names files of the run's
content-addressed store (`rftpipe.storage.images`), each written and fsynced before the
shard that references it, and the pixels are processed again from those files with the
processor settings the run was fingerprinted with, which gives the same tensors.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from rftpipe.atomic import CorruptionError
from rftpipe.data.images import LoadedImage
from rftpipe.data.prompts import Prompt
from rftpipe.engines.vision import VisionEncoder, VisionInputs
from rftpipe.storage.images import ImageRef, ImageStore, image_ref
from rftpipe.storage.layout import IMAGES_COLUMN

Vision = list[VisionInputs | None] | None


def store_images(run_root: Path, prompts: Sequence[Prompt]) -> None:
    """Write the prompts' images into the run's store (each distinct one once); called
    before the rows that reference them are written, so a committed row's images exist."""
    store = ImageStore(run_root)
    seen: set[ImageRef] = set()
    for p in prompts:
        for im, ref in zip(p.images, p.image_refs, strict=True):
            if ref not in seen:
                seen.add(ref)
                store.put(im.data, im.ext)


def with_image_refs(table: pa.Table, prompts: Sequence[Prompt]) -> pa.Table:
    """`table` with its `images` column: each row's prompt's store paths (by prompt id)."""
    refs = {p.prompt_id: [r.relpath for r in p.image_refs] for p in prompts}
    column = [refs[pid] for pid in table.column("prompt_id").to_pylist()]
    return table.append_column(
        pa.field(IMAGES_COLUMN, pa.list_(pa.string())), pa.array(column, pa.list_(pa.string()))
    )


def prompt_inputs(encoder: VisionEncoder | None, prompts: Sequence[Prompt]) -> Vision:
    """Each prompt's `VisionInputs` (None for a text prompt); None when none has images,
    which keeps the engines' text path."""
    if encoder is None or not any(p.images for p in prompts):
        return None
    return [encoder.inputs(p.images, p.token_ids) if p.images else None for p in prompts]


def image_rows(table: pa.Table) -> list[dict[str, Any]]:
    """What `RowImages.of` reads of a table's rows (none without an `images` column)."""
    if IMAGES_COLUMN not in table.column_names:
        return []
    return table.select([IMAGES_COLUMN, "prompt_token_ids"]).to_pylist()


class RowImages:
    """The `VisionInputs` of committed rows, read from the run's image store.

    A group's rows share their prompt's images, so the inputs are built once per distinct
    (images, prompt) for the life of the object (one stage).
    """

    def __init__(self, encoder: VisionEncoder | None, run_root: Path) -> None:
        self.encoder = encoder
        self.store = ImageStore(run_root)
        self._inputs: dict[tuple[tuple[str, ...], tuple[int, ...]], VisionInputs] = {}

    def of(self, rows: Sequence[Mapping[str, Any]]) -> Vision:
        """Per row, its prompt's images (None: a text row or a padding row); None when no
        row has any."""
        if self.encoder is None or not any(r.get(IMAGES_COLUMN) for r in rows):
            return None
        return [self._row(r) if r.get(IMAGES_COLUMN) else None for r in rows]

    def _row(self, row: Mapping[str, Any]) -> VisionInputs:
        assert self.encoder is not None
        key = (tuple(row[IMAGES_COLUMN]), tuple(row["prompt_token_ids"]))
        if key not in self._inputs:
            images = [self.load(rel) for rel in key[0]]
            self._inputs[key] = self.encoder.inputs(images, key[1])
        return self._inputs[key]

    def load(self, relpath: str) -> LoadedImage:
        """A stored image, its bytes checked against its name (a corrupt file would train
        on other pixels than the rollout saw)."""
        from PIL import Image

        ref = ImageRef.parse(relpath)
        path = self.store.path(ref)
        if not path.exists():
            raise CorruptionError(path, "an image a committed row references is missing")
        data = path.read_bytes()
        if image_ref(data, ref.ext) != ref:
            raise CorruptionError(path, "image bytes disagree with their sha256 name")
        with Image.open(io.BytesIO(data)) as im:
            size = im.size
        return LoadedImage(data=data, ext=path.suffix.lstrip("."), size=size)
