"""Mixture-of-Experts policies: their routers, and the experts each token was routed to.

A route is, for one token fed to the model, the top-k expert ids its MoE layers selected:
a (T, L, k) uint8 array for a row that fed T tokens through L MoE layers. `Routers`
hooks a model's router modules once; the same hooks then

- **record** (the rollout loop, and R2's old-logprob pass): the selection of every
  token of every forward, which the caller cuts into rows;
- **replay** (every training-side forward under R2/R3): a `ReplayPlan` lays the rows'
  recorded routes out as the forward lays out their tokens (one entry per flattened
  position), and the router's selection is replaced by the recorded one where a route
  exists. The routing *weights* are recomputed from the live router logits, gathered
  from the full softmax (not from the zeroed top-k probabilities) and renormalised as the
  model does, so the router keeps its gradient. Positions without a route (a row's last
  token, which the rollout never fed; padding) keep the live selection: their outputs
  predict nothing the loss reads;
- **observe**: per layer, the agreement of the live selection with the replayed one
  (before replay), the experts' load over real tokens, and the load-balancing auxiliary
  loss over the selection the forward used.

Which router classes are MoE routers is a registry (`ROUTER_KINDS`) keyed by class name;
each says whether the model renormalises its top-k weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from rftpipe.config.schema import RunConfig, old_logprobs_source
from rftpipe.errors import UserError
from rftpipe.storage import routes as storage_routes
from rftpipe.storage.routes import MAX_EXPERTS, RouteShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterKind:
    """How a router class forms its routing weights from its top-k probabilities."""

    normalises: Callable[[torch.nn.Module], bool]
    """Whether the model divides the top-k probabilities by their sum."""


ROUTER_KINDS: dict[str, RouterKind] = {
    # softmax over the logits (float32), top-k, renormalised always.
    "MixtralTopKRouter": RouterKind(normalises=lambda m: True),
    # The same, renormalised only with the config's norm_topk_prob.
    "Qwen3MoeTopKRouter": RouterKind(normalises=lambda m: bool(m.norm_topk_prob)),
    "Qwen2MoeTopKRouter": RouterKind(normalises=lambda m: bool(m.norm_topk_prob)),
    "OlmoeTopKRouter": RouterKind(normalises=lambda m: bool(m.norm_topk_prob)),
}
"""Router classes (transformers 5.x) whose forward maps (N, H) hidden states to (logits
(N, E), weights (N, k), expert ids (N, k)) from softmax(logits) and top-k."""


JITTER_BLOCKS: dict[str, str] = {"MixtralSparseMoeBlock": "jitter_noise"}
"""MoE blocks that multiply their input by random noise while training (Mixtral's
`router_jitter_noise`), and the attribute that holds its amplitude."""


def _no_jitter(model: torch.nn.Module) -> None:
    """Turn router jitter off: it draws from the global RNG in every training forward, so
    a resumed run, a recompute in the backward and the rollout's replayed routes would
    each see other noise (and the selection R3 replays would not be the one trained)."""
    for m in model.modules():
        attr = JITTER_BLOCKS.get(type(m).__name__)
        if attr is not None and getattr(m, attr):
            logger.info("MoE router jitter %s set to 0 (it is random)", getattr(m, attr))
            setattr(m, attr, 0.0)


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in forward (layer) order; [] for a dense model."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_KINDS]


def _experts(router: torch.nn.Module) -> int:
    # The router's own count, not its weight's rows: ZeRO-3 leaves an empty local weight.
    e = router.num_experts
    assert isinstance(e, int)
    return e


def _top_k(router: torch.nn.Module) -> int:
    k = router.top_k
    assert isinstance(k, int)
    return k


def route_shape(model: torch.nn.Module) -> RouteShape | None:
    """The model's `RouteShape`, None for a dense model."""
    routers = router_modules(model)
    if not routers:
        return None
    experts = {_experts(r) for r in routers}
    top_k = {_top_k(r) for r in routers}
    if len(experts) != 1 or len(top_k) != 1:
        raise UserError(
            f"model.path: MoE layers with different expert counts {sorted(experts)} or top-k "
            f"{sorted(top_k)}; routes need one shape"
        )
    e, k = experts.pop(), top_k.pop()
    if e > MAX_EXPERTS:
        raise UserError(f"model.path: {e} experts; routes are stored as uint8 (at most 256)")
    return RouteShape(layers=len(routers), experts=e, top_k=k)


def encode(routes: torch.Tensor | np.ndarray) -> bytes:
    """A row's (T, L, k) routes as the bytes of its Parquet cell."""
    return storage_routes.encode(routes.numpy() if isinstance(routes, torch.Tensor) else routes)


def decode(cell: bytes, tokens: int, shape: RouteShape, what: str) -> torch.Tensor:
    """A row's Parquet cell back to its (tokens, L, k) routes (`storage.routes.decode`:
    one line naming the row when the cell does not fit)."""
    return torch.from_numpy(storage_routes.decode(cell, tokens, shape, what).copy())


@dataclass(frozen=True, kw_only=True, slots=True)
class Slots:
    """Where a forward's layout put its rows' tokens, one entry per flattened slot."""

    rows: torch.Tensor
    """(S,) the row whose token the slot holds (a shared prompt's slots: the row that
    owns the copy), -1 on padding."""
    pos: torch.Tensor
    """(S,) the token's position in its row's prompt+response sequence."""
    prompt_rows: torch.Tensor | None = None
    """(B,) the row whose slots hold row b's prompt (None: each row its own)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayPlan:
    """One forward's routes, one entry per flattened (batch, position) slot of its input."""

    ids: torch.Tensor
    """(S, L, k) int64 the recorded selection (any value where not `forced`)."""
    forced: torch.Tensor
    """(S,) bool: the slot has a recorded route, which replaces the live selection."""
    real: torch.Tensor
    """(S,) bool: the slot holds a token (not padding); load, agreement and the auxiliary
    loss count only these."""


def lay_out(
    routes: Sequence[torch.Tensor | None],
    slot_rows: torch.Tensor,
    slot_pos: torch.Tensor,
    shape: RouteShape,
) -> ReplayPlan:
    """The `ReplayPlan` of a forward whose flattened slot s holds token `slot_pos[s]` of row
    `slot_rows[s]`'s prompt+response sequence (-1: padding). Row r's routes (None: replay
    nothing of it) cover its first len(routes[r]) tokens, the ones the rollout fed."""
    rows = slot_rows.reshape(-1).long()
    pos = slot_pos.reshape(-1).long()
    lengths = torch.tensor([0 if r is None else int(r.shape[0]) for r in routes], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    present = [r for r in routes if r is not None and r.shape[0]]
    table = (
        torch.cat([r.long() for r in present])
        if present
        else torch.zeros((0, shape.layers, shape.top_k), dtype=torch.long)
    )
    real = rows >= 0
    safe_rows = rows.clamp(min=0)
    forced = real & (pos < lengths[safe_rows])
    index = torch.where(forced, starts[safe_rows] + pos, torch.zeros_like(pos))
    ids = (
        table[index]
        if table.shape[0]
        else torch.zeros((rows.shape[0], shape.layers, shape.top_k), dtype=torch.long)
    )
    return ReplayPlan(ids=ids, forced=forced, real=real)


def cut_rows(
    recorded: torch.Tensor,
    slots: Slots,
    prompt_lens: Sequence[int],
    lengths: Sequence[int],
) -> list[torch.Tensor]:
    """The inverse of `lay_out` for a recorded forward: row r's (lengths[r], L, k) uint8
    routes, its token t's from the slot that holds it (its prompt's from the slots of the
    row whose copy of the prompt it shares)."""
    rows = slots.rows.reshape(-1).long()
    pos = slots.pos.reshape(-1).long()
    out = []
    for r, n in enumerate(lengths):
        owner = r if slots.prompt_rows is None else int(slots.prompt_rows[r])
        mine = ((rows == r) | ((rows == owner) & (pos < prompt_lens[r]))) & (pos < n)
        where = torch.full((n,), -1, dtype=torch.long)
        where[pos[mine]] = mine.nonzero().flatten()
        if bool((where < 0).any()):
            raise ValueError(
                f"row {r}: the forward fed {int((where >= 0).sum())} of its {n} tokens"
            )
        out.append(recorded[where].to(torch.uint8))
    return out


def cut_pairs(
    recorded: torch.Tensor,
    slots: Slots,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """`cut_rows` for a forward of (prompt, response) rows: row r's P + R - 1 routes (its
    last token predicts nothing the rollout sampled, so a route there is nobody's)."""
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True)]
    return cut_rows(recorded, slots, [len(p) for p in prompts], lengths)


@dataclass(kw_only=True, slots=True)
class RoutingStats:
    """What the routers saw since the last `take_stats`, summed over forwards."""

    tokens: int = 0
    """Real (token, forward) slots seen, per layer."""
    agree: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """(L,) slots whose live selection (as a set) equals the replayed one."""
    replayed: int = 0
    """Slots with a replayed route."""
    load: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """(L, E) selections per expert (the selection the forward used)."""


class Routers:
    """Hooks on one model's MoE routers: record, replay, observe (see the module doc).

    One instance per model module (`Routers.of`), shared by the trainer and a colocated
    rollout engine, which drive it in turn: a plan is set for one forward (and its
    activation recompute in the backward that follows) and cleared after.
    """

    _by_router: weakref.WeakKeyDictionary[torch.nn.Module, Routers] = weakref.WeakKeyDictionary()
    """Keyed by a model's first router module, so a wrapper of the same model (peft, a
    backend's) finds the same hooks instead of hooking the routers twice."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = router_modules(model)
        shape = route_shape(model)
        if shape is None:
            raise ValueError("Routers: the model has no MoE router")
        self.shape = shape
        self._normalises = [ROUTER_KINDS[type(m).__name__].normalises(m) for m in self.modules]
        self._plan: ReplayPlan | None = None
        self._recorded: list[list[torch.Tensor]] | None = None
        self._noise = 0.0
        self._noise_gen: torch.Generator | None = None
        self._aux: list[torch.Tensor] | None = None
        self.last_slots: Slots | None = None
        """The slot map of the last `RowRoutes.apply` (R2 cuts its recording by it)."""
        self._counts: dict[torch.device, torch.Tensor] = {}
        """Per device, (L, E + 2) int64 running sums: each layer's load per expert, then
        its agreeing and replayed slots (device tensors: no host sync per layer)."""
        for i, m in enumerate(self.modules):
            m.register_forward_hook(self._hook(i))
        _no_jitter(model)

    @classmethod
    def of(cls, model: torch.nn.Module) -> Routers | None:
        """The model's `Routers` (hooked on first use), None for a dense model."""
        routers = router_modules(model)
        if not routers:
            return None
        if routers[0] not in cls._by_router:
            cls._by_router[routers[0]] = cls(model)
        return cls._by_router[routers[0]]

    def _row(self, layer: int, device: torch.device) -> torch.Tensor:
        if device not in self._counts:
            size = (self.shape.layers, self.shape.experts + 2)
            self._counts[device] = torch.zeros(size, dtype=torch.long, device=device)
        return self._counts[device][layer]

    # -- driving -------------------------------------------------------------------------

    def set_plan(self, plan: ReplayPlan | None) -> None:
        """Replay `plan` in the next forward (and its recompute); None: route live."""
        self._plan = plan

    @contextlib.contextmanager
    def recording(self, noise: float | None = None, seed: int = 0) -> Iterator[None]:
        """Record every forward's live selection (`take`), with no plan. `noise` (a test
        fault, default from RFTPIPE_ROUTER_NOISE): the selection is the top-k of logits
        plus that much seeded Gaussian noise, the weights still the clean softmax's, as an
        engine whose router numerics differ from the trainer's would select."""
        saved = self._plan
        self._plan, self._recorded = None, [[] for _ in self.modules]
        self._noise = float(os.environ.get("RFTPIPE_ROUTER_NOISE", "0")) if noise is None else noise
        self._noise_gen = torch.Generator().manual_seed(seed) if self._noise else None
        try:
            yield
        finally:
            self._plan, self._recorded, self._noise, self._noise_gen = saved, None, 0.0, None

    def take(self) -> torch.Tensor:
        """(S, L, k) int64 the selection of the forward(s) since the last take, slots in
        the order the forwards flattened them."""
        if self._recorded is None:
            raise RuntimeError("Routers.take outside recording()")
        per_layer = [
            torch.cat(r) if r else torch.zeros((0, self.shape.top_k)) for r in self._recorded
        ]
        self._recorded = [[] for _ in self.modules]
        return torch.stack(per_layer, dim=1).long()

    def start_aux(self) -> None:
        """Collect each layer's load-balancing loss from the next forward on."""
        self._aux = []

    def take_aux(self) -> torch.Tensor | None:
        """The mean over MoE layers of the load-balancing loss of the forward since
        `start_aux` (with its graph), None if none ran; collection stops."""
        got, self._aux = self._aux, None
        if not got:
            return None
        return torch.stack(got[: len(self.modules)]).mean()

    def clear(self) -> None:
        """No plan, no collection: the next forward routes live."""
        self._plan, self._aux = None, None

    def take_stats(self) -> RoutingStats:
        """What the forwards since the last call saw (and start again from nothing)."""
        e = self.shape.experts
        total = np.zeros((self.shape.layers, e + 2))
        for counts in self._counts.values():
            total += counts.cpu().numpy()
        self._counts.clear()
        replayed = int(total[0, e + 1])
        return RoutingStats(
            tokens=int(total[0, :e].sum()) // self.shape.top_k,
            agree=total[:, e],
            replayed=replayed,
            load=total[:, :e],
        )

    # -- the hook ------------------------------------------------------------------------

    def _hook(self, layer: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        def hook(
            module: torch.nn.Module,
            args: tuple[object, ...],
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, scores, ids = out
            plan = self._plan
            if self._noise and self._noise_gen is not None:
                noisy = logits.float() + self._noise * torch.randn(
                    logits.shape, generator=self._noise_gen, dtype=torch.float32
                ).to(logits.device)
                ids = noisy.topk(self.shape.top_k, dim=-1).indices
                scores = self._weights(layer, logits, ids, scores.dtype)
            if plan is not None:
                if plan.forced.shape[0] != logits.shape[0]:
                    raise RuntimeError(
                        f"routing replay: the plan has {plan.forced.shape[0]} slots, the "
                        f"forward {logits.shape[0]} (a layout and its routes disagree)"
                    )
                forced = plan.forced.to(ids.device)
                want = plan.ids[:, layer].to(ids.device)
                self._observe(layer, ids, want, forced, plan.real.to(ids.device))
                ids = torch.where(forced[:, None], want, ids)
                replayed = self._weights(layer, logits, ids, scores.dtype)
                scores = torch.where(forced[:, None], replayed, scores)
                # Load and the auxiliary loss are the engines' forwards' (every one sets a
                # plan); the rollout's decode steps skip them.
                real = plan.real.to(ids.device)
                self._count_load(layer, ids, real)
                if self._aux is not None:
                    self._aux.append(aux_loss(logits, ids, real, self.shape.experts))
            if self._recorded is not None:
                self._recorded[layer].append(ids.detach().cpu())
            return logits, scores, ids

        return hook

    def _weights(
        self, layer: int, logits: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The routing weights of selection `ids`: the full softmax's probabilities at
        those ids (so the router's gradient flows), renormalised as the model does."""
        top = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
        if self._normalises[layer]:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(dtype)

    def _observe(
        self,
        layer: int,
        live: torch.Tensor,
        want: torch.Tensor,
        forced: torch.Tensor,
        real: torch.Tensor,
    ) -> None:
        same = (live.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
        counted = forced & real
        row = self._row(layer, live.device)
        e = self.shape.experts
        row[e] += (same & counted).sum()
        row[e + 1] += counted.sum()

    def _count_load(self, layer: int, ids: torch.Tensor, real: torch.Tensor) -> None:
        chosen = ids[real].flatten()
        row = self._row(layer, ids.device)
        row[: self.shape.experts] += torch.bincount(chosen, minlength=self.shape.experts)


def aux_loss(
    logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, experts: int
) -> torch.Tensor:
    """One layer's load-balancing loss (Switch Transformer, Mixtral's form): E times the
    sum over experts of (the share of the k selections that went to it) x (its mean router
    probability), over real tokens. The shares count the selection the forward *used*
    (the replayed one under replay; transformers' `load_balancing_loss_func` recomputes
    top-k from the logits instead), so the loss balances the experts that actually ran;
    the gradient flows through the probabilities only, as in Mixtral."""
    probs = torch.softmax(logits.float(), dim=-1)[real]
    chosen = ids[real]
    if chosen.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    share = (
        torch.zeros(experts, device=logits.device).scatter_add_(
            0, chosen.flatten(), torch.ones(chosen.numel(), device=logits.device)
        )
        / chosen.shape[0]
    )
    return experts * (share * probs.mean(dim=0)).sum()


@dataclass(frozen=True, kw_only=True, slots=True)
class RowRoutes:
    """A forward's rows and their routes, bound to the model's routers: each row's (T_r, L,
    k) uint8 routes over its first T_r tokens, or None to route that row live. A layout
    function calls `apply` with its slot map right before the model's forward."""

    routers: Routers
    rows: Sequence[torch.Tensor | None]

    def prompt_key(self, i: int, prompt_len: int) -> bytes:
        """What must also be equal for two rows to share one copy of their prompt: its
        routes (rows of one rollout group share them; a prompt repeated in another group
        was prefilled in another batch and may have been routed otherwise)."""
        r = self.rows[i]
        return b"" if r is None else encode(r[:prompt_len])

    def apply(self, slots: Slots) -> None:
        """Replay these rows' routes in the next forward, laid out by `slots`."""
        self.routers.set_plan(lay_out(self.rows, slots.rows, slots.pos, self.routers.shape))
        self.routers.last_slots = slots
        self.routers.start_aux()


def padded_slots(attention_mask: torch.Tensor) -> Slots:
    """The `Slots` of right- or left-padded rows: slot (b, j) holds row b's token j minus
    its padding in front (or -1 on padding)."""
    real = attention_mask.bool().cpu()
    pos = real.long().cumsum(-1) - 1
    rows = torch.arange(real.shape[0])[:, None].expand_as(real)
    return Slots(rows=torch.where(real, rows, -1).reshape(-1), pos=pos.clamp(min=0).reshape(-1))


ReplayMode = Literal["none", "r2", "r3"]


def is_moe_dir(model_dir: Path) -> bool:
    """Whether the HF model in `model_dir` routes tokens to experts (its config names an
    expert count and a top-k), read without loading it."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    return bool(experts) and bool(config.get("num_experts_per_tok"))


def replay_mode(cfg: RunConfig, model_dir: Path) -> ReplayMode:
    """`train.router_replay` resolved for this policy, or one line why it cannot run.

    auto: r3 where the rollout records routes (the HF loop, single- or multi-turn), r2
    where the old logprobs come from the actor (a serving engine), else none; dense
    policies none."""
    mode = cfg.train.router_replay
    if not is_moe_dir(model_dir):
        if mode in ("r2", "r3"):
            raise UserError(
                f"train.router_replay={mode}: model.path '{cfg.model.path}' is a dense "
                "model (no MoE router); set none or auto"
            )
        return "none"
    if mode == "auto":
        if cfg.rollout.engine == "hf":
            return "r3"
        return "r2" if old_logprobs_source(cfg.train, cfg.rollout) == "actor" else "none"
    # r3 with an engine that records no routes is refused at load
    # (`RunConfig._check_router_replay`).
    return mode


def dir_route_shape(model_dir: Path) -> RouteShape | None:
    """The `RouteShape` of the model in `model_dir` (None: dense), from its config alone
    (the model is built on the meta device: no weights are read)."""
    if not is_moe_dir(model_dir):
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return route_shape(model)


def expert_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], float]:
    """(the routed experts' parameters, the share of them a token uses: k / E), ([], 1.0)
    for a dense model. An MoE block's experts are the `experts` module beside its router
    (transformers' layout); a shared expert, which every token uses, is not among them."""
    shape = route_shape(model)
    if shape is None:
        return [], 1.0
    routers = {id(m) for m in router_modules(model)}
    params: list[torch.nn.Parameter] = []
    for _, block in model.named_modules():
        children = dict(block.named_children())
        if any(id(c) in routers for c in children.values()) and "experts" in children:
            params.extend(children["experts"].parameters())
    return params, shape.top_k / shape.experts
