"""Reading prompt rows from each kind of source: a reasoning-gym generator, one file of
string prompts, and the `data.datasets` tables (Parquet, JSON lines or a `save_to_disk`
directory; HF, verl or chat columns), each validated into `RawRow`s before templating."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rftpipe.config.schema import DataConfig, DatasetSourceConfig
from rftpipe.data.images import VIDEO_UNSUPPORTED, VisionPrompt, vision_prompt
from rftpipe.errors import UserError

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


def reasoning_gym_rows(cfg: DataConfig, size: int, seed: int) -> tuple[list[RawRow], Any]:
    import reasoning_gym

    rg = cfg.reasoning_gym
    try:
        ds = reasoning_gym.create_dataset(rg.name, size=size, seed=seed, **rg.kwargs)
    except Exception as exc:  # the generator validates its own kwargs
        raise UserError(f"data.reasoning_gym: {rg.name!r} rejected its settings: {exc}") from exc
    rows = [
        RawRow(
            prompt_id=i,
            text=e["question"],
            answer=str(e["answer"]),
            metadata=e["metadata"],
            data_source=str(e["metadata"].get("source_dataset", "")),
        )
        for i, e in enumerate(ds)
    ]
    return rows, ds


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
