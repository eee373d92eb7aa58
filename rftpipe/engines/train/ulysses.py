"""Ulysses sequence parallelism (`train.sp_size`) for the FSDP2 backend.

The world is a dp x sp grid: rank r is data-parallel index r // sp and sequence-parallel
index r % sp, so an SP group is sp consecutive ranks (on one node, where the per-layer
all-to-alls are cheapest). The ranks of an SP group hold the same rows (`data_view` gathers
them for the train stage), and each runs its contiguous 1/sp slice of every sequence
(right-padded to a multiple of sp) through the model at the slice's global positions.
Only attention needs the whole sequence: around it an all-to-all turns the
(sequence-sharded, all heads) queries, keys and values into (whole sequence, 1/sp of the
heads), attention runs causally on that, and a second all-to-all turns the output back.
Every other layer is per token, so it runs on the slice alone: activation memory per
rank falls about sp times, and the attention scores sp times too (each rank keeps its
heads' scores over the whole sequence).

Each rank computes the logprobs (and entropies) of the response tokens in its slice; one
all-reduce over the group (identity in the backward: every rank of the group computes the
same loss from the same summed values, so each rank's own positions get their gradient
exactly once) gives every rank the (B, T) logprobs the sp=1 forward gives. FSDP2 shards
over the whole world and sums gradients over it, which adds up the SP ranks' partial
gradients (different tokens of the same rows) as it adds up the data-parallel ones.

The hook is transformers' attention-function registry: the model's attention
implementation is swapped for one that runs Ulysses when the forward passes an
`SPContext` (keyword `ulysses`) and the model's own implementation otherwise.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as tdist

from rftpipe.algos.losses import entropy_from_logits, gather_logprobs
from rftpipe.dist import Dist
from rftpipe.engines import moe
from rftpipe.engines.models import as_causal_lm
from rftpipe.engines.train.chunked_head import head_returns_logprobs
from rftpipe.engines.train.forward import build_micro_batch
from rftpipe.errors import UserError

#: The attention implementations whose math the Ulysses attention reproduces (causal
#: softmax attention; both run here as SDPA on the whole sequence).
_WRAPPABLE = ("sdpa", "eager")


@dataclass(frozen=True, slots=True)
class SPContext:
    """This rank's place in the dp x sp grid and the SP group's process group."""

    sp: int
    sp_rank: int
    dp: int
    dp_rank: int
    group: Any
    """The SP group (ranks dp_rank * sp ... + sp - 1)."""
    dp_group: Any
    """The ranks with this rank's sp_rank, one per SP group."""


@functools.cache
def _mesh(world: int, sp: int, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))


def sp_context(dist: Dist, sp: int) -> SPContext:
    """The grid of `sp`-rank SP groups over `dist`'s world (collective on first use: every
    rank builds the same groups in the same order; later calls reuse them)."""
    if dist.world % sp:
        raise UserError(f"train.sp_size={sp} does not divide the world size {dist.world}")
    device_type = "cuda" if tdist.get_backend() == "nccl" else "cpu"
    mesh = _mesh(dist.world, sp, device_type)
    return SPContext(
        sp=sp,
        sp_rank=dist.rank % sp,
        dp=dist.world // sp,
        dp_rank=dist.rank // sp,
        group=mesh.get_group("sp"),
        dp_group=mesh.get_group("dp"),
    )


# -- the data-parallel view the train stage sees --------------------------------------------


@dataclass(frozen=True, slots=True)
class DataDist(Dist):
    """The data-parallel view of an SP grid: rank and world are the SP group's index and
    count, and collectives run over the ranks with this rank's sp index (one per group), so
    sums over rows count each row once although every rank of a group holds it."""


def data_view(dist: Dist, sp: int, table: pa.Table) -> tuple[Dist, pa.Table]:
    """(The data-parallel view of `dist`, the rows of this rank's SP group) for the train
    stage: the group's ranks hold the union of their committed rows, in rank order, so they
    cut the same micro-batches and each computes its slice of every sequence. `dist` and
    `table` themselves when sp == 1."""
    if sp == 1:
        return dist, table
    ctx = sp_context(dist, sp)
    tables: list[Any] = [None] * sp
    tdist.all_gather_object(tables, table, group=ctx.group)
    view = DataDist(rank=ctx.dp_rank, world=ctx.dp, local_rank=dist.local_rank, group=ctx.dp_group)
    return view, pa.concat_tables(tables)


def gather_rows(
    ctx: SPContext, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]], range]:
    """Every row of the SP group (rank order) and where this rank's own rows are in them."""
    mine = ([list(p) for p in prompts], [list(r) for r in responses])
    parts: list[Any] = [None] * ctx.sp
    tdist.all_gather_object(parts, mine, group=ctx.group)
    before = sum(len(p[0]) for p in parts[: ctx.sp_rank])
    all_prompts = [p for part in parts for p in part[0]]
    all_responses = [r for part in parts for r in part[1]]
    return all_prompts, all_responses, range(before, before + len(prompts))


# -- the model side --------------------------------------------------------------------------


def slice_slots(attention_mask: torch.Tensor, start: int, s: int) -> moe.Slots:
    """The `Slots` of this rank's slice (positions start .. start + s - 1) of right-padded
    rows: slot (b, j) holds row b's token start + j, or padding (-1) past its length."""
    lengths = attention_mask.sum(-1).cpu()
    pos = torch.arange(start, start + s).expand(len(lengths), s)
    rows = torch.arange(len(lengths))[:, None].expand_as(pos)
    real = pos < lengths[:, None]
    return moe.Slots(rows=torch.where(real, rows, -1).reshape(-1), pos=pos.reshape(-1))


def gather_recorded(
    ctx: SPContext, slots: moe.Slots, recorded: torch.Tensor
) -> tuple[moe.Slots, torch.Tensor]:
    """The SP group's slices of one recorded forward put together: every rank's slot map
    and selection (R2 records each rank's own positions), in rank order."""
    parts: list[Any] = [None] * ctx.sp
    tdist.all_gather_object(parts, (slots.rows, slots.pos, recorded), group=ctx.group)
    rows = torch.cat([p[0] for p in parts])
    pos = torch.cat([p[1] for p in parts])
    return moe.Slots(rows=rows, pos=pos), torch.cat([p[2] for p in parts])


def gather_list(ctx: SPContext, items: Sequence[Any]) -> list[Any]:
    """Every rank's `items` of the SP group, in rank order (as `gather_rows` orders rows)."""
    parts: list[Any] = [None] * ctx.sp
    tdist.all_gather_object(parts, list(items), group=ctx.group)
    return [x for part in parts for x in part]


def _name(impl: str) -> str:
    return f"rftpipe_ulysses_{impl}"


def install(model: torch.nn.Module, sp: int) -> None:
    """Check that `model`'s attention can be split `sp` ways and route it through Ulysses.

    Query heads are split sp ways, so sp must divide them; key/value heads are split too
    when sp divides them, and otherwise each is replicated to its query heads first (a GQA
    model with fewer KV heads than sp ranks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config: Any = model.config
    heads = int(config.num_attention_heads)
    if heads % sp:
        raise UserError(
            f"train.sp_size={sp} does not divide the model's {heads} attention heads "
            "(num_attention_heads); choose a divisor"
        )
    impl: str = config._attn_implementation or "eager"
    if impl.startswith("rftpipe_ulysses_"):
        return
    if impl not in _WRAPPABLE:
        raise UserError(
            f"train.sp_size={sp} needs the model's attention to be one of {list(_WRAPPABLE)}, "
            f"got {impl}"
        )
    AttentionInterface.register(_name(impl), functools.partial(_attention, impl))
    # Forwards without a context (none in the train engine today) keep the model's masks.
    AttentionMaskInterface.register(_name(impl), ALL_MASK_ATTENTION_FUNCTIONS[impl])
    config._attn_implementation = _name(impl)


def _attention(
    impl: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    ulysses: SPContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, s, D) query/key/value of this
    rank's slice in, (B, s, H, D) out.

    Causal attention over the whole sequence with no mask: rows are right-padded, so a real
    token's earlier positions are all real and padding never reaches a real token (the
    sp=1 forward's padding mask changes only padding positions, which nothing reads)."""
    if ulysses is None:
        # The model's own implementation: eager is each modeling file's own function.
        from transformers import AttentionInterface

        own = (
            sys.modules[type(module).__module__].eager_attention_forward
            if impl == "eager"
            else AttentionInterface()[impl]
        )
        result: tuple[torch.Tensor, None] = own(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return result
    sp, group = ulysses.sp, ulysses.group
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp:
        # Fewer (or unevenly split) KV heads than ranks: each query head gets its own copy
        # of its KV head, so every rank's heads find theirs locally.
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_seq_to_heads(t, sp, group) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return _heads_to_seq(out, sp, group).transpose(1, 2).contiguous(), None


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i. Autograd
    through the functional collective (its backward is the reverse all-to-all)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def _seq_to_heads(x: torch.Tensor, sp: int, group: Any) -> torch.Tensor:
    """(B, H, s, D), this rank's sequence slice of all heads -> (B, H/sp, sp*s, D), the
    whole sequence of this rank's heads."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, sp, h // sp, s, d).transpose(0, 1)  # (sp: head chunk, B, H/sp, s, D)
    got = _all_to_all(chunks, group)  # (sp: sequence slice, B, H/sp, s, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(x: torch.Tensor, sp: int, group: Any) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: (B, H/sp, sp*s, D) -> (B, H, s, D)."""
    b, hl, n, d = x.shape
    s = n // sp
    chunks = x.reshape(b, hl, sp, s, d).permute(2, 0, 1, 3, 4)  # (sp: slice, B, H/sp, s, D)
    got = _all_to_all(chunks, group)  # (sp: head chunk, B, H/sp, s, D)
    return got.transpose(0, 1).reshape(b, sp * hl, s, d)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the SP group forward, identity backward: each rank holds its
    own positions' values (0 elsewhere), and every rank computes the same loss from the
    sum, so the gradient of each rank's own positions is the loss's, once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        tdist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sp_forward(
    model: torch.nn.Module,
    ctx: SPContext,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    device: torch.device,
    chunk: int = 0,
    routes: moe.RowRoutes | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) response logprobs (and entropies) of rows that every rank of the SP group
    passes alike, each rank running its slice of the sequences through the root module's
    own forward (FSDP2's hooks); the same values as the sp=1 forward on every rank. With
    `chunk` (`train.logprob_chunk_size`) the head returns the logprobs a chunk of
    positions at a time (`head_returns_logprobs`), never this slice's full logits.
    `routes` (an MoE policy): the slice's tokens replay their rows' routes, laid out by
    position as the sp=1 forward lays out the whole rows."""
    mb = build_micro_batch(prompts, responses, pad_id=0).to(device)
    width = mb.input_ids.shape[1]
    s = -(-width // ctx.sp)  # slice length: the rows padded to a multiple of sp
    start = ctx.sp_rank * s
    ids = torch.nn.functional.pad(mb.input_ids, (0, s * ctx.sp - width))[:, start : start + s]
    positions = torch.arange(start, start + s, device=device).expand(ids.shape[0], s)
    if routes is not None:
        routes.apply(slice_slots(mb.attention_mask, start, s))
    # Logits only from the first position that predicts a response token (at least one, so
    # that every rank's loss depends on its forward and every rank enters the backward's
    # all-to-alls).
    first = min(max(int(mb.response_index.min()) - start, 0), s - 1)
    inputs = {
        "input_ids": ids,
        "position_ids": positions,
        "use_cache": False,
        "logits_to_keep": s - first,
        "ulysses": ctx,
    }
    rel = mb.response_index - (start + first)
    owned = (rel >= 0) & (rel < s - first) & mb.response_mask
    if chunk:
        head = as_causal_lm(model).get_output_embeddings()
        assert isinstance(head, torch.nn.Linear), type(head)  # `logprob_chunk_size` checked
        # Every (row, token) position, clamped into the slice: the rows' shapes stay (B, T)
        # and the positions this rank does not own are dropped below.
        index = rel.clamp(0, s - first - 1)
        with head_returns_logprobs(
            head, index, mb.response_ids, temperature, chunk, with_entropy, entropy_grad
        ):
            out = model(**inputs).logits
        lp = torch.where(owned, out[..., 0], 0.0)
        ent = torch.where(owned, out[..., 1], 0.0) if with_entropy else None
    else:
        logits = model(**inputs).logits
        at = owned.nonzero(as_tuple=True)
        mine = logits[at[0], rel[at]].float()  # (tokens of this slice, vocab)
        lp_own = gather_logprobs(mine[:, None], mb.response_ids[at][:, None], temperature)
        anchor = logits[:, -1:, :1].sum() * 0.0  # keeps the graph when the slice owns no token
        lp = torch.zeros(mb.response_ids.shape, device=device).index_put(at, lp_own[:, 0]) + anchor
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                e = entropy_from_logits((mine if entropy_grad else mine.detach()) / temperature)
                ent = torch.zeros(mb.response_ids.shape, device=device).index_put(at, e)
    lp = _SumOverGroup.apply(lp, ctx.group)
    if ent is not None:
        ent = _SumOverGroup.apply(ent, ctx.group)
    return lp, ent
