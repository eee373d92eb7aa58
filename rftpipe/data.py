"""Prompt sources and the deterministic, world-size-independent sampler.

The sampler's whole state is one integer, ``consumed``: prompts taken so far over the
run. Epoch ``e`` is a permutation derived from (seed, e); step batches are consecutive
windows of the endless sequence of epochs, so a batch may straddle an epoch boundary and
every prompt is still used exactly once per epoch. Ranks take contiguous slices of the
global window, so changing the number of ranks changes who rolls out a prompt, never
which prompts a step uses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rftpipe.config.schema import DataConfig, EvalConfig
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


@dataclass(frozen=True, kw_only=True, slots=True)
class RawRow:
    prompt_id: int
    text: str
    answer: str | None
    metadata: dict[str, Any]


def _reasoning_gym_rows(cfg: DataConfig, size: int, seed: int) -> tuple[list[RawRow], Any]:
    import reasoning_gym

    rg = cfg.reasoning_gym
    try:
        ds = reasoning_gym.create_dataset(rg.name, size=size, seed=seed, **rg.kwargs)
    except Exception as exc:  # the generator validates its own kwargs
        raise UserError(f"data.reasoning_gym: {rg.name!r} rejected its settings: {exc}") from exc
    rows = [
        RawRow(prompt_id=i, text=e["question"], answer=str(e["answer"]), metadata=e["metadata"])
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


class PromptSet:
    """The prompts of one epoch, templated and length-checked, plus the dataset's scorer."""

    def __init__(self, rows: list[RawRow], tokenizer: Any, cfg: DataConfig, scorer: Any) -> None:
        self.scorer = scorer
        self.prompts: list[Prompt] = []
        for i, row in enumerate(rows):
            ids = template_prompt(tokenizer, cfg.system_prompt, row.text)
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
                )
            )
        if not self.prompts:
            raise UserError("data: no prompts left after applying data.max_prompt_tokens")

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, prompts: Sequence[Prompt]) -> PromptSet:
        """The same source and scorer with only `prompts` (already templated)."""
        out = PromptSet.__new__(PromptSet)
        out.scorer, out.prompts = self.scorer, list(prompts)
        return out

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(json.dumps([p.prompt_id, p.token_ids, p.answer]).encode())
        return h.hexdigest()


def template_prompt(tokenizer: Any, system_prompt: str | None, text: str) -> list[int]:
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def load_prompts(cfg: DataConfig, tokenizer: Any) -> PromptSet:
    if cfg.source == "reasoning_gym":
        rows, ds = _reasoning_gym_rows(cfg, cfg.reasoning_gym.size, cfg.reasoning_gym.seed)
        return PromptSet(rows, tokenizer, cfg, ds)
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
    held = [dataclasses.replace(p, prompt_id=first + i) for i, p in enumerate(held)]
    return train, generated.subset(held)


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
