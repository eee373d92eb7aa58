"""The prompts of a run: `Prompt` and `PromptSet` (templated, length-checked, with their
fingerprint), chat templating, loading the training and evaluation prompts from their
source, and the held-out split."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rftpipe.config.schema import DataConfig, EvalConfig
from rftpipe.data.balance import balance
from rftpipe.data.images import LoadedImage, VisionPrompt
from rftpipe.data.sampler import SamplerState, global_window, mixed_window, schedule
from rftpipe.data.sources import (
    Message,
    RawRow,
    file_rows,
    load_source_rows,
    reasoning_gym_rows,
)
from rftpipe.errors import UserError
from rftpipe.storage.images import ImageRef, image_ref


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
    messages: tuple[dict[str, Any], ...] = ()
    """The chat messages `token_ids` templates (system prompt included): where a
    multi-turn episode's conversation starts (`rollout.env`). An image prompt's content is
    a list of text and ``{"type": "image"}`` parts."""
    images: tuple[LoadedImage, ...] = ()
    """The images of the prompt's image parts, in order (empty: a text prompt)."""
    image_refs: tuple[ImageRef, ...] = ()
    """Where `images` live in the run's image store (what trajectory rows reference)."""
    where: str = ""
    """The dataset row as error messages name it (empty for generated prompts)."""


class ImageTemplater(Protocol):
    """A vision-language model's prompt encoding, as far as loading prompts needs it
    (`rftpipe.engines.vision.VisionEncoder`)."""

    def template_ids(self, prompt: VisionPrompt, row: str) -> list[int]:
        """The chat-templated prompt, each image's pad token repeated once per image token."""
        ...


class PromptSet:
    """The prompts of one epoch, templated and length-checked, plus the dataset's scorer."""

    def __init__(
        self,
        rows: list[RawRow],
        tokenizer: Any,
        cfg: DataConfig,
        scorer: Any,
        weights: Sequence[float] = (1.0,),
        vision: ImageTemplater | None = None,
        names: Sequence[str] = (),
    ) -> None:
        self.scorer = scorer
        self._hash_rows = cfg.source == "datasets"
        self.weights = tuple(weights)
        """Mixing weight of each dataset (one entry: a single source), or of each part of
        a balanced stream (`rftpipe.data.balance`)."""
        self.names = tuple(names) or tuple(f"data.datasets[{k}]" for k in range(len(weights)))
        """Each part as error messages name it."""
        self.prompts: list[Prompt] = []
        self.sizes = [0] * len(self.weights)
        """Prompts kept per dataset; the prompt list holds them dataset after dataset."""
        for i, row in enumerate(rows):
            images = row.vision.images if row.vision is not None else ()
            if images:
                messages = prompt_messages(cfg.system_prompt, row.text, row.vision.messages)  # type: ignore[union-attr]
                ids = _image_prompt_ids(cfg, vision, row, messages)
            else:
                messages = prompt_messages(cfg.system_prompt, row.text, row.messages)
                ids = template_prompt(tokenizer, cfg.system_prompt, row.text, messages)
            if len(ids) > cfg.max_prompt_tokens:
                if images and cfg.overlong != "filter":
                    raise UserError(_overlong_image_row(cfg, row, len(ids)))
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
                    messages=tuple(dict(m) for m in messages),
                    images=images,
                    image_refs=tuple(image_ref(im.data, im.ext) for im in images),
                    where=row.where,
                )
            )
            self.sizes[row.source] += 1
        if not self.prompts:
            raise UserError("data: no prompts left after applying data.max_prompt_tokens")
        if (empty := self.empty_part()) is not None:
            raise UserError(f"{empty}: no prompts left after applying data.max_prompt_tokens")
        self._period = schedule(self.weights)

    def empty_part(self) -> str | None:
        """The first dataset (or balanced part) of a mix left without prompts, by name."""
        if len(self.sizes) > 1 and not all(self.sizes):
            return self.names[self.sizes.index(0)]
        return None

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
            if p.image_refs:
                # The pixels, not just their token count: a changed image is other data.
                h.update(json.dumps([r.sha256 for r in p.image_refs]).encode())
            if self._hash_rows:
                # What reward functions see besides the answer (data_source, extra_info);
                # the older sources' fingerprints stay what they always were.
                h.update(json.dumps(p.metadata, sort_keys=True, default=str).encode())
        if self.weights != (1.0,):
            # A mix's weights decide which prompts each step takes; a single source's
            # fingerprint stays what it always was.
            h.update(json.dumps(self.weights).encode())
        return h.hexdigest()


def _overlong_image_row(cfg: DataConfig, row: RawRow, n: int) -> str:
    """An image row over `data.max_prompt_tokens`, refused under `data.overlong=error` and
    `truncate` alike: truncation keeps a prompt's last tokens and would cut its image
    tokens, so it is never the remedy offered."""
    field = "data.overlong" if cfg.overlong == "truncate" else "data.max_prompt_tokens"
    return (
        f"{field}: {row.where} has {n} tokens, its image tokens included, > "
        f"data.max_prompt_tokens={cfg.max_prompt_tokens}; raise data.max_prompt_tokens, lower "
        "data.images.max_pixels or set data.overlong=filter (truncating would cut its image "
        "tokens)"
    )


def _image_prompt_ids(
    cfg: DataConfig, vision: ImageTemplater | None, row: RawRow, messages: list[dict[str, Any]]
) -> list[int]:
    assert row.vision is not None
    n = len(row.vision.images)
    if vision is None:
        raise UserError(
            f"{row.where}: the prompt shows {n} images but model.path is a text-only model "
            "(its config.json has no vision_config)"
        )
    if n > cfg.images.max_per_prompt:
        raise UserError(
            f"{row.where}: {n} images > data.images.max_per_prompt={cfg.images.max_per_prompt}"
        )
    return vision.template_ids(
        VisionPrompt(messages=tuple(messages), images=row.vision.images), row.where
    )


def prompt_messages(
    system_prompt: str | None, text: str, messages: Sequence[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The chat messages of a prompt row: its own `messages`, or `text` as the user's; the
    `system_prompt` goes first only when they have no system message of their own (the
    dataset's per-row choice wins over the config's default)."""
    if messages is None:
        messages = [{"role": "user", "content": text}]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return list(messages)


def template_prompt(
    tokenizer: Any,
    system_prompt: str | None,
    text: str,
    messages: Sequence[Message] | None = None,
) -> list[int]:
    """Chat-templated prompt tokens with the generation prompt, of `prompt_messages`."""
    messages = prompt_messages(system_prompt, text, messages)
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])


def load_prompts(
    cfg: DataConfig, tokenizer: Any, vision: ImageTemplater | None = None
) -> PromptSet:
    """The training prompts; `vision` encodes image prompts (None: a text-only model,
    which refuses them)."""
    if cfg.source == "reasoning_gym":
        rows, ds = reasoning_gym_rows(cfg, cfg.reasoning_gym.size, cfg.reasoning_gym.seed)
        return PromptSet(rows, tokenizer, cfg, ds)
    if cfg.source == "datasets":
        rows = [r for k, d in enumerate(cfg.datasets) for r in load_source_rows(d, k)]
        weights = [d.weight for d in cfg.datasets]
        if cfg.balance_by is None:
            return PromptSet(rows, tokenizer, cfg, None, weights, vision)
        parts = balance(rows, weights, cfg.balance_by)
        return PromptSet(parts.rows, tokenizer, cfg, None, parts.weights, vision, parts.names)
    return PromptSet(file_rows(cfg), tokenizer, cfg, None)


def load_eval_prompts(cfg: DataConfig, ecfg: EvalConfig, tokenizer: Any) -> PromptSet:
    """Held-out prompts from the same generator under a different seed."""
    if cfg.source != "reasoning_gym":
        raise UserError(
            "eval.holdout_fraction: held-out problems of a file source must be carved out of "
            "it (set eval.holdout_fraction > 0); only reasoning_gym can generate more"
        )
    rows, ds = reasoning_gym_rows(cfg, ecfg.size, ecfg.seed)
    return PromptSet(rows, tokenizer, cfg, ds)


ContentKey = tuple[str | None, ...]


def content_key(p: Prompt) -> ContentKey:
    """What makes two prompts the same problem, whatever their ids: the text, the answer,
    and the images (the same question about another picture is another problem)."""
    key = (p.text.strip(), None if p.answer is None else p.answer.strip())
    return (*key, *(r.sha256 for r in p.image_refs)) if p.image_refs else key


def _held_out(key: ContentKey, salt: int, fraction: float) -> bool:
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
        flags = [_held_out(content_key(p), ecfg.seed, ecfg.holdout_fraction) for p in train.prompts]
        held = [p for p, o in zip(train.prompts, flags, strict=True) if o]
        kept = [p for p, o in zip(train.prompts, flags, strict=True) if not o]
        if not kept or not held:
            raise UserError(
                f"eval.holdout_fraction={ecfg.holdout_fraction} leaves {len(kept)} training "
                f"and {len(held)} held-out prompts of {len(train)}; both must be non-empty"
            )
        out = train.subset(kept)
        if (empty := out.empty_part()) is not None:
            raise UserError(
                f"eval.holdout_fraction={ecfg.holdout_fraction} holds out every prompt of "
                f"{empty}; lower it or add rows"
            )
        return out, train.subset(_distinct(held)[: ecfg.size])
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
    out: dict[ContentKey, Prompt] = {}
    for p in prompts:
        out.setdefault(content_key(p), p)
    return list(out.values())
