"""Reading prompt rows from each kind of source: a reasoning-gym generator, one file of
string prompts, and the `data.datasets` tables (Parquet, JSON lines or a `save_to_disk`
directory; HF, verl or chat columns), each validated into `RawRow`s before templating."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rftpipe.atomic import atomic_write_bytes
from rftpipe.config.schema import DataConfig, DatasetSourceConfig
from rftpipe.data.images import VIDEO_UNSUPPORTED, VisionPrompt, vision_prompt
from rftpipe.errors import UserError
from rftpipe.storage.cache import cache_dir

Message = dict[str, str]
"""One chat message, {role, content}."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRow:
    """One dataset row before templating."""

    prompt_id: int
    text: str
    """The user message (of a chat prompt: its last user message)."""
    answer: str | None
    metadata: dict[str, Any]
    messages: tuple[Message, ...] | None = None
    """A chat prompt as given, templated as it is (None: `text` is the one user message)."""
    data_source: str = ""
    """The row's data source (verl's `data_source`)."""
    source: int = 0
    """Index of its dataset in `data.datasets` (0 for the single-source kinds)."""
    vision: VisionPrompt | None = None
    """A row with an images column or image parts: its messages with image parts and its
    images (None: a text row)."""
    where: str = ""
    """The row as error messages name it."""


def reasoning_gym_rows(
    cfg: DataConfig, size: int, seed: int
) -> tuple[list[RawRow], GeneratedDataset]:
    rg = cfg.reasoning_gym
    ds = GeneratedDataset(rg.name, size, seed, dict(rg.kwargs))
    rows = [
        RawRow(
            prompt_id=i,
            text=e["question"],
            answer=str(e["answer"]),
            metadata=e["metadata"],
            data_source=str(e["metadata"].get("source_dataset", "")),
        )
        for i, e in enumerate(ds.entries())
    ]
    return rows, ds


class GeneratedDataset:
    """A reasoning-gym dataset: its entries, and its `score_answer` (the accuracy
    verifier).

    Importing reasoning_gym takes about a second of CPU (it imports every task, matplotlib
    among their dependencies), in every process of every run, though only scoring needs it.
    So the entries one process generates are kept in this machine's cache, under the
    Python and reasoning-gym versions and the generator's settings, and later processes
    read them there; the generator itself is built only when something is scored."""

    def __init__(self, name: str, size: int, seed: int, kwargs: dict[str, Any]) -> None:
        self.settings: dict[str, Any] = {"name": name, "size": size, "seed": seed, "kwargs": kwargs}
        self._dataset: Any = None

    def entries(self) -> list[dict[str, Any]]:
        """Each entry's question, answer and metadata, in the generator's order."""
        path = self._cache_path()
        with contextlib.suppress(OSError, ValueError):
            cached = _from_json(path.read_bytes())
            if cached["settings"] == self.settings:
                return cached["entries"]
        entries = [
            {"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]}
            for e in self.dataset()
        ]
        text = _json_exactly({"settings": self.settings, "entries": entries})
        if text is not None:
            with contextlib.suppress(OSError):  # a read-only cache: the next process generates
                atomic_write_bytes(path, text.encode())
        return entries

    def dataset(self) -> Any:
        """reasoning-gym's own dataset object, built on first use."""
        if self._dataset is None:
            import reasoning_gym

            rg = self.settings
            try:
                self._dataset = reasoning_gym.create_dataset(
                    rg["name"], size=rg["size"], seed=rg["seed"], **rg["kwargs"]
                )
            except Exception as exc:  # the generator validates its own kwargs
                raise UserError(
                    f"data.reasoning_gym: {rg['name']!r} rejected its settings: {exc}"
                ) from exc
        return self._dataset

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        return float(self.dataset().score_answer(answer, entry))

    def _cache_path(self) -> Path:
        versions = [sys.version_info[:2], importlib.metadata.version("reasoning_gym")]
        key = json.dumps([versions, self.settings], sort_keys=True, default=str)
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cache_dir("data") / "reasoning_gym" / f"{name}.json"


_TUPLE = "$tuple"
"""A tuple in the cache's JSON: {"$tuple": [...]} (reasoning-gym's metadata holds tuples)."""


def _json_exactly(obj: Any) -> str | None:
    """`obj` as JSON that `_from_json` reads back as the same values of the same types;
    None where JSON cannot (integer keys, NaNs, numpy scalars)."""
    try:
        text = json.dumps(_tag_tuples(obj), allow_nan=False)
    except (TypeError, ValueError):
        return None
    return text if _same(_from_json(text), obj) else None


def _from_json(text: str | bytes) -> Any:
    return json.loads(text, object_hook=lambda d: tuple(d[_TUPLE]) if d.keys() == {_TUPLE} else d)


def _tag_tuples(x: Any) -> Any:
    if isinstance(x, tuple):
        return {_TUPLE: [_tag_tuples(v) for v in x]}
    if isinstance(x, list):
        return [_tag_tuples(v) for v in x]
    if isinstance(x, dict):
        if _TUPLE in x:
            raise ValueError(f"a key {_TUPLE!r} would read back as a tuple")
        return {k: _tag_tuples(v) for k, v in x.items()}
    return x


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def file_rows(cfg: DataConfig) -> list[RawRow]:
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    f = cfg.file
    path = Path(f.path).expanduser()
    if not path.exists():
        raise UserError(f"data.file.path: '{f.path}' does not exist")
    try:
        table = pq.read_table(path) if path.suffix == ".parquet" else pj.read_json(path)
    except Exception as exc:
        raise UserError(f"data.file.path: cannot read '{f.path}': {exc}") from exc
    for key, col in (
        ("prompt_column", f.prompt_column),
        ("answer_column", f.answer_column),
        ("id_column", f.id_column),
    ):
        if col is not None and col not in table.column_names:
            raise UserError(
                f"data.file.{key}: column '{col}' not in '{f.path}' (has {table.column_names})"
            )
    prompts = table.column(f.prompt_column).to_pylist()
    answers = (
        table.column(f.answer_column).to_pylist() if f.answer_column else [None] * len(prompts)
    )
    ids = table.column(f.id_column).to_pylist() if f.id_column else list(range(len(prompts)))
    rows = []
    for i, (pid, text, ans) in enumerate(zip(ids, prompts, answers, strict=True)):
        if not isinstance(text, str) or not text:
            raise UserError(f"data.file: row {i} has an empty or non-string '{f.prompt_column}'")
        if not isinstance(pid, int):
            raise UserError(f"data.file: row {i} has a non-integer id in '{f.id_column}'")
        rows.append(
            RawRow(prompt_id=pid, text=text, answer=None if ans is None else str(ans), metadata={})
        )
    if len({r.prompt_id for r in rows}) != len(rows):
        raise UserError(f"data.file.id_column: ids in '{f.id_column}' are not unique")
    return rows


#: Dataset k of `data.datasets` owns the prompt ids [k * ID_STRIDE, (k + 1) * ID_STRIDE).
ID_STRIDE = 1_000_000_000
_ROLES = frozenset({"system", "user", "assistant", "tool"})


def load_source_rows(src: DatasetSourceConfig, index: int = 0) -> list[RawRow]:
    """The rows of one dataset of `data.datasets`, validated (exit 2 naming the field, the
    column or the row on anything malformed). `index` is its position in the list: it
    offsets the prompt ids (by `index * ID_STRIDE`) and names it in error messages.

    Usage::

        rows = load_source_rows(DatasetSourceConfig(path="gsm8k.parquet", format="verl"))
        rows[0].messages, rows[0].answer, rows[0].data_source, rows[0].metadata["extra_info"]
    """
    where = f"data.datasets[{index}]"
    table = read_table(src, where)
    routed = {
        "prompt_column": src.prompt_col,
        "answer_column": src.answer_col,
        "data_source_column": src.data_source_col,
        "id_column": src.id_column,
    }
    for key, col in routed.items():
        if col is not None and not has_column(table.schema, col):
            raise UserError(
                f"{where}.{key}: column '{col}' not in '{src.path}' (has {table.column_names})"
            )
    images_col = src.images_column
    if images_col is None:
        images_col = "images" if "images" in table.column_names else ""
    elif images_col and images_col not in table.column_names:
        raise UserError(
            f"{where}.images_column: column '{images_col}' not in '{src.path}' "
            f"(has {table.column_names})"
        )
    records = table.to_pylist()
    if "videos" in table.column_names:
        # verl's video column: refused rather than silently dropped from the prompt.
        for i, rec in enumerate(records):
            if rec["videos"]:
                raise UserError(
                    f"{where}: row {i} of '{src.path}': 'videos' holds a video; {VIDEO_UNSUPPORTED}"
                )
    rows = [_raw_row(src, index, i, rec, images_col) for i, rec in enumerate(records)]
    if len({r.prompt_id for r in rows}) != len(rows):
        raise UserError(f"{where}.id_column: ids in '{src.id_column}' are not unique")
    if not rows:
        raise UserError(f"{where}.path: '{src.path}' has no rows")
    return rows


def _raw_row(
    src: DatasetSourceConfig, index: int, i: int, rec: dict[str, Any], images_col: str
) -> RawRow:
    """Row i of dataset `index`, its routed columns validated (`images_col`: the images
    column, or empty)."""
    row = f"data.datasets[{index}]: row {i} of '{src.path}'"
    prompt = rec[src.prompt_col]
    vision = None
    if images_col or _has_parts(prompt):
        vision = vision_prompt(
            prompt,
            rec.get(images_col) if images_col else None,
            row=row,
            prompt_col=src.prompt_col,
            images_col=images_col or "images",
            base_dir=Path(src.path).expanduser().parent,
        )
        prompt = _text_messages(vision)
    text, messages = prompt_of(prompt, row, src.prompt_col)
    answer = cell(rec, src.answer_col) if src.answer_col else None
    if src.data_source_col:
        data_source = cell(rec, src.data_source_col)
    else:
        data_source = src.data_source or Path(src.path.rstrip("/")).stem
    if not isinstance(data_source, str) or not data_source:
        raise UserError(f"{row} has an empty or non-string '{src.data_source_col}'")
    local_id = rec[src.id_column] if src.id_column else i
    if not isinstance(local_id, int) or not 0 <= local_id < ID_STRIDE:
        raise UserError(f"{row} has an id in '{src.id_column}' outside [0, {ID_STRIDE})")
    # Every other column travels with the row for the reward functions (verl's
    # `extra_info`, `ability`, `reward_model`), the data source among them, which is where
    # the score stage reads it.
    # The images travel as the prompt's own (stored once, referenced by path), never as
    # bytes in every row's metadata.
    metadata = {k: v for k, v in rec.items() if k not in (src.prompt_col, images_col, "videos")}
    metadata["data_source"] = data_source
    return RawRow(
        prompt_id=index * ID_STRIDE + local_id,
        text=text,
        answer=None if answer is None else str(answer),
        metadata=metadata,
        messages=messages,
        data_source=data_source,
        source=index,
        vision=vision,
        where=row,
    )


def _has_parts(prompt: Any) -> bool:
    """Whether a prompt cell is chat messages with content parts (text and image parts)."""
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in prompt
    )


def _text_messages(vision: VisionPrompt) -> list[Message]:
    """The messages as text (image parts dropped): the row's `text` and what the prompt
    checks validate. A user message of images alone reads as ``<image>``."""
    out = []
    for m in vision.messages:
        c = m["content"]
        if not isinstance(c, str):
            c = "".join(p["text"] if p["type"] == "text" else "<image>" for p in c)
        out.append({"role": m["role"], "content": c})
    return out


def read_table(src: DatasetSourceConfig, where: str) -> Any:
    """The dataset as a pyarrow Table: a Parquet or JSON-lines file, or a `save_to_disk`
    directory (a `DatasetDict` gives its `split`)."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = Path(src.path).expanduser()
    if not path.exists():
        raise UserError(f"{where}.path: '{src.path}' does not exist")
    try:
        if path.is_dir():
            import datasets

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise UserError(
                        f"{where}.split: '{src.path}' has no split '{src.split}' (has {list(ds)})"
                    )
                ds = ds[src.split]
            return ds.data.table
        return pq.read_table(path) if path.suffix == ".parquet" else pj.read_json(path)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{where}.path: cannot read '{src.path}': {exc}") from exc


def has_column(schema: Any, dotted: str) -> bool:
    """Whether `dotted` names a column, or (`a.b`) field b of struct column a."""
    import pyarrow as pa

    if dotted in schema.names:  # a column whose name has a dot in it
        return True
    head, _, rest = dotted.partition(".")
    if head not in schema.names:
        return False
    typ = schema.field(head).type
    for part in rest.split(".") if rest else ():
        if not pa.types.is_struct(typ) or typ.get_field_index(part) < 0:
            return False
        typ = typ.field(part).type
    return True


def cell(rec: dict[str, Any], dotted: str) -> Any:
    """The cell `has_column` found: the column `dotted`, or a field of a struct column."""
    if dotted in rec:
        return rec[dotted]
    value: Any = rec
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def prompt_of(value: Any, row: str, col: str) -> tuple[str, tuple[Message, ...] | None]:
    """(user text, chat messages or None) of a prompt cell: a string or a list of messages."""
    if isinstance(value, str):
        if not value:
            raise UserError(f"{row} has an empty '{col}'")
        return value, None
    if not isinstance(value, list) or not value:
        raise UserError(f"{row} has a '{col}' that is neither a string nor chat messages")
    for j, m in enumerate(value):
        ok = (
            isinstance(m, dict)
            and m.get("role") in _ROLES
            and isinstance(m.get("content"), str)
            and bool(m["content"])
        )
        if not ok:
            raise UserError(
                f"{row} has malformed chat messages in '{col}': message {j} is not "
                f"{{role: system|user|assistant|tool, content: non-empty string}} ({m!r:.80})"
            )
    users = [m["content"] for m in value if m["role"] == "user"]
    if not users:
        raise UserError(f"{row} has malformed chat messages in '{col}': no user message")
    return users[-1], tuple({"role": m["role"], "content": m["content"]} for m in value)
