"""The `data` section: where prompts come from (a reasoning-gym generator, a file, or weighted
datasets), how they are templated, cut and dealt to steps, and how a vision-language model
sees their images (`data.images`). `DatasetSourceConfig` also describes `train.ptx.data`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningGymConfig:
    name: str = "basic_arithmetic"
    """reasoning-gym dataset name; its own `score_answer` is the accuracy verifier."""

    size: int = 1000
    """Number of generated prompts in the dataset (one epoch)."""

    seed: int = 1
    """Generator seed of the dataset."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `reasoning_gym.create_dataset`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FileDataConfig:
    path: str = ""
    """A local .parquet, .jsonl or .json-lines file with one prompt per row."""

    prompt_column: str = "prompt"
    """Column holding the user message."""

    answer_column: str | None = "answer"
    """Column holding the reference answer (None: no verifier-based reward)."""

    id_column: str | None = None
    """Column with a stable integer prompt id (None: the row index)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSourceConfig:
    """One dataset of `data.datasets` (`data.source=datasets`): a file or a saved HF dataset,
    in verl's layout or with named columns, drawn with a weight among the others."""

    path: str
    """A local .parquet, .jsonl or .json-lines file, or a directory written by HF datasets'
    `save_to_disk`."""

    format: Literal["columns", "verl"] = "columns"
    """Row layout. `verl`: verl's RL Parquet (chat-message `prompt`, `data_source`,
    `reward_model.ground_truth` as the answer, `extra_info`); the column fields below
    default to those. `columns`: the column fields below name the columns."""

    prompt_column: str | None = None
    """Column holding the prompt: a string (the user message) or a list of chat messages
    {role, content} templated as they are (None: `prompt`)."""

    answer_column: str | None = None
    """Column of the reference answer; `a.b` reads field b of struct column a (None:
    `reward_model.ground_truth` for verl, `answer` for columns; empty string: no answer)."""

    data_source_column: str | None = None
    """Column naming each row's data source, which routes rows to reward functions (None:
    `data_source` for verl, none for columns; empty string: none)."""

    data_source: str = ""
    """Data source of every row when there is no data-source column (empty: the file or
    directory name without its suffix)."""

    id_column: str | None = None
    """Column with a stable integer prompt id in [0, 1e9) (None: the row index). Dataset k of
    `data.datasets` (from 0) adds k * 1e9, so ids stay unique across datasets."""

    split: str = "train"
    """Split to take from a saved `DatasetDict` directory (ignored for files and single datasets)."""

    weight: float = 1.0
    """Share of the prompt stream drawn from this dataset, relative to the others' weights."""

    images_column: str | None = None
    """Column of each row's images for a vision-language model (a local path, `file://`
    URL, base64 data URI, bytes, a HF `datasets` Image cell, or a list of them), taken in
    order by the prompt's `<image>` placeholders and by image parts without an image of
    their own (None: `images` when the table has that column; empty string: none). Image
    parts in chat content are read with or without this column."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a file or a save_to_disk directory")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight}")

    @property
    def prompt_col(self) -> str:
        """The prompt column, the format's default resolved."""
        return self.prompt_column or "prompt"

    @property
    def answer_col(self) -> str | None:
        """The answer column (dotted for a struct field), None if the rows have none."""
        if self.answer_column is None:
            return "reward_model.ground_truth" if self.format == "verl" else "answer"
        return self.answer_column or None

    @property
    def data_source_col(self) -> str | None:
        """The data-source column, None if every row takes `data_source`."""
        if self.data_source_column is None:
            return "data_source" if self.format == "verl" else None
        return self.data_source_column or None


@dataclass(frozen=True, kw_only=True, slots=True)
class ImagesConfig:
    """How a vision-language model sees the prompts' images (`model.path` a Qwen2-VL /
    Qwen2.5-VL): each image is resized to lie within [min_pixels, max_pixels], which
    decides its image tokens (one per 28x28 pixels for Qwen2-VL's 14-pixel patches merged
    2x2). Image tokens count toward `data.max_prompt_tokens` and
    `train.max_tokens_per_micro_batch`."""

    min_pixels: int | None = None
    """Smallest image area after resizing, in pixels (None: the model's
    preprocessor_config.json)."""

    max_pixels: int | None = None
    """Largest image area after resizing, in pixels (None: the model's
    preprocessor_config.json)."""

    max_per_prompt: int = 8
    """Most images a prompt may hold; a row with more is refused at load. Serving engines
    reserve memory for this many (vLLM `limit_mm_per_prompt`)."""

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        if self.max_per_prompt < 1:
            raise ValueError(f"max_per_prompt must be >= 1, got {self.max_per_prompt}")


MAX_BALANCE_VALUES = 64
"""Most distinct values of `data.balance_by` in one dataset (a label, not an id)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: Literal["reasoning_gym", "file", "datasets"] = "reasoning_gym"
    """Where prompts come from: a reasoning-gym generator, one file of string prompts
    (`file`), or one or more weighted datasets (`datasets`: verl Parquet, chat messages,
    saved HF datasets)."""

    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Settings of the reasoning-gym source."""

    file: FileDataConfig = field(default_factory=FileDataConfig)
    """Settings of the file source."""

    datasets: tuple[DatasetSourceConfig, ...] = ()
    """The datasets of `source=datasets`, mixed by weight: position p of the prompt stream
    belongs to the dataset a smooth weighted round-robin picks there, and each dataset
    runs through its own shuffled epochs (every prompt once per epoch of its dataset)."""

    system_prompt: str | None = None
    """System message prepended through the tokenizer's chat template; a prompt given as chat
    messages that already has a system message keeps its own instead."""

    max_prompt_tokens: int = 256
    """Longest prompt (after the chat template) in tokens."""

    overlong: Literal["filter", "truncate", "error"] = "error"
    """What to do with a longer prompt: drop it, keep its last tokens, or refuse the dataset."""

    prompts_per_step: int = 4
    """Prompts (groups) per step, summed over all ranks."""

    shuffle: bool = True
    """Shuffle each epoch with a permutation derived from (seed, epoch)."""

    images: ImagesConfig = field(default_factory=ImagesConfig)
    """Image prompts (`data.datasets` rows with images, for a vision-language model)."""

    balance_by: str | None = None
    """Balance the prompt stream over the values of a row field (`source=datasets` only):
    `answer` (each dataset's answer column) or a column (`a.b`: field b of struct column
    a). Each dataset's share of the stream is split equally among its values, taken in
    turn by the same smooth round-robin as the datasets' weights, and each value's prompts
    run through their own shuffled epochs (every prompt once per epoch of its value). For a
    task whose reward hinges on a label with few values (a class, an image's colour): a
    step of k x (number of values) prompts holds k of each, so the group advantages of a
    policy that cannot yet tell the labels apart cancel over the step instead of pushing
    every prompt towards the step's majority label (docs/vision.md, "The learning test").
    At most 64 values per dataset (`MAX_BALANCE_VALUES`). None: not balanced."""

    def __post_init__(self) -> None:
        if self.balance_by is not None and self.source != "datasets":
            raise ValueError(f"balance_by needs source 'datasets', not '{self.source}'")
        if self.balance_by == "":
            raise ValueError("balance_by is empty: name a row field, or leave it unset")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.source == "file" and not self.file.path:
            raise ValueError("source is 'file' but file.path is empty")
        if (self.source == "datasets") != bool(self.datasets):
            raise ValueError(
                "source is 'datasets' but datasets is empty"
                if self.datasets == ()
                else f"datasets is set but source is '{self.source}', not 'datasets'"
            )
