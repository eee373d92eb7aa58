"""Prompt sources and the deterministic, world-size-independent sampler.

The sampler's whole state is one integer, ``consumed``: prompts taken so far over the
run. Epoch ``e`` is a permutation derived from (seed, e); step batches are consecutive
windows of the endless sequence of epochs, so a batch may straddle an epoch boundary and
every prompt is still used exactly once per epoch. Ranks take contiguous slices of the
global window, so changing the number of ranks changes who rolls out a prompt, never
which prompts a step uses.

Several datasets (``data.source=datasets``) share the stream through a fixed, periodic
schedule (a smooth weighted round-robin): position p of the stream belongs to dataset
``schedule[p % period]``, so how many prompts each dataset has given is a function of
``consumed`` alone, and each dataset runs through its own epochs exactly as one would.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from rftpipe.config.schema import DataConfig, DatasetSourceConfig, EvalConfig, PTXConfig
from rftpipe.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One prompt, already templated and tokenized."""

    prompt_id: int
    text: str
    """The user message."""
    token_ids: tuple[int, ...]
    """Chat-templated prompt tokens, generation prompt included."""
    answer: str | None
    metadata: dict[str, Any]
    data_source: str = ""
    """The row's data source, which routes it to reward functions."""


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


def _reasoning_gym_rows(cfg: DataConfig, size: int, seed: int) -> tuple[list[RawRow], Any]:
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


def _file_rows(cfg: DataConfig) -> list[RawRow]:
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
    table = _read_table(src, where)
    routed = {
        "prompt_column": src.prompt_col,
        "answer_column": src.answer_col,
        "data_source_column": src.data_source_col,
        "id_column": src.id_column,
    }
    for key, col in routed.items():
        if col is not None and not _has_column(table.schema, col):
            raise UserError(
                f"{where}.{key}: column '{col}' not in '{src.path}' (has {table.column_names})"
            )
    rows = [_raw_row(src, index, i, rec) for i, rec in enumerate(table.to_pylist())]
    if len({r.prompt_id for r in rows}) != len(rows):
        raise UserError(f"{where}.id_column: ids in '{src.id_column}' are not unique")
    if not rows:
        raise UserError(f"{where}.path: '{src.path}' has no rows")
    return rows


def _raw_row(src: DatasetSourceConfig, index: int, i: int, rec: dict[str, Any]) -> RawRow:
    """Row i of dataset `index`, its routed columns validated."""
    row = f"data.datasets[{index}]: row {i} of '{src.path}'"
    text, messages = _prompt_of(rec[src.prompt_col], row, src.prompt_col)
    answer = _get(rec, src.answer_col) if src.answer_col else None
    if src.data_source_col:
        data_source = _get(rec, src.data_source_col)
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
    metadata = {k: v for k, v in rec.items() if k != src.prompt_col}
    metadata["data_source"] = data_source
    return RawRow(
        prompt_id=index * ID_STRIDE + local_id,
        text=text,
        answer=None if answer is None else str(answer),
        metadata=metadata,
        messages=messages,
        data_source=data_source,
        source=index,
    )


def _read_table(src: DatasetSourceConfig, where: str) -> Any:
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


def _has_column(schema: Any, dotted: str) -> bool:
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


def _get(rec: dict[str, Any], dotted: str) -> Any:
    """The cell `_has_column` found: the column `dotted`, or a field of a struct column."""
    if dotted in rec:
        return rec[dotted]
    value: Any = rec
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _prompt_of(value: Any, row: str, col: str) -> tuple[str, tuple[Message, ...] | None]:
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


class PromptSet:
    """The prompts of one epoch, templated and length-checked, plus the dataset's scorer."""

    def __init__(
        self,
        rows: list[RawRow],
        tokenizer: Any,
        cfg: DataConfig,
        scorer: Any,
        weights: Sequence[float] = (1.0,),
    ) -> None:
        self.scorer = scorer
        self._hash_rows = cfg.source == "datasets"
        self.weights = tuple(weights)
        """Mixing weight of each dataset (one entry: a single source)."""
        self.prompts: list[Prompt] = []
        self.sizes = [0] * len(self.weights)
        """Prompts kept per dataset; the prompt list holds them dataset after dataset."""
        for i, row in enumerate(rows):
            ids = template_prompt(tokenizer, cfg.system_prompt, row.text, row.messages)
            if len(ids) > cfg.max_prompt_tokens:
                if cfg.overlong == "error":
                    raise UserError(
                        f"data.max_prompt_tokens: prompt row {i} (id {row.prompt_id}) has "
                        f"{len(ids)} tokens > {cfg.max_prompt_tokens}; set data.overlong=filter|truncate"
                    )
                if cfg.overlong == "filter":
                    continue
                ids = ids[-cfg.max_prompt_tokens :]
            self.prompts.append(
                Prompt(
                    prompt_id=row.prompt_id,
                    text=row.text,
                    token_ids=tuple(ids),
                    answer=row.answer,
                    metadata=row.metadata,
                    data_source=row.data_source,
                )
            )
            self.sizes[row.source] += 1
        if not self.prompts:
            raise UserError("data: no prompts left after applying data.max_prompt_tokens")
        if len(self.sizes) > 1 and not all(self.sizes):
            empty = self.sizes.index(0)
            raise UserError(
                f"data.datasets[{empty}]: no prompts left after applying data.max_prompt_tokens"
            )
        self._period = _schedule(self.weights)

    def __len__(self) -> int:
        return len(self.prompts)

    def data_sources(self) -> set[str]:
        """The data sources of the prompts ('' for rows that name none)."""
        return {p.data_source for p in self.prompts}

    def window(self, seed: int, shuffle: bool, state: SamplerState, count: int) -> list[int]:
        """Indexes (into `prompts`) of the next `count` prompts after `state`."""
        if len(self.sizes) == 1:
            return global_window(len(self.prompts), seed, shuffle, state, count)
        return mixed_window(self.sizes, self._period, seed, shuffle, state, count)

    def subset(self, prompts: Sequence[Prompt]) -> PromptSet:
        """The same datasets, weights and scorer with only `prompts` (a subsequence of
        this set's, so still dataset after dataset)."""
        dataset = {}
        start = 0
        for k, size in enumerate(self.sizes):
            for p in self.prompts[start : start + size]:
                dataset[id(p)] = k
            start += size
        out = copy.copy(self)
        out.prompts = list(prompts)
        out.sizes = [0] * len(self.sizes)
        for p in out.prompts:
            out.sizes[dataset[id(p)]] += 1
        return out

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(json.dumps([p.prompt_id, p.token_ids, p.answer]).encode())
            if self._hash_rows:
                # What reward functions see besides the answer (data_source, extra_info);
                # the older sources' fingerprints stay what they always were.
                h.update(json.dumps(p.metadata, sort_keys=True, default=str).encode())
        if self.weights != (1.0,):
            # A mix's weights decide which prompts each step takes; a single source's
            # fingerprint stays what it always was.
            h.update(json.dumps(self.weights).encode())
        return h.hexdigest()


def template_prompt(
    tokenizer: Any,
    system_prompt: str | None,
    text: str,
    messages: Sequence[Message] | None = None,
) -> list[int]:
    """Chat-templated prompt tokens with the generation prompt. Chat `messages` are
    templated as they are; `system_prompt` goes first only when they have no system
    message of their own (the dataset's per-row choice wins over the config's default)."""
    if messages is None:
        messages = [{"role": "user", "content": text}]
    has_system = any(m["role"] == "system" for m in messages)
    if system_prompt and not has_system:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])


def load_prompts(cfg: DataConfig, tokenizer: Any) -> PromptSet:
    if cfg.source == "reasoning_gym":
        rows, ds = _reasoning_gym_rows(cfg, cfg.reasoning_gym.size, cfg.reasoning_gym.seed)
        return PromptSet(rows, tokenizer, cfg, ds)
    if cfg.source == "datasets":
        rows = [r for k, d in enumerate(cfg.datasets) for r in load_source_rows(d, k)]
        return PromptSet(rows, tokenizer, cfg, None, [d.weight for d in cfg.datasets])
    return PromptSet(_file_rows(cfg), tokenizer, cfg, None)


def load_eval_prompts(cfg: DataConfig, ecfg: EvalConfig, tokenizer: Any) -> PromptSet:
    """Held-out prompts from the same generator under a different seed."""
    if cfg.source != "reasoning_gym":
        raise UserError(
            "eval.holdout_fraction: held-out problems of a file source must be carved out of "
            "it (set eval.holdout_fraction > 0); only reasoning_gym can generate more"
        )
    rows, ds = _reasoning_gym_rows(cfg, ecfg.size, ecfg.seed)
    return PromptSet(rows, tokenizer, cfg, ds)


def content_key(p: Prompt) -> tuple[str, str | None]:
    """What makes two prompts the same problem, whatever their ids."""
    return (p.text.strip(), None if p.answer is None else p.answer.strip())


def _held_out(key: tuple[str, str | None], salt: int, fraction: float) -> bool:
    digest = hashlib.sha256(json.dumps([salt, *key]).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_held_out(
    cfg: DataConfig, ecfg: EvalConfig, train: PromptSet, tokenizer: Any
) -> tuple[PromptSet, PromptSet | None]:
    """(training prompts, held-out problems), disjoint by content and so by prompt id.

    With `eval.holdout_fraction` the held-out problems are carved out of the training data
    (each distinct problem once, in data order) and training keeps the rest; otherwise
    they come from the generator under `eval.seed`, minus any that training also has.
    """
    if not ecfg.size:
        return train, None
    if ecfg.holdout_fraction:
        out = [_held_out(content_key(p), ecfg.seed, ecfg.holdout_fraction) for p in train.prompts]
        held = [p for p, o in zip(train.prompts, out, strict=True) if o]
        kept = [p for p, o in zip(train.prompts, out, strict=True) if not o]
        if not kept or not held:
            raise UserError(
                f"eval.holdout_fraction={ecfg.holdout_fraction} leaves {len(kept)} training "
                f"and {len(held)} held-out prompts of {len(train)}; both must be non-empty"
            )
        return train.subset(kept), train.subset(_distinct(held)[: ecfg.size])
    generated = load_eval_prompts(cfg, ecfg, tokenizer)
    seen = {content_key(p) for p in train.prompts}
    held = [p for p in _distinct(generated.prompts) if content_key(p) not in seen]
    if not held:
        raise UserError(
            f"eval.size: all {len(generated)} problems drawn with eval.seed={ecfg.seed} also "
            "occur in the training data; set eval.holdout_fraction to carve held-out "
            "problems out of it instead"
        )
    # Generated ids restart at 0: number them after the training ids, so that an id names
    # one problem across the run's rows.
    first = max(p.prompt_id for p in train.prompts) + 1
    out = generated.subset(held)
    out.prompts = [dataclasses.replace(p, prompt_id=first + i) for i, p in enumerate(held)]
    return train, out


def _distinct(prompts: Sequence[Prompt]) -> list[Prompt]:
    out: dict[tuple[str, str | None], Prompt] = {}
    for p in prompts:
        out.setdefault(content_key(p), p)
    return list(out.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    consumed: int = 0
    """Prompts taken so far over the whole run (all ranks)."""


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    from rftpipe.seeding import derive_seed

    return np.random.default_rng(derive_seed(seed, epoch, "sampler", "epoch")).permutation(n)


def global_window(n: int, seed: int, shuffle: bool, state: SamplerState, count: int) -> list[int]:
    """Indexes (into the prompt list) of the next `count` prompts after `state`."""
    out: list[int] = []
    pos = state.consumed
    while len(out) < count:
        epoch, offset = divmod(pos, n)
        order = epoch_order(n, seed, epoch, shuffle)
        take = min(count - len(out), n - offset)
        out.extend(int(i) for i in order[offset : offset + take])
        pos += take
    return out


def rank_slice(items: Sequence[int], rank: int, world: int, unit: int = 1) -> list[int]:
    """Contiguous share of a global window, in whole units of `unit` consecutive items (the
    last unit may be short); the first `units % world` ranks get one unit more."""
    units = [items[i : i + unit] for i in range(0, len(items), unit)]
    base, extra = divmod(len(units), world)
    start = rank * base + min(rank, extra)
    return [x for u in units[start : start + base + (1 if rank < extra else 0)] for x in u]


#: Longest schedule period accepted (the weights' integer ratio summed).
MAX_PERIOD = 100_000


def _schedule(weights: Sequence[float]) -> list[int]:
    """One period of the smooth weighted round-robin over `weights` (nginx's): each
    position adds every dataset's weight to its credit and picks the one with the most
    credit (the first on ties), which pays the total back. With integer weights w_k the
    credits return to zero after sum(w) positions, in which dataset k was picked w_k times,
    spread as evenly as the weights allow. Float weights become their integer ratio
    (each to 1/1000)."""
    fracs = [Fraction(w).limit_denominator(1000) for w in weights]
    scale = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * scale) for f in fracs]
    g = math.gcd(*ints)
    ints = [w // g for w in ints]
    total = sum(ints)
    if total > MAX_PERIOD:
        raise UserError(
            f"data.datasets: weights {list(weights)} have an integer ratio {ints} summing to "
            f"{total} > {MAX_PERIOD}; use rounder weights"
        )
    credit = [0] * len(ints)
    period = []
    for _ in range(total):
        credit = [c + w for c, w in zip(credit, ints, strict=True)]
        pick = max(range(len(ints)), key=lambda k: (credit[k], -k))
        credit[pick] -= total
        period.append(pick)
    return period


def source_counts(period: Sequence[int], k: int, pos: int) -> int:
    """Prompts dataset k gave in stream positions [0, pos)."""
    full, rest = divmod(pos, len(period))
    return full * period.count(k) + period[:rest].count(k)


def mixed_window(
    sizes: Sequence[int],
    period: Sequence[int],
    seed: int,
    shuffle: bool,
    state: SamplerState,
    count: int,
) -> list[int]:
    """`global_window` for datasets laid out one after another in the prompt list, sizes
    `sizes`, mixed by the schedule `period`. Dataset k's epochs are permutations of
    (its seed, epoch), its seed `seed` for k=0 and derived from (seed, k) for the others."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    taken = {k: source_counts(period, k, state.consumed) for k in range(len(sizes))}
    orders: dict[tuple[int, int], np.ndarray] = {}
    out: list[int] = []
    for pos in range(state.consumed, state.consumed + count):
        k = period[pos % len(period)]
        epoch, offset = divmod(taken[k], sizes[k])
        if (k, epoch) not in orders:
            orders[k, epoch] = epoch_order(sizes[k], _source_seed(seed, k), epoch, shuffle)
        out.append(int(offsets[k] + orders[k, epoch][offset]))
        taken[k] += 1
    return out


def _source_seed(seed: int, k: int) -> int:
    from rftpipe.seeding import derive_seed

    return seed if k == 0 else derive_seed(seed, k, "sampler", "dataset")


@dataclass(frozen=True, kw_only=True, slots=True)
class PTXExample:
    """One supervised example of `train.ptx`, templated and tokenized."""

    prompt_ids: tuple[int, ...]
    """Chat-templated prompt tokens, generation prompt included (as an RL prompt's)."""
    completion_ids: tuple[int, ...]
    """The target completion's tokens, end-of-turn included: the only tokens with a loss."""


def load_ptx_examples(
    cfg: PTXConfig, tokenizer: Any, system_prompt: str | None
) -> list[PTXExample]:
    """The examples of `train.ptx.data`, validated (exit 2 naming the field, the column or
    the row on anything malformed) and cut to `train.ptx.max_tokens`.

    Usage::

        ex = load_ptx_examples(PTXConfig(coef=0.1, data=src), tokenizer, None)
        ex[0].prompt_ids, ex[0].completion_ids
    """
    src = cfg.data
    assert src is not None, "train.ptx.coef > 0 needs train.ptx.data (checked at load)"
    where = "train.ptx.data"
    table = _read_table(src, where)
    if src.answer_col is None:
        raise UserError(f"{where}.answer_column: PTX examples need a completion column")
    for key, col in (("prompt_column", src.prompt_col), ("answer_column", src.answer_col)):
        if not _has_column(table.schema, col):
            raise UserError(
                f"{where}.{key}: column '{col}' not in '{src.path}' (has {table.column_names})"
            )
    out = []
    for i, rec in enumerate(table.to_pylist()):
        row = f"{where}: row {i} of '{src.path}'"
        text, messages = _prompt_of(rec[src.prompt_col], row, src.prompt_col)
        answer = _get(rec, src.answer_col)
        if not isinstance(answer, str) or not answer:
            raise UserError(f"{row} has an empty or non-string '{src.answer_col}'")
        prompt = template_prompt(tokenizer, system_prompt, text, messages)
        completion = _completion_ids(tokenizer, system_prompt, text, messages, answer, prompt)
        room = cfg.max_tokens - len(prompt)
        if room >= 1:  # a prompt that leaves no completion token has nothing to learn
            out.append(
                PTXExample(prompt_ids=tuple(prompt), completion_ids=tuple(completion[:room]))
            )
    if len(out) < cfg.batch_size:
        raise UserError(
            f"train.ptx.batch_size: {cfg.batch_size} is larger than the {len(out)} examples of "
            f"'{src.path}' that fit train.ptx.max_tokens={cfg.max_tokens}"
        )
    return out


def _completion_ids(
    tokenizer: Any,
    system_prompt: str | None,
    text: str,
    messages: Sequence[Message] | None,
    answer: str,
    prompt: Sequence[int],
) -> list[int]:
    """The answer's tokens as the chat template writes an assistant turn after `prompt`, up
    to and including EOS (the end of turn), so the model learns to stop as it must in a
    rollout; the answer's plain tokens and EOS if the template does not extend the prompt."""
    turn = [
        *(messages or [{"role": "user", "content": text}]),
        {"role": "assistant", "content": answer},
    ]
    if system_prompt and not any(m["role"] == "system" for m in turn):
        turn = [{"role": "system", "content": system_prompt}, *turn]
    full = list(tokenizer.apply_chat_template(turn, return_dict=True)["input_ids"])
    if full[: len(prompt)] != list(prompt) or len(full) == len(prompt):
        return [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    completion = full[len(prompt) :]
    eos = tokenizer.eos_token_id
    # A rollout ends at EOS: what the template writes after it (a newline) is never sampled.
    return completion[: completion.index(eos) + 1] if eos in completion else completion


def data_fingerprint(prompts: PromptSet, ptx: Sequence[PTXExample]) -> str:
    """The run's data fingerprint: the prompts', with the PTX examples' tokens folded in
    when there are any (a replayed update must see the examples it took), so a run
    without a PTX term keeps the fingerprint it always had."""
    if not ptx:
        return prompts.fingerprint()
    h = hashlib.sha256(prompts.fingerprint().encode())
    for e in ptx:
        h.update(json.dumps([e.prompt_ids, e.completion_ids]).encode())
    return h.hexdigest()


def ptx_batch(n: int, seed: int, update: int, batch_size: int) -> list[int]:
    """Indexes of the PTX examples of the run's optimizer step number `update` (counted from
    (step, epoch, mini-batch), so a replay takes the same ones): the update's window of
    the endless sequence of shuffled epochs of the `n` examples, as `global_window` deals
    prompts, under a seed of its own. The same on every rank and any world size."""
    from rftpipe.seeding import derive_seed

    state = SamplerState(consumed=update * batch_size)
    return global_window(n, derive_seed(seed, 0, "ptx", "epochs"), True, state, batch_size)
