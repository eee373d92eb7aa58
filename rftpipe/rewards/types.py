"""The reward data types: the row a function scores (`RewardSample`, its images as
`SampleImage`s), what it made of the row (`Outcome`), and the protocol every configured
reward component follows."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rftpipe.config.schema import RewardFunctionConfig
from rftpipe.errors import UserError
from rftpipe.storage.images import ImageRef

if TYPE_CHECKING:
    from PIL.Image import Image


@dataclass(frozen=True, slots=True)
class SampleImage:
    """One image a row's prompt showed: a file of the run's image store, named by its
    content (picklable: a name and a path, never the pixels)."""

    sha256: str
    """The file's bytes' SHA-256, hex (its name in the store)."""
    path: str
    """The file's absolute path, under the run directory (``RUN/images/ab/<sha256>.png``)."""

    @classmethod
    def in_run(cls, run_root: Path, relpath: str) -> SampleImage:
        """The image a trajectory row's `images` entry (`ImageRef.relpath`) names."""
        ref = ImageRef.parse(relpath)
        return cls(ref.sha256, str(Path(run_root).absolute() / ref.relpath))

    @property
    def ext(self) -> str:
        """The file's format suffix (``png``, ``jpeg``)."""
        return self.path.rpartition(".")[2]

    def read_bytes(self, verify: bool = False) -> bytes:
        """The encoded file; with `verify`, a `ValueError` unless it hashes to `sha256`
        (the store's own check is `rftpipe inspect RUN verify`)."""
        data = Path(self.path).read_bytes()
        if verify and hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"image {self.path}: bytes disagree with their sha256 name")
        return data

    def pil(self) -> Image:
        """The decoded image, RGB."""
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.read_bytes())).convert("RGB")


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSample:
    """One row to score (picklable: it crosses to the worker processes as is)."""

    step: int
    prompt_id: int
    sample_idx: int
    prompt: str
    response: str
    answer: str | None
    data_source: str
    """Which dataset the row came from (verl's `data_source`)."""
    metadata: dict[str, Any]
    response_token_ids: list[int]
    finish_reason: str
    messages: list[dict[str, Any]] | None = None
    """A multi-turn episode's whole conversation (`rollout.env`), whose last assistant
    message is `response`; None for a single-turn row."""
    images: tuple[SampleImage, ...] = ()
    """The images the row's prompt showed, in the order of its image parts (the row's
    `images` column); empty for a text prompt and in a text-only run."""

    @property
    def where(self) -> str:
        """The row, as error messages name it."""
        return f"step {self.step} prompt_id {self.prompt_id} sample_idx {self.sample_idx}"

    def image_bytes(self, field: str) -> list[bytes]:
        """The files of `images`, in order, for a component that sends or encodes them. A
        stored image that cannot be read is a damaged run directory: a `UserError` naming
        `field` and the row (never a retried request or a row's failure)."""
        out = []
        for im in self.images:
            try:
                out.append(im.read_bytes())
            except OSError as exc:
                raise UserError(
                    f"{field}: cannot read image {im.path} of {self.where} "
                    f"({exc.strerror or exc}); check the run with `rftpipe inspect RUN verify`"
                ) from exc
        return out


def data_source_of(row: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """Which dataset a committed row came from ("" if unknown)."""
    # reasoning-gym names its dataset `source_dataset`; verl-format rows `data_source`.
    return str(
        row.get("data_source") or metadata.get("data_source") or metadata.get("source_dataset", "")
    )


Status = Literal["ok", "timeout", "error"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one function made of one row."""

    status: Status
    value: Any = None
    """The returned value (status ok): a number, or a dict with a numeric `score`."""
    error: str = ""
    """Why it failed (`Type: message`), for status timeout or error."""


class RewardComponent(Protocol):
    """One configured reward function, ready to score rows."""

    spec: RewardFunctionConfig

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        """One outcome per sample, in order. With `fail_fast` it may stop after the first
        failed row, leaving None for the rows it did not score."""
        ...


RewardFn = Callable[[RewardSample], float]
