"""The train stage's inputs and how they are cut into mini- and micro-batches, shared by
the actor's update (`stages.train`) and the critic's (`stages.critic_train`).

Mini-batches are drawn from a permutation of the step's *global* samples keyed by
(seed, step, epoch, prompt id, sample idx), and their token and sequence counts are
all-reduced, so the update is the same on any number of ranks and any micro-batching
(rows or a token budget per micro-batch: `split_micro_batches`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from rftpipe.config.schema import TrainConfig
from rftpipe.data.ptx import PTXExample
from rftpipe.dist import Dist
from rftpipe.engines.train.forward import split_micro_batches
from rftpipe.seeding import derive_seed
from rftpipe.stages.images import RowImages, Vision
from rftpipe.stages.routes import RouteColumn
from rftpipe.storage.branch_rows import BRANCH


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainInputs:
    step: int
    run_seed: int
    table: pa.Table
    """This rank's committed advantage rows."""
    global_samples: Sequence[tuple[int, int]]
    """(prompt_id, sample_idx) of every sample of the step on all ranks."""
    kl_coef: float
    temperature: float
    response_budget: int = 0
    """rollout.max_new_tokens: the constant length of `seq-mean-token-sum-norm` (0: the
    micro-batch's padded width, verl's fallback)."""
    ptx: Sequence[PTXExample] = ()
    """Every example of `train.ptx.data` (the same on all ranks); empty with ptx off."""
    images: RowImages | None = None
    """The rows' images (a vision-language policy), rebuilt from the run's image store."""
    routes: RouteColumn | None = None
    """The routes column the policy's forwards replay (an MoE policy under R2/R3)."""
    skip: frozenset[int] | None = None
    """Rows (indexes into `table`) the policy's update leaves out: all-alike groups'
    (`rftpipe.config.schema.skips_alike_groups`); None: skipping off."""

    def vision(self, chunk: Sequence[Mapping[str, Any]]) -> Vision:
        """A micro-batch's images, per row (None: a text-only micro-batch)."""
        return None if self.images is None else self.images.of(chunk)


def minibatch_plan(inp: TrainInputs, epoch: int, mini_batches: int) -> list[list[int]]:
    """Local row indexes of each mini-batch, in a world-size-independent global order.

    Groups are shuffled as units (keyed by prompt id) and stay contiguous, so a micro-batch
    holds whole groups and their shared prompt is computed once. A sample is an episode: an
    agent episode of several sequences (rows) goes into one mini-batch whole.
    """
    keyed = sorted(
        inp.global_samples,
        key=lambda s: (derive_seed(inp.run_seed, inp.step, f"train/{epoch}", s[0]), s[1]),
    )
    bounds = _minibatch_bounds(keyed, mini_batches)
    # Each sample's episodes on this rank, each a list of its rows (a prompt met twice in a
    # step, across an epoch boundary, has two), taken in order as the sample comes up.
    local: dict[tuple[int, int], list[list[int]]] = {}
    table = inp.table
    starts = (
        [b == 0 for b in table.column(BRANCH).to_pylist()]
        if BRANCH in table.column_names
        else [True] * table.num_rows
    )
    keys = zip(
        table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist(), strict=True
    )
    for i, (key, new) in enumerate(zip(keys, starts, strict=True)):
        episodes = local.setdefault(key, [])
        if new or not episodes:
            episodes.append([])
        episodes[-1].append(i)
    plan = []
    for a, b in itertools.pairwise(bounds):
        plan.append([i for s in keyed[a:b] if local.get(s) for i in local[s].pop(0)])
    return plan


def _minibatch_bounds(keyed: Sequence[tuple[int, int]], mini_batches: int) -> list[int]:
    """Where the ordered samples are cut into mini-batches: equal parts when they divide
    (config validation makes a full step's samples divide); a dynamically sampled step
    short of its batch is cut between whole groups, as evenly as they go, into at most one
    mini-batch per group (an empty one would be an optimizer step without a gradient)."""
    if len(keyed) % mini_batches == 0:
        size = len(keyed) // mini_batches
        return [m * size for m in range(mini_batches + 1)]
    groups = len({p for p, _ in keyed})
    per_group = len(keyed) // groups
    parts = min(mini_batches, groups)
    return [(m * groups // parts) * per_group for m in range(parts + 1)]


def model_tokens(row: dict[str, Any]) -> int:
    """How many of a row's response tokens the model sampled: all of them, except in a
    multi-turn episode (`loss_mask`), whose environment tokens are not trained on."""
    mask = row.get("loss_mask")
    return row["response_length"] if mask is None else int(sum(mask))


def model_token_mask(
    loss_masks: Sequence[Sequence[int] | None], mask: torch.Tensor
) -> torch.Tensor:
    """`mask` (B, T) narrowed to the tokens the model sampled: multi-turn rows' `loss_mask`
    is 0 on the environment's tokens (a row without one keeps all of its tokens). The
    policy loss, KL, entropy, critic and the token counts all use the narrowed mask."""
    if all(m is None for m in loss_masks):
        return mask
    own = torch.zeros_like(mask)
    for i, m in enumerate(loss_masks):
        if m is None:
            own[i] = mask[i]
        else:
            own[i, : len(m)] = torch.tensor(list(m), dtype=torch.bool)
    return mask & own


def turn_tokens(
    turn_offsets: Sequence[Sequence[int]],
    turn_rewards: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    shape: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn rows' turn structure on their tokens, in one pass over each row:

    - (B, T) float64: the environment's reward of turn t on the last token the model
      sampled in turn t (`turn_offsets[t]` is where its tokens begin), 0 elsewhere. A turn
      whose action has no model token (a budget cut it to nothing) pays on the last model
      token before it, or, with none, is left to the outcome on the last token;
    - (B, T) bool: True on each turn's first model token (where the discounting
      estimators' `turn_gamma` applies).
    """
    paid = torch.zeros(shape, dtype=torch.float64)
    starts = torch.zeros(shape, dtype=torch.bool)
    for i, (offsets, rewards, mask) in enumerate(
        zip(turn_offsets, turn_rewards, loss_masks, strict=True)
    ):
        # No offsets: an episode ended at reset (`on_error=end_episode`), with no turn.
        ends = [*offsets[1:], len(mask)] if offsets else []
        last = None  # the last model token so far, of this turn or an earlier one
        for t, (start, end) in enumerate(zip(offsets, ends, strict=True)):
            model = [j for j in range(start, min(end, len(mask))) if mask[j]]
            if model:
                starts[i, model[0]] = True
                last = model[-1]
            if t < len(rewards) and last is not None:
                paid[i, last] += rewards[t]
    return paid, starts


def pad_ragged(
    rows: Sequence[Sequence[float]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged lists to (B, T) with a bool mask."""
    t_max = max(1, max((len(r) for r in rows), default=1))
    out = torch.zeros((len(rows), t_max), dtype=dtype)
    mask = torch.zeros((len(rows), t_max), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
        mask[i, : len(r)] = True
    return out, mask


@dataclass(frozen=True, slots=True)
class MiniBatch:
    """One optimizer step's share of this rank's rows."""

    epoch: int
    index: int
    """Its position in the epoch's mini-batch order."""
    counts: torch.Tensor
    """(2,) float64: the mini-batch's global response tokens and sequences (all ranks)."""
    micro: list[list[dict[str, Any]]]
    """This rank's micro-batches of rows, as many on every rank: sharded backends issue
    collectives inside forward and backward, so a rank short of rows runs an empty one
    (the caller gives it weight 0)."""


def alike_groups(table: pa.Table) -> frozenset[int]:
    """This rank's rows whose group (the rows of one prompt id, as the advantage stage
    groups them; a group is never split across ranks) has all its rewards equal: under an
    estimator with `EstimatorTraits.alike_groups_zero` their advantages are exactly 0."""
    ids = table.column("prompt_id").to_pylist()
    rewards = table.column("reward").to_pylist()
    seen: dict[int, set[float]] = {}
    for pid, r in zip(ids, rewards, strict=True):
        seen.setdefault(pid, set()).add(r)
    return frozenset(i for i, pid in enumerate(ids) if len(seen[pid]) == 1)


def alike_rows(table: pa.Table) -> frozenset[int]:
    """`alike_groups` of a table with advantages, checked, not assumed: a row named here
    with a nonzero advantage is a bug, refused in one line."""
    out = alike_groups(table)
    ids = table.column("prompt_id").to_pylist()
    advantages = table.column("advantages").to_pylist()
    for i in out:
        if any(a != 0.0 for a in advantages[i]):
            raise RuntimeError(
                f"row {i} (prompt_id {ids[i]}): its group's rewards are all equal but its "
                "advantages are not 0; the estimator lacks alike_groups_zero"
            )
    return out


def mini_batches(
    cfg: TrainConfig,
    dist: Dist,
    inp: TrainInputs,
    rows: Sequence[dict[str, Any]],
    skip: frozenset[int] | None = None,
) -> Iterator[MiniBatch]:
    """The epochs x mini-batches of one update phase over `rows` (`inp.table` as dicts).

    `skip` (None: skipping off): local rows left out of the micro-batches but still counted
    in the mini-batch's token and sequence totals, the losses' normalisers; a mini-batch
    then runs at least one micro-batch (a weight-0 padding one if every rank skipped all
    its rows), so the parameters get their (zero) gradients as without skipping.

    Collective: every rank must consume the same number of mini-batches in step.
    """
    for epoch in range(cfg.ppo_epochs):
        plan = minibatch_plan(inp, epoch, cfg.mini_batches)
        counts = torch.tensor(
            [[sum(model_tokens(rows[i]) for i in mb), len(mb)] for mb in plan],
            dtype=torch.float64,
        )
        counts = dist.all_reduce_sum(counts)
        for m, mb in enumerate(plan):
            local = [rows[i] for i in mb if skip is None or i not in skip]
            chunks = split_micro_batches(
                cfg,
                [r["prompt_token_ids"] for r in local],
                [r["response_token_ids"] for r in local],
            )
            n_chunks = int(dist.all_reduce_max(torch.tensor([len(chunks)]))[0])
            if skip is not None:
                n_chunks = max(n_chunks, 1)
            micro = [
                [local[i] for i in chunks[c]] if c < len(chunks) else [] for c in range(n_chunks)
            ]
            yield MiniBatch(epoch=epoch, index=m, counts=counts[m], micro=micro)


@contextlib.contextmanager
def seeded_rng(run_seed: int, step: int, stage: str, device: torch.device) -> Iterator[None]:
    """Torch's global RNG seeded from (run seed, step, stage) inside, restored after: what
    a stochastic layer draws while training (LoRA's `model.lora.dropout`) is then the same
    on a replay after a restart as in the uninterrupted run."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(run_seed, step, stage, 0))
        yield
