"""The supervised examples of `train.ptx`: loading them (templated like RL prompts, the
completion as the chat template writes an assistant turn), each optimizer step's batch of
them, and the run's data fingerprint with them folded in."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rftpipe.config.schema import PTXConfig
from rftpipe.data.prompts import PromptSet, template_prompt
from rftpipe.data.sampler import SamplerState, global_window
from rftpipe.data.sources import Message, cell, has_column, prompt_of, read_table
from rftpipe.errors import UserError


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
    table = read_table(src, where)
    if src.answer_col is None:
        raise UserError(f"{where}.answer_column: PTX examples need a completion column")
    for key, col in (("prompt_column", src.prompt_col), ("answer_column", src.answer_col)):
        if not has_column(table.schema, col):
            raise UserError(
                f"{where}.{key}: column '{col}' not in '{src.path}' (has {table.column_names})"
            )
    out = []
    for i, rec in enumerate(table.to_pylist()):
        row = f"{where}: row {i} of '{src.path}'"
        text, messages = prompt_of(rec[src.prompt_col], row, src.prompt_col)
        answer = cell(rec, src.answer_col)
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
