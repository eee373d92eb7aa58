"""Training-engine interface and its backends: single-device and FSDP2.

The algorithm code (stages/train.py) only talks to this interface, so the backend that
shards the model (and DeepSpeed later) stays invisible to it: forward to response
logprobs, backward, optimizer and LR scheduler steps, the weights the rollout engine
takes, and the state that checkpoints save.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from rftpipe.algos.losses import entropy_from_logits, gather_logprobs
from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.train.ema import ParameterEMA
from rftpipe.errors import UserError

# DCP warns on every call that it runs without a process group; single-process runs are
# intended, so the warning is noise in every log.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


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


def _entropy(logits: torch.Tensor, temperature: float, grad: bool) -> torch.Tensor:
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head on just the positions that predict response tokens, then logprobs/entropy."""
    logits = model.get_output_embeddings()(hidden).float()
    lp = gather_logprobs(logits, tokens, temperature=temperature)
    ent = _entropy(logits, temperature, entropy_grad) if with_entropy else None
    return lp, ent


def response_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs of the response tokens under logits / T from one full-sequence forward."""
    hidden = model.get_decoder()(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
    ).last_hidden_state
    idx = mb.response_index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return _head_logprobs(model, hidden.gather(1, idx), mb.response_ids, temperature, with_entropy)


def root_forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like `response_logprobs`, but through the root module's own forward.

    Sharding wrappers (FSDP2) hook the root forward to gather the root-level parameters
    (embeddings, final norm, the tied head) and to reduce their gradients, so calling the
    decoder directly would bypass them. `logits_to_keep` still limits the head to the
    positions from the earliest response start on.
    """
    first = int(mb.response_index.min())
    logits = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        use_cache=False,
        logits_to_keep=mb.input_ids.shape[1] - first,
    ).logits
    idx = (mb.response_index - first).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    logits = logits.gather(1, idx).float()
    lp = gather_logprobs(logits, mb.response_ids, temperature=temperature)
    ent = _entropy(logits, temperature, entropy_grad) if with_entropy else None
    return lp, ent


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixForest:
    """A micro-batch as one prefix tree per distinct prompt, each tree a batch row of its own:
    the prompt once, then each of its rows' responses but their last token, right-padded to
    the longest tree."""

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


def prefix_forest(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], t_max: int
) -> PrefixForest:
    """Rows grouped by prompt (in first-seen order) into a `PrefixForest`."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    width = max(
        len(p) + sum(max(0, len(responses[i]) - 1) for i in rows) for p, rows in groups.items()
    )
    ids = torch.zeros((len(groups), width), dtype=torch.long)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    # Whose token each slot holds: -1 the prompt, -2 padding, else the row index.
    owner = torch.full((len(groups), width), -2, dtype=torch.long)
    gather = torch.zeros((len(responses), t_max), dtype=torch.long)
    for g, (prompt, rows) in enumerate(groups.items()):
        n = len(prompt)
        ids[g, :n] = torch.tensor(prompt, dtype=torch.long)
        pos[g, :n] = torch.arange(n)
        owner[g, :n] = -1
        for i in rows:
            body = list(responses[i][:-1])
            k = len(body)
            gather[i, 0] = g * width + len(prompt) - 1
            gather[i, 1 : 1 + k] = torch.arange(g * width + n, g * width + n + k)
            ids[g, n : n + k] = torch.tensor(body, dtype=torch.long)
            pos[g, n : n + k] = torch.arange(len(prompt), len(prompt) + k)
            owner[g, n : n + k] = i
            n += k
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    visible = (owner[:, None, :] == -1) | (owner[:, :, None] == owner[:, None, :])
    return PrefixForest(
        input_ids=ids,
        position_ids=pos,
        attention_mask=(causal & visible)[:, None],
        gather=gather,
    )


def grouped_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) logprobs for rows in any order: rows sharing a prompt share its forward.

    Each prompt group runs as one batch row, its prefix tree (`prefix_forest`): the prompt
    once, then its rows' responses, under a mask that lets a response see only its prompt
    and its own earlier tokens, at their true positions. The prompt's gradient flows back
    from all of its rows, so the result equals one full forward per row. Attention costs
    the sum over groups of L_max^2, not the square of the whole micro-batch as one packed
    sequence did, and the linear layers see the same tokens plus the padding to the
    longest group. Forward+backward at SmolLM2-135M's shape (`tools/bench_forward.py`),
    against the single packed sequence: 4 groups x 8 responses of 256 tokens 0.40 s
    instead of 1.11 s and 19.2 instead of 25.4 GiB peak on an H100; 16-token responses
    0.99x (2 groups) and 0.88x (4 groups) the time on 2 CPU threads.
    """
    device = model.get_input_embeddings().weight.device
    t_max = max(1, max(len(r) for r in responses))
    resp = torch.zeros((len(responses), t_max), dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    forest = prefix_forest(prompts, responses, t_max)
    hidden = model.get_decoder()(
        input_ids=forest.input_ids.to(device),
        position_ids=forest.position_ids.to(device),
        attention_mask=forest.attention_mask.to(device),
        use_cache=False,
    ).last_hidden_state
    # Padding slots point at position 0: finite, and masked out by the caller.
    hidden = hidden.flatten(0, 1)[forest.gather.to(device)]
    return _head_logprobs(model, hidden, resp.to(device), temperature, with_entropy, entropy_grad)


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


Role = Literal["actor", "reference"]
"""An actor trains (optimizer, scheduler, checkpoints); a reference only scores."""


class TrainEngine(Protocol):
    """What the stages need from a backend; the algorithm never sees the sharding.

    Every method that runs a forward is collective under a sharded backend, so all ranks
    call it the same number of times; `compute_logprobs` pads ranks with fewer rows itself.
    """

    model: torch.nn.Module
    role: Role
    ema: ParameterEMA | None
    """The actor's parameter average (`train.ema_decay`); None when off or not an actor."""

    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        """Parameters (and, later, offloaded optimizer state) ready for forward+backward."""
        ...

    def eval_mode(self) -> contextlib.AbstractContextManager[None]:
        """Parameters ready for no-grad scoring."""
        ...

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) response logprobs (and entropies) with gradients."""
        ...

    def compute_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[list[float]]:
        """No-grad response logprobs of this rank's rows, in micro-batches."""
        ...

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The wrapped module's own forward, with the backend's hooks (the critic's values)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> float:
        """Clip, step and zero the gradients; returns the global pre-clip grad norm."""
        ...

    def lr_scheduler_step(self) -> None: ...

    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        ...

    def rollout_weights(self) -> torch.nn.Module | dict[str, torch.Tensor]:
        """Full weights for the rollout engine (a shared module when colocated)."""
        ...

    def state_dict(self) -> dict:
        """The actor's whole training state, as one Stateful: ``model`` and ``optim`` (views
        of the live, possibly sharded tensors, which DCP writes and reshards) and
        ``scheduler`` (plain, world-size independent)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Apply a state of `state_dict`'s shape, or any part of it (after DCP loaded into
        its tensors)."""
        ...


def lr_lambda(cfg: TrainConfig, total_updates: int) -> Callable[[int], float]:
    def f(i: int) -> float:
        if cfg.warmup_steps and i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        span = max(1, total_updates - cfg.warmup_steps)
        frac = min(1.0, (i - cfg.warmup_steps) / span)
        if cfg.lr_schedule == "linear":
            return 1.0 - frac
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return f


def adamw(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """Every backend's optimizer: AdamW with weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.adam_eps,
        # One fused kernel on CPU and GPU: elementwise, so bitwise repeatable on any thread
        # count and on any partitioning of the parameters (DeepSpeed steps it on flat
        # partitions), and on CPU 5-10x faster than the per-tensor path, whose 113 MB
        # temporaries for the tied embedding are fresh page-faulted mmaps at every step.
        fused=True,
    )


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer's forward in the backward (non-reentrant checkpoint,
    which needs no input that requires grad and works under FSDP2)."""
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the switch (the old name warns and goes in v6); 4.x has only it.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _EngineBase:
    """What the backends share: roles, AdamW (decay on matrices only), LambdaLR, clipping,
    mode switches, no-grad scoring and DCP checkpoints of model + optimizer."""

    model: torch.nn.Module
    cfg: TrainConfig
    dist: Dist
    device: torch.device
    role: Role
    optimizer: torch.optim.Optimizer
    ema: ParameterEMA | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        dist: Dist,
        *,
        role: Role = "actor",
        total_updates: int = 0,
    ) -> None:
        self.cfg = cfg
        self.dist = dist
        self.device = next(model.parameters()).device  # inputs follow the model
        # The entropy needs a graph only when it is part of the loss.
        self._entropy_grad = cfg.entropy_coef != 0
        if cfg.gradient_checkpointing and role == "actor":
            # Before the backend wraps the layers: FSDP2's hooks then stay outside the
            # checkpointed forward, so the recompute does not gather the parameters twice.
            _enable_activation_checkpointing(model)
        self.model = self._prepare(model)
        self._init_role(role, total_updates)

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The backend's wrapping (sharding) of the module, before the optimizer sees it."""
        raise NotImplementedError

    def _init_role(self, role: Role, total_updates: int) -> None:
        self.role = role
        if role == "reference":
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.model.eval()
            return
        self.optimizer = adamw(self.cfg, self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.cfg, total_updates)
        )
        if self.cfg.ema_decay:
            # From the (sharded, placed) initial weights, so it shards like them.
            self.ema = ParameterEMA(self.model, self.cfg.ema_decay)

    def _require_actor(self, what: str) -> None:
        if self.role != "actor":
            raise RuntimeError(f"{what} on a {self.role} engine")

    @property
    def _runner(self) -> torch.nn.Module:
        """The module whose train/eval mode the backend switches (a wrapper's, if any)."""
        return self.model

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[None]:
        # The place where offloaded parameters and optimizer state come back to the device.
        self._require_actor("train_mode")
        self._runner.train()
        try:
            yield
        finally:
            self._runner.eval()

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        was_training = self._runner.training
        self._runner.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self._runner.train(was_training)

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _padded_forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One right-padded full-sequence forward through the runner's own forward, whose
        hooks (FSDP2's unit gathers, DeepSpeed's ZeRO-3 gathers and bf16 copy) must run."""
        mb = build_micro_batch(prompts, responses, pad_id=0).to(self.device)
        return root_forward_logprobs(
            self._runner, mb, temperature, with_entropy, self._entropy_grad
        )

    def _micro_batch_count(self, n: int) -> int:
        """How many micro-batches every rank runs when this one has `n` of them
        (`split_micro_batches`): the most any rank has, since sharded forwards are
        collective. A no-op on one rank."""
        return int(self.dist.all_reduce_max(torch.tensor([n]))[0])

    def compute_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[list[float]]:
        splits = split_micro_batches(self.cfg, prompts, responses)
        out: list[list[float]] = []
        with self.eval_mode():
            for c in range(self._micro_batch_count(len(splits))):
                if c >= len(splits):  # a rank with fewer rows keeps pace in the collectives
                    self.forward([[0]], [[0]], temperature, with_entropy=False)
                    continue
                p = [prompts[i] for i in splits[c]]
                r = [responses[i] for i in splits[c]]
                lp, _ = self.forward(p, r, temperature, with_entropy=False)
                out.extend(lp[i, : len(resp)].tolist() for i, resp in enumerate(r))
        return out

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The wrapped module's own forward on `inputs` (moved to the engine's device),
        through the backend's hooks (FSDP2's unit gathers, DeepSpeed's ZeRO-3 gathers), for
        modules that are not a causal LM: the critic's value model."""
        return self._runner(**{k: v.to(self.device) for k, v in inputs.items()})

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> float:
        self._require_actor("optimizer_step")
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        # The gradients' device, not the compute device: FSDP2's CPU offload keeps them on
        # the host, where foreach=True is refused.
        on_gpu = bool(params) and params[0].grad.device.type == "cuda"
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=on_gpu)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return float(norm)

    def lr_scheduler_step(self) -> None:
        self.scheduler.step()

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._require_actor("state_dict")
        self._init_optimizer_state()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict()}

    def _init_optimizer_state(self) -> None:
        """AdamW's state as the target of a checkpoint load, allocated directly.

        Without it, `get_state_dict` creates the state by running a zero-gradient optimizer
        step: 2.7 s of a restart for the 135M model on 2 cores. Only a state that a load then
        fills in completely is ever created here (a save always follows training steps, which
        create the state themselves), so the moments are left uninitialised: their pages are
        first touched by the load, which a restart runs in the background. The layout is
        fused AdamW's own (`step` a float32 scalar tensor).
        """
        if self.optimizer.state:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.empty_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.empty_like(p, memory_format=torch.preserve_format),
                }

    def load_state_dict(self, state: dict) -> None:
        """Apply whichever of ``model``, ``optim`` and ``scheduler`` `state` holds (a restart
        loads the optimizer's part later, in the background: `checkpoint.LATE_KEYS`)."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._require_actor("load_state_dict")
        if "model" in state:
            set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])


class SingleDeviceEngine(_EngineBase):
    """The whole model and AdamW on one device; the rollout engine shares the module."""

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.dist.world > 1:
            raise UserError(
                f"train.backend: 'single' runs on one rank, not {self.dist.world}; "
                "use train.backend=fsdp2"
            )
        return model

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) response logprobs (and entropies) with gradients, prompts computed once per group.

        With `param_dtype=bfloat16` the forward runs under autocast: matmuls in bf16 from
        the fp32 weights, which (and so AdamW's state and the gradients) stay fp32.
        """
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            return grouped_logprobs(
                self.model, prompts, responses, temperature, with_entropy, self._entropy_grad
            )

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """As the base, under the same autocast as `forward` with `param_dtype=bfloat16`."""
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            return super().run_module(**inputs)

    def rollout_weights(self) -> torch.nn.Module:
        return self.model


class FSDP2Engine(_EngineBase):
    """Parameters, gradients and optimizer state sharded with `fully_shard` (gloo/nccl).

    Every decoder layer and the root are sharded. Gradients are *summed* over ranks
    (divide factor 1) because the losses are already normalised by global token counts.
    With `cpu_offload=all` the shards, their gradients and AdamW state live in host memory
    (construct it from a model on the compute device: inputs follow the model).
    Each micro-batch is one full-sequence forward, so every rank issues the same
    collectives in the same order whatever prompts it holds.
    """

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        # fully_shard moves the parameters to the process group's device (cuda:local_rank
        # under NCCL), so the model's device before sharding says nothing about the inputs'.
        self.device = self.dist.device
        # bf16 compute with fp32 master weights, fp32 gradient reduction and fp32 AdamW state.
        mp = MixedPrecisionPolicy(
            param_dtype=getattr(torch, self.cfg.param_dtype), reduce_dtype=torch.float32
        )
        # Sharded parameters, gradients and AdamW state live in host memory; each unit's
        # shard is copied to the device for its all-gather, and the optimizer steps on the
        # CPU. Pinned pages make those copies asynchronous, and exist only with CUDA.
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if self.cfg.cpu_offload == "all"
            else OffloadPolicy()
        )
        kw = {"mp_policy": mp, "offload_policy": offload}
        units = [fully_shard(layer, **kw) for layer in model.get_decoder().layers]
        units.append(fully_shard(model, **kw))
        # Each unit reduces its own gradients, so each needs both settings: a plain SUM
        # (gloo has no PREMUL_SUM, and with factor 1 there is nothing to scale anyway).
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        try:
            with super().eval_mode():
                yield
        finally:
            # FSDP2 keeps the root unit's parameters unsharded after its forward, for the
            # backward that normally follows at once. After no-grad scoring none follows, so
            # they would stay gathered: full-size memory on every rank, and module parameters
            # that are no longer the optimizer's (a resumed run's optimizer load, which maps
            # one to the other, then fails on the first root parameter).
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._padded_forward(prompts, responses, temperature, with_entropy)

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on every rank, for the rollout engine's own copy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))


def _deepspeed_engine(*args: object, **kwargs: object) -> TrainEngine:
    # Imported on use: DeepSpeed is an optional dependency with a slow import.
    from rftpipe.engines.train.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(*args, **kwargs)


TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {
    "single": SingleDeviceEngine,
    "fsdp2": FSDP2Engine,
    "deepspeed": _deepspeed_engine,
}
