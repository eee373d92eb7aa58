"""Rows to response logprobs and entropies: the train forward every backend runs.

Micro-batches as the model sees them (right-padded `MicroBatch`es, or a `PrefixForest`
per group of rows sharing a prompt), how a rank's rows are cut into micro-batches, and the
forwards that turn them into (B, T) logprobs (and entropies) of the response tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rftpipe.algos.losses import entropy_from_logits, gather_logprobs
from rftpipe.config.schema import TrainConfig
from rftpipe.engines.models import as_causal_lm, as_decoder_model
from rftpipe.engines.moe import RowRoutes, Slots, padded_slots
from rftpipe.engines.train.chunked_head import (
    chunkable,
    chunked_head_logprobs,
    head_returns_logprobs,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatch:
    """Right-padded prompt+response rows of one forward pass."""

    input_ids: torch.Tensor
    """(B, L) prompt then response tokens, right-padded."""
    attention_mask: torch.Tensor
    """(B, L) 1 on real tokens."""
    response_index: torch.Tensor
    """(B, T) position in `input_ids` whose logits predict response token t (clamped on padding)."""
    response_ids: torch.Tensor
    """(B, T) response tokens, padded with 0."""
    response_mask: torch.Tensor
    """(B, T) bool, True on real response tokens."""

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            attention_mask=self.attention_mask.to(device, non_blocking=True),
            response_index=self.response_index.to(device, non_blocking=True),
            response_ids=self.response_ids.to(device, non_blocking=True),
            response_mask=self.response_mask.to(device, non_blocking=True),
        )


def build_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> MicroBatch:
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    t_max = max(1, max(len(r) for r in responses))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    index = torch.zeros((len(prompts), t_max), dtype=torch.long)
    resp = torch.zeros((len(prompts), t_max), dtype=torch.long)
    mask = torch.zeros((len(prompts), t_max), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        # logits at position j predict token j+1, so response token t comes from len(p)-1+t.
        index[i] = torch.clamp(torch.arange(t_max) + len(p) - 1, max=len(seq) - 1)
        resp[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = True
    return MicroBatch(
        input_ids=ids,
        attention_mask=attn,
        response_index=index,
        response_ids=resp,
        response_mask=mask,
    )


def logits_entropy(logits: torch.Tensor, temperature: float, grad: bool) -> torch.Tensor:
    if grad:
        return entropy_from_logits(logits / temperature)
    # Only a metric: no graph through a (B, T, vocab) softmax that nothing differentiates.
    with torch.no_grad():
        return entropy_from_logits(logits.detach() / temperature)


def _head_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head on just the positions that predict response tokens, then logprobs/entropy;
    `chunk` positions of logits at a time when it is set (`train.logprob_chunk_size`)."""
    head = as_causal_lm(model).get_output_embeddings()
    if chunk and tokens.numel() > chunk:
        return chunked_head_logprobs(
            _linear(head), hidden, tokens, temperature, chunk, with_entropy, entropy_grad
        )
    logits = head(hidden).float()
    lp = gather_logprobs(logits, tokens, temperature=temperature)
    ent = logits_entropy(logits, temperature, entropy_grad) if with_entropy else None
    return lp, ent


def response_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs of the response tokens under logits / T from one full-sequence forward."""
    decoder = as_decoder_model(model).get_decoder()
    hidden = decoder(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
    ).last_hidden_state
    idx = mb.response_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return _head_logprobs(
        model, hidden.gather(1, idx), mb.response_ids, temperature, with_entropy, chunk=chunk
    )


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Model-config fields under which a causal LM's forward changes the head's logits after
`lm_head` (Gemma 2's soft-capping, Cohere's and Granite's scaling)."""


def _linear(head: torch.nn.Module) -> torch.nn.Linear:
    # `logprob_chunk_size` gave a chunk only for such a head.
    assert isinstance(head, torch.nn.Linear), type(head)
    return head


def linear_head(model: torch.nn.Module) -> torch.nn.Linear:
    """`model`'s LM head, which `logprob_chunk_size` found chunkable."""
    return _linear(as_causal_lm(model).get_output_embeddings())


def logprob_chunk_size(model: torch.nn.Module, requested: int) -> int:
    """`train.logprob_chunk_size` where `model`'s head can be chunked, else 0 (logged): the
    chunked head reproduces a plain linear `lm_head` whose logits the model's forward uses
    as they are, nothing else."""
    if not requested:
        return 0
    lm = as_causal_lm(model)
    config = lm.config.to_dict()
    transforms = [n for n in _LOGIT_TRANSFORMS if config.get(n) not in (None, 1, 1.0)]
    if chunkable(lm.get_output_embeddings()) and not transforms:
        return requested
    logger.warning(
        "train.logprob_chunk_size=%d ignored: %s's head is not a plain linear layer%s",
        requested,
        type(lm).__name__,
        f" ({', '.join(transforms)})" if transforms else "",
    )
    return 0


def train_block_bytes(model: torch.nn.Module) -> int:
    """The largest trainable parameter's bytes: the largest block a train step of `model`
    allocates and frees again at every step at exactly the same size (its gradient, and the
    backward's copies of it; SmolLM2-135M's tied embedding, 113 MB). At fp32 and a hidden
    size of 256 or more it is also at least a chunk of `train.logprob_chunk_size=256`
    positions' float32 logits."""
    return max(
        (p.numel() * p.element_size() for p in model.parameters() if p.requires_grad), default=0
    )


def root_forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
    extra: Mapping[str, torch.Tensor] | None = None,
    routes: RowRoutes | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `response_logprobs`, but through the root module's own forward (`extra`: more
    keyword arguments of that forward, a vision-language model's images and positions;
    `routes`: an MoE policy's rows' routes to replay).

    Sharding wrappers (FSDP2) hook the root forward to gather the root-level parameters
    (embeddings, final norm, the tied head) and to reduce their gradients, so calling the
    decoder directly would bypass them. `logits_to_keep` still limits the head to the
    positions from the earliest response start on; with `chunk` the head itself returns
    the logprobs and entropies (`head_returns_logprobs`), so no full logits exist.
    """
    first = int(mb.response_index.min())
    index = mb.response_index - first
    head = as_causal_lm(model).get_output_embeddings()
    inputs = {
        "input_ids": mb.input_ids,
        "attention_mask": mb.attention_mask,
        "use_cache": False,
        "logits_to_keep": mb.input_ids.shape[1] - first,
        **(extra or {}),
    }
    if routes is not None:
        routes.apply(padded_slots(mb.attention_mask))
    if chunk and mb.response_ids.numel() > chunk:
        with head_returns_logprobs(
            _linear(head), index, mb.response_ids, temperature, chunk, with_entropy, entropy_grad
        ):
            out = model(**inputs).logits
        return out[..., 0], (out[..., 1] if with_entropy else None)
    logits = model(**inputs).logits
    idx = index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    logits = logits.gather(1, idx).float()
    lp = gather_logprobs(logits, mb.response_ids, temperature=temperature)
    ent = logits_entropy(logits, temperature, entropy_grad) if with_entropy else None
    return lp, ent


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixForest:
    """A micro-batch as prefix trees, each a batch row of its own: a prompt once, then each
    of its rows' responses but their last token, right-padded to a common width. A prompt's
    rows share one tree unless that would widen every tree (`_trees`)."""

    input_ids: torch.Tensor
    """(G, L) the trees' tokens, 0 on padding."""
    position_ids: torch.Tensor
    """(G, L) each token's position in its own prompt+response sequence."""
    attention_mask: torch.Tensor
    """(G, 1, L, L) bool: a token sees its prompt and the earlier tokens of its own response.
    Padding sees the prompt and earlier padding (never an empty row, whose softmax would be
    NaN and leak into the backward), and no real token sees padding."""
    gather: torch.Tensor
    """(B, T) index into the (G * L) flattened positions whose hidden state predicts row b's
    response token t (the prompt's last position predicts token 0; 0 past the row's end)."""
    slots: Slots
    """Where each row's tokens are (a prompt's slots are its tree's first row's), and so
    where an MoE row's routes go."""


def _trees(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    keys: Sequence[bytes] | None = None,
) -> tuple[list[tuple[tuple[int, ...], list[int]]], int]:
    """The rows cut into prefix trees, and the width every tree is padded to.

    Rows sharing a prompt share a tree, but a tree is capped at a width W: a prompt's rows
    (in first-seen order) start a new tree of that prompt when the next would pass W. W is
    the candidate that minimises the padded positions (trees x W), ties to the narrower.
    Without the cap, a prompt met in two groups of a step (a repeated problem) made one
    tree twice as wide as the others, and every row was padded to it: 7 rows of 1,037 positions instead of 8 of 534 in the
    8x8x64 benchmark, 14.1 instead of 8.3 GiB of saved activations (docs/benchmarks.md).
    With `keys` (an MoE row's prompt routes) rows share a tree only if their keys agree too.
    """
    by_key: dict[tuple[tuple[int, ...], bytes], list[int]] = {}
    for i, p in enumerate(prompts):
        by_key.setdefault((tuple(p), b"" if keys is None else keys[i]), []).append(i)
    by_prompt = [(key[0], rows) for key, rows in by_key.items()]

    def cut(width: int) -> list[tuple[tuple[int, ...], list[int]]]:
        trees: list[tuple[tuple[int, ...], list[int]]] = []
        for prompt, rows in by_prompt:
            size = width + 1  # forces a new tree at the first row
            for i in rows:
                k = max(0, len(responses[i]) - 1)
                if size + k > width:
                    trees.append((prompt, []))
                    size = len(prompt)
                trees[-1][1].append(i)
                size += k
        return trees

    # Candidates: the width of each prompt's first j rows as one tree (a repeated prompt's
    # first group among them), never below the widest single row, which must fit alone.
    floor = max(len(prompts[i]) + max(0, len(responses[i]) - 1) for i in range(len(prompts)))
    candidates = {floor}
    for prompt, rows in by_prompt:
        size = len(prompt)
        for i in rows:
            size += max(0, len(responses[i]) - 1)
            candidates.add(max(floor, size))
    best = min((len(cut(w)) * w, w) for w in candidates)[1]
    return cut(best), best


def prefix_forest(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    t_max: int,
    keys: Sequence[bytes] | None = None,
) -> PrefixForest:
    """Rows grouped by prompt (in first-seen order) into a `PrefixForest` (see `_trees`)."""
    trees, width = _trees(prompts, responses, keys)
    ids = torch.zeros((len(trees), width), dtype=torch.long)
    pos = torch.zeros((len(trees), width), dtype=torch.long)
    # Whose token each slot holds: -1 the prompt, -2 padding, else the row index.
    owner = torch.full((len(trees), width), -2, dtype=torch.long)
    gather = torch.zeros((len(responses), t_max), dtype=torch.long)
    slot_rows = torch.full((len(trees), width), -1, dtype=torch.long)
    prompt_rows = torch.zeros(len(prompts), dtype=torch.long)
    for g, (prompt, rows) in enumerate(trees):
        prompt_rows[rows] = rows[0]
        n = len(prompt)
        ids[g, :n] = torch.tensor(prompt, dtype=torch.long)
        pos[g, :n] = torch.arange(n)
        owner[g, :n] = -1
        slot_rows[g, :n] = rows[0]
        for i in rows:
            body = list(responses[i][:-1])
            k = len(body)
            gather[i, 0] = g * width + len(prompt) - 1
            gather[i, 1 : 1 + k] = torch.arange(g * width + n, g * width + n + k)
            ids[g, n : n + k] = torch.tensor(body, dtype=torch.long)
            pos[g, n : n + k] = torch.arange(len(prompt), len(prompt) + k)
            owner[g, n : n + k] = i
            slot_rows[g, n : n + k] = i
            n += k
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = (owner[:, None, :] == -1) | (owner[:, :, None] == owner[:, None, :])
    return PrefixForest(
        input_ids=ids,
        position_ids=pos,
        attention_mask=(causal & visible)[:, None],
        gather=gather,
        slots=Slots(rows=slot_rows.reshape(-1), pos=pos.reshape(-1), prompt_rows=prompt_rows),
    )


def grouped_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk: int = 0,
    routes: RowRoutes | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs for rows in any order: rows sharing a prompt share its forward.

    Each prompt group runs as one batch row, its prefix tree (`prefix_forest`; a prompt
    repeated across groups may make several): the prompt once, then its rows' responses,
    under a mask that lets a response see only its prompt and its own earlier tokens, at
    their true positions. The prompt's gradient flows back
    from all of its rows, so the result equals one full forward per row. Attention costs
    the sum over groups of L_max^2, not the square of the whole micro-batch as one packed
    sequence did, and the linear layers see the same tokens plus the padding to the
    longest group. Forward+backward at SmolLM2-135M's shape (`tools/bench/forward.py`),
    against the single packed sequence: 4 groups x 8 responses of 256 tokens 0.40 s
    instead of 1.11 s and 19.2 instead of 25.4 GiB peak on an H100; 16-token responses
    0.99x (2 groups) and 0.88x (4 groups) the time on 2 CPU threads.
    """
    device = as_decoder_model(model).get_input_embeddings().weight.device
    t_max = max(1, max(len(r) for r in responses))
    resp = torch.zeros((len(responses), t_max), dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    keys = None
    if routes is not None:
        keys = [routes.prompt_key(i, len(p)) for i, p in enumerate(prompts)]
    forest = prefix_forest(prompts, responses, t_max, keys)
    if routes is not None:
        routes.apply(forest.slots)
    decoder = as_decoder_model(model).get_decoder()
    hidden = decoder(
        input_ids=forest.input_ids.to(device),
        position_ids=forest.position_ids.to(device),
        attention_mask=forest.attention_mask.to(device),
        use_cache=False,
    ).last_hidden_state
    # Padding slots point at position 0: finite, and masked out by the caller.
    hidden = hidden.flatten(0, 1)[forest.gather.to(device)]
    return _head_logprobs(
        model, hidden, resp.to(device), temperature, with_entropy, entropy_grad, chunk
    )


def split_micro_batches(
    cfg: TrainConfig, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> list[range]:
    """Consecutive row ranges, one per micro-batch, covering the rows in order.

    Each range holds `micro_batch_size` rows, or, with `max_tokens_per_micro_batch` set, as
    many rows as fit that many prompt+response tokens (a longer row on its own). The train
    stage and `compute_logprobs` both split with it::

        >>> cfg = TrainConfig(max_tokens_per_micro_batch=10)
        >>> split_micro_batches(cfg, [[1, 2]] * 4, [[3, 4], [5], [6] * 9, [7]])
        [range(0, 2), range(2, 3), range(3, 4)]
    """
    budget = cfg.max_tokens_per_micro_batch
    if not budget:
        size = cfg.micro_batch_size
        return [range(i, min(i + size, len(prompts))) for i in range(0, len(prompts), size)]
    splits: list[range] = []
    start, tokens = 0, 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        if i > start and tokens + n > budget:
            splits.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(prompts):
        splits.append(range(start, len(prompts)))
    return splits
