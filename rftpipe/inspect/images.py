"""The images a trajectory row saw, read back from the run's image store for inspection:
each `images` entry (a store path, `rftpipe.storage.images.ImageRef.relpath`) resolved to
its file, checked against its sha256 name when its bytes are read, and described (pixel
size and format from the file's header; Pillow reads no pixel data for that).

A missing, altered or undecodable file is a `StoredImage` with `error` set, never an
exception: an inspector shows what it can of a damaged run.
"""

from __future__ import annotations

import base64
import hashlib
import io
import string
from dataclasses import dataclass
from pathlib import Path

from rftpipe.storage.images import ImageRef, ImageStore

BROWSER_MIME = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}
"""Pillow formats every browser shows as they are; any other format is converted to PNG
for the page (a TIFF, say, shows nowhere but Safari)."""


@dataclass(frozen=True, slots=True)
class StoredImage:
    """One entry of a row's `images`, as found in the store."""

    relpath: str
    """The entry as the row holds it (``images/ab/<sha256>.<ext>``)."""
    width: int | None = None
    height: int | None = None
    format: str | None = None
    """Pillow's name of the file's format (``PNG``, ``JPEG``), from its header."""
    error: str | None = None
    """Why the image cannot be shown: not a store path, missing, its bytes disagree with
    its sha256 name, or undecodable. None when sound."""
    data_uri: str | None = None
    """The image as a ``data:`` URI (only from `load`, and only when sound)."""

    def describe(self) -> str:
        """``56x56 PNG``, or the error."""
        if self.error is not None:
            return f"error: {self.error}"
        return f"{self.width}x{self.height} {self.format}"


def store_path(run_root: Path, relpath: str) -> Path:
    """The file of a row's `images` entry. Raises ValueError for anything but a store path:
    the entry comes from a Parquet file, so it must not name a file outside the store
    (``ImageRef.parse`` alone lets an extension like ``png/../../x`` through)."""
    ref = ImageRef.parse(relpath)
    if not (
        set(ref.sha256) <= set(string.hexdigits.lower())
        and ref.ext.isascii()
        and ref.ext.isalnum()
        and ref.relpath == relpath
    ):
        raise ValueError(f"not an image store path: {relpath!r}")
    return ImageStore(run_root).path(ref)


def _open(data: bytes | Path) -> tuple[int, int, str]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            return im.width, im.height, str(im.format)
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ValueError(f"not a readable image ({type(e).__name__})") from None


def header(run_root: Path, relpath: str) -> StoredImage:
    """The entry's size and format from the file's header alone (cheap: no pixels are
    decoded, the bytes are not hashed), for `samples`."""
    try:
        w, h, fmt = _open(store_path(run_root, relpath))
    except FileNotFoundError:
        return StoredImage(relpath, error="missing from the image store")
    except ValueError as e:
        return StoredImage(relpath, error=str(e))
    return StoredImage(relpath, w, h, fmt)


def load(run_root: Path, relpath: str) -> StoredImage:
    """The entry with its bytes as a data URI, after checking them against their sha256
    name and decoding them whole (a truncated file fails here, not in the browser)."""
    from PIL import Image

    try:
        path = store_path(run_root, relpath)
        data = path.read_bytes()
    except ValueError as e:
        return StoredImage(relpath, error=str(e))
    except FileNotFoundError:
        return StoredImage(relpath, error="missing from the image store")
    if hashlib.sha256(data).hexdigest() != path.name.partition(".")[0]:
        return StoredImage(relpath, error="its bytes disagree with their sha256 name (altered)")
    try:
        w, h, fmt = _open(data)
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            mime = BROWSER_MIME.get(fmt)
            if mime is None:
                buf = io.BytesIO()
                im.save(buf, format="PNG")
                data, mime = buf.getvalue(), "image/png"
    except (Image.DecompressionBombError, ValueError, OSError) as e:
        return StoredImage(relpath, error=f"undecodable ({type(e).__name__}: {e})")
    uri = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return StoredImage(relpath, w, h, fmt, data_uri=uri)
