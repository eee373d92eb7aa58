"""Varlen packing for the sharded backends: a micro-batch's rows as one flat sequence.

`fsdp2` and `deepspeed` must run the root module's own forward (FSDP2's root unit gathers
the embeddings, final norm and tied head there; ZeRO-3 gathers every parameter through its
hooks), so they cannot call the decoder directly as `single`'s prefix forest does. With
`train.packing` on they pack instead of padding: the micro-batch as one sequence of N
tokens, each distinct prompt once followed by its rows' responses (but their last token,
whose logits predict nothing), each token at its own row's position, under a
block-diagonal causal mask (a response token sees its prompt and its own row's earlier
tokens), and the LM head runs only on the K positions that predict a loss token
(`logits_to_keep` as an index). No padding reaches a linear layer or the head, a group's
prompt is computed once (as `single`'s prefix forest), and the rows' logprobs equal their
padded forward's.

A row says which of its response tokens the loss takes (`PackRow.loss_mask`: a multi-turn
rollout's environment turns are inputs, not actions) and may carry its own positions
(`PackRow.position_ids`: 3-D rotary for multimodal models); the train stage passes the
defaults today (every response token, positions 0..L-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rftpipe.algos.losses import gather_logprobs
from rftpipe.engines.moe import RowRoutes, Slots
from rftpipe.engines.train.chunked_head import head_returns_logprobs
from rftpipe.engines.train.forward import linear_head, logits_entropy


@dataclass(frozen=True, kw_only=True, slots=True)
class PackRow:
    """One prompt+response row to pack."""

    prompt: Sequence[int]
    """(P,) prompt tokens."""
    response: Sequence[int]
    """(R,) response tokens."""
    loss_mask: Sequence[bool] | None = None
    """(R,) True on the response tokens the loss takes (actions). False on tokens that are
    inputs, like a multi-turn rollout's environment turns: later tokens still attend to
    them, but they get no logprob (0) and no gradient. None: every response token."""
    position_ids: torch.Tensor | None = None
    """(P + R,) or (k, P + R) int64 rotary positions of the row's tokens, k the rotary axes
    (3 for Qwen2-VL's M-RoPE). None: 0..P+R-1."""
    prompt_key: bytes = b""
    """What else two rows must share to share one copy of their prompt (an MoE row's
    prompt routes: `moe.RowRoutes.prompt_key`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBatch:
    """Rows packed into one sequence of N tokens, K of whose positions predict loss tokens.

    B rows, T the longest response. Nothing here is padded: N is each distinct prompt's
    tokens once plus every row's response tokens but its last, K the loss tokens.
    """

    input_ids: torch.Tensor
    """(1, N) int64 the rows' tokens end to end."""
    position_ids: torch.Tensor
    """(1, N), or (k, 1, N) for k-D rotary, int64: each token's position in its own row."""
    group_ids: torch.Tensor
    """(N,) int64 the prompt group of each token (rows with the same prompt share it)."""
    row_ids: torch.Tensor
    """(N,) int64 the row of each response token; -1 on a group's prompt tokens, which
    every row of the group sees."""
    slot_rows: torch.Tensor
    """(N,) int64 `row_ids` with a prompt's tokens given to its group's first row: with
    `position_ids`, where an MoE row's routes go."""
    prompt_rows: torch.Tensor
    """(B,) int64 the first row of each row's group (whose slots hold its prompt)."""
    attention_mask: torch.Tensor
    """(1, 1, N, N) bool, True where query i sees key j: j <= i, in i's group, and j a
    prompt token or i's own row. Every token sees itself, so no softmax row is empty."""
    loss_mask: torch.Tensor
    """(B, T) bool, True on the loss tokens, row-major in the order of `target_index`."""
    target_index: torch.Tensor
    """(K,) int64 position in the sequence whose logits predict each loss token."""
    target_ids: torch.Tensor
    """(K,) int64 the loss tokens."""

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            group_ids=self.group_ids.to(device, non_blocking=True),
            row_ids=self.row_ids.to(device, non_blocking=True),
            slot_rows=self.slot_rows.to(device, non_blocking=True),
            prompt_rows=self.prompt_rows.to(device, non_blocking=True),
            attention_mask=self.attention_mask.to(device, non_blocking=True),
            loss_mask=self.loss_mask.to(device, non_blocking=True),
            target_index=self.target_index.to(device, non_blocking=True),
            target_ids=self.target_ids.to(device, non_blocking=True),
        )


def default_rows(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> list[PackRow]:
    """Rows whose every response token is a loss token, at positions 0..L-1."""
    return [PackRow(prompt=p, response=r) for p, r in zip(prompts, responses, strict=True)]


def _row_positions(i: int, row: PackRow) -> torch.Tensor:
    """(k, L) the row's positions (k = 1 without explicit ones)."""
    n = len(row.prompt) + len(row.response)
    if row.position_ids is None:
        return torch.arange(n).unsqueeze(0)
    pos = row.position_ids.to(torch.long)
    pos = pos.unsqueeze(0) if pos.ndim == 1 else pos
    if pos.ndim != 2 or pos.shape[1] != n:
        raise ValueError(
            f"PackRow.position_ids of row {i}: shape {tuple(row.position_ids.shape)}, "
            f"expected ({n},) or (k, {n}) for its prompt+response tokens"
        )
    return pos


def _row_loss_mask(i: int, row: PackRow) -> list[bool]:
    if row.loss_mask is None:
        return [True] * len(row.response)
    if len(row.loss_mask) != len(row.response):
        raise ValueError(
            f"PackRow.loss_mask of row {i}: {len(row.loss_mask)} entries for "
            f"{len(row.response)} response tokens"
        )
    return [bool(m) for m in row.loss_mask]


def _groups(rows: Sequence[PackRow], share_prompts: bool) -> list[list[int]]:
    """Row indices by prompt, in first-seen order: rows with the same prompt tokens at the
    same positions share one copy of it (each row its own group without sharing)."""
    if not share_prompts:
        return [[i] for i in range(len(rows))]
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        head = _row_positions(i, row)[:, : len(row.prompt)]
        key = (tuple(row.prompt), tuple(map(tuple, head.tolist())), row.prompt_key)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def pack_rows(rows: Sequence[PackRow], share_prompts: bool = True) -> PackedBatch:
    """`rows` packed into one `PackedBatch`: per prompt (in first-seen order) the prompt
    once, then each of its rows' response tokens but the last. Sharing a prompt is exact:
    a response sees the prompt's keys and values as in its own sequence, and the prompt's
    gradient gathers every row's (`share_prompts=False`: a copy per row).

        >>> b = pack_rows([PackRow(prompt=[5, 6], response=[7, 8]), PackRow(prompt=[9], response=[3])])
        >>> b.input_ids.tolist(), b.position_ids.tolist(), b.target_index.tolist()
        ([[5, 6, 7, 9]], [[0, 1, 2, 0]], [1, 2, 3])
    """
    ids: list[int] = []
    group_ids: list[int] = []
    row_ids: list[int] = []
    slot_rows: list[int] = []
    prompt_rows = torch.zeros(len(rows), dtype=torch.long)
    positions: list[torch.Tensor] = []
    targets: dict[int, list[tuple[int, int]]] = {}  # row -> (sequence position, token)
    t_max = max(1, max(len(r.response) for r in rows))
    loss_mask = torch.zeros((len(rows), t_max), dtype=torch.bool)
    for g, members in enumerate(_groups(rows, share_prompts)):
        first = rows[members[0]]
        prompt_end = len(ids) + len(first.prompt)
        ids.extend(first.prompt)
        group_ids.extend([g] * len(first.prompt))
        row_ids.extend([-1] * len(first.prompt))
        slot_rows.extend([members[0]] * len(first.prompt))
        prompt_rows[members] = members[0]
        positions.append(_row_positions(members[0], first)[:, : len(first.prompt)])
        for i in members:
            row, mask = rows[i], _row_loss_mask(i, rows[i])
            body = list(row.response[:-1])  # the last token is predicted, never an input
            # Logits at position j predict the next token: the prompt's last one the first.
            where = [prompt_end - 1, *range(len(ids), len(ids) + len(body))]
            targets[i] = [(where[t], row.response[t]) for t, keep in enumerate(mask) if keep]
            loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
            ids.extend(body)
            group_ids.extend([g] * len(body))
            row_ids.extend([i] * len(body))
            slot_rows.extend([i] * len(body))
            pos = _row_positions(i, row)
            positions.append(pos[:, len(row.prompt) : len(row.prompt) + len(body)])
    if len({p.shape[0] for p in positions}) != 1:
        raise ValueError("PackRow.position_ids: every row needs the same number of rotary axes")
    group, owner = torch.tensor(group_ids), torch.tensor(row_ids)
    n = len(ids)
    # Query i sees key j <= i of its own group that is its prompt or its own response.
    visible = (group[:, None] == group[None, :]) & (
        (owner[None, :] == -1) | (owner[:, None] == owner[None, :])
    )
    pos = torch.cat(positions, dim=1)
    flat = [t for i in range(len(rows)) for t in targets[i]]  # row-major, as `loss_mask`
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0),
        # (1, N) for ordinary rotary; (k, 1, N) the layout multi-axis rotary models take.
        position_ids=pos if pos.shape[0] == 1 else pos.unsqueeze(1),
        group_ids=group,
        row_ids=owner,
        slot_rows=torch.tensor(slot_rows, dtype=torch.long),
        prompt_rows=prompt_rows,
        attention_mask=(visible & torch.ones(n, n, dtype=torch.bool).tril())[None, None],
        loss_mask=loss_mask,
        target_index=torch.tensor([t[0] for t in flat], dtype=torch.long),
        target_ids=torch.tensor([t[1] for t in flat], dtype=torch.long),
    )


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
    routes: RowRoutes | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs (and entropies) of the loss tokens from one forward of the packed
    sequence through `model`'s own forward (a sharding wrapper's hooks run); 0, with no
    gradient, where `batch.loss_mask` is False. With `chunk` the head returns them a chunk
    of positions at a time (`train.logprob_chunk_size`), never the full logits. `routes`:
    an MoE policy's rows' routes to replay (the rows built with their `prompt_key`)."""
    if routes is not None:
        routes.apply(
            Slots(
                rows=batch.slot_rows.cpu(),
                pos=batch.position_ids.reshape(-1).cpu(),
                prompt_rows=batch.prompt_rows.cpu(),
            )
        )
    inputs = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": batch.attention_mask,
        "use_cache": False,
        "logits_to_keep": batch.target_index,
    }
    ent: torch.Tensor | None
    if chunk and batch.target_ids.shape[0] > chunk:
        # The head sees only the kept positions, (1, K, H): every one of them is a target.
        keep = torch.arange(batch.target_ids.shape[0], device=batch.target_ids.device)[None]
        with head_returns_logprobs(
            linear_head(model),
            keep,
            batch.target_ids[None],
            temperature,
            chunk,
            with_entropy,
            entropy_grad,
        ):
            out = model(**inputs).logits[0]
        lp, ent = out[:, 0], (out[:, 1] if with_entropy else None)
    else:
        logits = model(**inputs).logits[0].float()
        lp = gather_logprobs(logits, batch.target_ids, temperature=temperature)
        ent = logits_entropy(logits, temperature, entropy_grad) if with_entropy else None
    out = torch.zeros(batch.loss_mask.shape, dtype=lp.dtype, device=lp.device)
    return (
        out.masked_scatter(batch.loss_mask, lp),
        None if ent is None else out.masked_scatter(batch.loss_mask, ent),
    )


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed rows, or None if it can.

    The block-diagonal mask is a 4-D boolean mask, which transformers passes as-is to sdpa
    (True: attend). Eager attention adds a mask to the scores instead, flash attention
    ignores a 4-D one, and a sliding-window layer would lose its window: each would compute
    something else than the padded forward, silently.
    """
    config = getattr(model, "config", None)
    if config is None:  # not a transformers model: nothing to check it against
        return None
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"the model's attention is {impl!r}, not 'sdpa' (a 4-D block-diagonal mask)"
    layers = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layers)
    if not layers and getattr(config, "sliding_window", None):
        sliding = getattr(config, "use_sliding_window", True)
    if sliding:
        return f"the model ({config.model_type}) has sliding-window attention layers"
    return None
