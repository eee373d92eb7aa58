"""The deterministic, world-size-independent prompt sampler.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from rftpipe.errors import UserError


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


def schedule(weights: Sequence[float]) -> list[int]:
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
