"""The training-engine interface and what its backends share.

The algorithm code (stages/train.py) only talks to this interface, so the backend that
shards the model stays invisible to it: forward to response logprobs, backward, optimizer
and LR scheduler steps, the weights the rollout engine takes, and the state that
checkpoints save. The backends (`single`, `fsdp2`, `deepspeed`) subclass `_EngineBase`;
`rftpipe.engines.train.TRAIN_ENGINES` picks one by `train.backend`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol

import torch

from rftpipe.config.schema import LrScheduleName, TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines import moe
from rftpipe.engines.models import as_decoder_model
from rftpipe.engines.train.ema import ParameterEMA
from rftpipe.engines.train.forward import (
    build_micro_batch,
    logprob_chunk_size,
    root_forward_logprobs,
    split_micro_batches,
)
from rftpipe.engines.train.offload import OffloadRecord, move_state
from rftpipe.engines.train.packing import (
    default_rows,
    pack_rows,
    packed_logprobs,
    packing_refusal,
)
from rftpipe.engines.train.vision import (
    build_vision_micro_batch,
    hf_model,
    root_vision_logprobs,
    vision_lm,
)
from rftpipe.engines.vision import VisionInputs
from rftpipe.errors import UserError

log = logging.getLogger(__name__)

# DCP warns on every call that it runs without a process group; single-process runs are
# intended, so the warning is noise in every log.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


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
    routers: moe.Routers | None
    """An MoE policy's router hooks (`rftpipe.engines.moe`); None for a dense policy."""
    """The actor's parameter average (`train.ema_decay`); None when off or not an actor."""
    offload_record: OffloadRecord
    """What the last offload and reload moved (`train.offload_between_stages`)."""

    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        """Parameters and optimizer state ready for forward+backward: state offloaded by the
        previous train stage comes back here, and with `train.offload_between_stages` goes
        to host memory again when the block ends without an error."""
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
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) response logprobs (and entropies) with gradients; `vision` (a
        vision-language policy): each row's prompt's images, or None for a text row;
        `routes` (an MoE policy under routing replay): each row's (T_r, L, k) recorded
        expert ids over its first T_r tokens, replayed (None: route live)."""
        ...

    def compute_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        """No-grad response logprobs of this rank's rows, in micro-batches (`vision`,
        `routes`: as `forward`'s). `record` (an MoE policy, R2): filled with each row's
        (P + R - 1, L, k) selection of this forward."""
        ...

    def moe_aux_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss (mean over MoE layers, with its graph),
        None for a dense policy."""
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
        of the live, possibly sharded tensors, which DCP writes and reshards; an offloaded
        optimizer state is read from its host copy, where it stays) and ``scheduler``
        (plain, world-size independent)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Apply a state of `state_dict`'s shape, or any part of it (after DCP loaded into
        its tensors)."""
        ...


LR_DECAY: dict[LrScheduleName, Callable[[float], float]] = {
    "constant": lambda frac: 1.0,
    "linear": lambda frac: 1.0 - frac,
    "cosine": lambda frac: 0.5 * (1.0 + math.cos(math.pi * frac)),
}
"""`train.lr_schedule`: the learning rate's multiplier, given how far the updates after
warm-up have gone (0 at warm-up's end, 1 at the run's last update)."""


def lr_lambda(cfg: TrainConfig, total_updates: int) -> Callable[[int], float]:
    decay = LR_DECAY[cfg.lr_schedule]

    def f(i: int) -> float:
        if cfg.warmup_steps and i < cfg.warmup_steps:
            return (i + 1) / cfg.warmup_steps
        span = max(1, total_updates - cfg.warmup_steps)
        return decay(min(1.0, (i - cfg.warmup_steps) / span))

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
        betas=(cfg.betas[0], cfg.betas[1]),  # validated: exactly two
        eps=cfg.adam_eps,
        # One fused kernel on CPU and GPU: elementwise, so bitwise repeatable on any thread
        # count and on any partitioning of the parameters (DeepSpeed steps it on flat
        # partitions), and on CPU 5-10x faster than the per-tensor path, whose 113 MB
        # temporaries for the tied embedding are fresh page-faulted mmaps at every step.
        fused=True,
    )


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer's forward in the backward (non-reentrant checkpoint,
    which needs no input that requires grad and works under FSDP2)."""
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the switch (the old name warns and goes in v6); 4.x has only it.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        as_decoder_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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
    _offloaded: bool = False
    """The optimizer state is in host memory (`offload`) until the next `train_mode`."""

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
        self.offload_record = OffloadRecord()
        self._vlm = vision_lm(hf_model(model))
        """A vision-language model: the sharded backends run each forward through its
        tower (`_vision_forward`)."""
        if cfg.packing and cfg.backend != "single" and (why := packing_refusal(model)):
            raise UserError(f"train.packing=true: {why}; set train.packing=false")
        # The entropy needs a graph only when it is part of the loss.
        self._entropy_grad = cfg.entropy_coef != 0
        self.routers = moe.Routers.of(model)
        """An MoE policy's router hooks (`rftpipe.engines.moe`), None for a dense one."""
        if cfg.gradient_checkpointing and role == "actor":
            # Before the backend wraps the layers: FSDP2's hooks then stay outside the
            # checkpointed forward, so the recompute does not gather the parameters twice.
            enable_activation_checkpointing(model)
        self.model = self._prepare(model)
        self._init_role(role, total_updates)

    @functools.cached_property
    def _chunk(self) -> int:
        """The LM head's logits a chunk at a time, where this model's head allows it; asked
        at the first response forward, which only a causal LM's engine runs (a value model
        has no head to ask)."""
        return logprob_chunk_size(self.model, self.cfg.logprob_chunk_size)

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
        # The place where offloaded optimizer state comes back to the device.
        self._require_actor("train_mode")
        self.reload()
        self._runner.train()
        try:
            yield
        finally:
            self._runner.eval()
        # Not after an error: the run stops, and a retry would find the state on the host.
        if self.cfg.offload_between_stages:
            self.offload()

    # -- offload between stages (`train.offload_between_stages`) -------------------------

    def _move_optimizer_state(self, to_host: bool) -> int:
        """Move what `offload` moves to host memory (or back to the device); returns the
        bytes. Here: AdamW's moments and step for every parameter (plain tensors, or DTensor
        shards under FSDP2); the parameters stay, since the advantage and sync stages (and
        under `single` the HF rollout engine) use them between train stages."""
        return move_state(self.optimizer.state, torch.device("cpu") if to_host else self.device)

    def offload(self) -> None:
        """Move the optimizer state to a separate host copy, freeing its device memory until
        the next `train_mode` (or `reload`). Checkpoint saves read the host copy."""
        if self.role != "actor" or self._offloaded:
            return
        t0 = time.perf_counter()
        moved = self._move_optimizer_state(to_host=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the rollout engine allocates outside torch's cache
        self._offloaded = True
        self.offload_record.bytes = moved
        self.offload_record.offload_s = time.perf_counter() - t0
        log.info(
            "optimizer state offloaded: %.3f GiB to host memory in %.3f s",
            moved / 2**30,
            self.offload_record.offload_s,
        )

    def reload(self) -> None:
        """Bring offloaded optimizer state back to the engine's device (a no-op otherwise)."""
        if not self._offloaded:
            return
        t0 = time.perf_counter()
        self._move_optimizer_state(to_host=False)
        self._offloaded = False
        self.offload_record.reload_s = time.perf_counter() - t0

    @contextlib.contextmanager
    def _resident(self) -> Iterator[None]:
        """The optimizer state on the device for the block, offloaded again after it if it
        was (a load replaces or writes the live state, wherever it is)."""
        was = self._offloaded
        self.reload()
        yield
        if was:
            self.offload()

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
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _row_routes(
        self, routes: Sequence[torch.Tensor | None] | None, rows: int
    ) -> moe.RowRoutes | None:
        """The rows' routes bound to the routers (live rows for none), for an MoE policy."""
        if self.routers is None:
            if routes is not None and any(r is not None for r in routes):
                raise ValueError("routes given for a dense policy")
            return None
        return moe.RowRoutes(routers=self.routers, rows=list(routes or [None] * rows))

    def moe_aux_loss(self) -> torch.Tensor | None:
        return None if self.routers is None else self.routers.take_aux()

    def _padded_forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One right-padded full-sequence forward through the runner's own forward, whose
        hooks (FSDP2's unit gathers, DeepSpeed's ZeRO-3 gathers and bf16 copy) must run."""
        mb = build_micro_batch(prompts, responses, pad_id=0).to(self.device)
        return root_forward_logprobs(
            self._runner,
            mb,
            temperature,
            with_entropy,
            self._entropy_grad,
            self._chunk,
            routes=self._row_routes(routes, len(prompts)),
        )

    def _packed_forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows end to end in one sequence (`packing.pack_rows`: no padding, a
        block-diagonal causal mask), through the runner's own forward as `_padded_forward`.
        Every response token is a loss token, at positions 0..L-1 of its row."""
        row_routes = self._row_routes(routes, len(prompts))
        rows = default_rows(prompts, responses)
        if row_routes is not None:
            rows = [
                dataclasses.replace(r, prompt_key=row_routes.prompt_key(i, len(r.prompt)))
                for i, r in enumerate(rows)
            ]
        batch = pack_rows(rows).to(self.device)
        return packed_logprobs(
            self._runner,
            batch,
            temperature,
            with_entropy,
            self._entropy_grad,
            self._chunk,
            routes=row_routes,
        )

    def _root_forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sharded backends' forward: packed or padded by `train.packing`. Either is one
        forward of the runner per call, so every rank issues the same collectives whatever
        its rows' lengths."""
        run = self._packed_forward if self.cfg.packing else self._padded_forward
        return run(prompts, responses, temperature, with_entropy, routes)

    def _vision_forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        vision: Sequence[VisionInputs | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sharded backends' forward of a vision-language policy, whatever this rank's
        rows hold (`vision` None: text rows): one right-padded call of the runner with the
        rows' images and M-RoPE positions (`vision.root_vision_logprobs`), the tower run on
        every rank in every call. The rows' pads are masked; packing does not apply."""
        rows = [None] * len(prompts) if vision is None else list(vision)
        vb = build_vision_micro_batch(self.model, prompts, responses, rows, pad_id=0)
        return root_vision_logprobs(
            self._runner,
            self.model,
            vb.to(self.device),
            temperature,
            with_entropy,
            self._entropy_grad,
            self._chunk,
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
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        splits = split_micro_batches(self.cfg, prompts, responses)
        out: list[list[float]] = []
        recording: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if record is not None:
            if self.routers is None:
                raise ValueError("compute_logprobs: record= needs an MoE policy")
            recording = self.routers.recording(noise=0.0)
        with self.eval_mode(), recording:
            for c in range(self._micro_batch_count(len(splits))):
                if c >= len(splits):  # a rank with fewer rows keeps pace in the collectives
                    pad = None if vision is None else [None]
                    self.forward([[0]], [[0]], temperature, with_entropy=False, vision=pad)
                    if record is not None and self.routers is not None:
                        self.routers.take()  # the pad forward's selection is nobody's
                    continue
                p = [prompts[i] for i in splits[c]]
                r = [responses[i] for i in splits[c]]
                v = None if vision is None else [vision[i] for i in splits[c]]
                mine = None if routes is None else [routes[i] for i in splits[c]]
                lp, _ = self.forward(p, r, temperature, with_entropy=False, vision=v, routes=mine)
                out.extend(lp[i, : len(resp)].tolist() for i, resp in enumerate(r))
                if record is not None:
                    record.extend(self._recorded_rows(p, r))
            if self.routers is not None:
                self.routers.clear()
        return out

    def _recorded_rows(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Each row's (P + R - 1, L, k) selection of the forward just recorded."""
        assert self.routers is not None and self.routers.last_slots is not None
        return moe.cut_pairs(self.routers.take(), self.routers.last_slots, prompts, responses)

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The wrapped module's own forward on `inputs` (moved to the engine's device),
        through the backend's hooks (FSDP2's unit gathers, DeepSpeed's ZeRO-3 gathers), for
        modules that are not a causal LM: the critic's value model."""
        return self._runner(**{k: v.to(self.device) for k, v in inputs.items()})

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self._routes_done()

    def _routes_done(self) -> None:
        """After a backward: its activation recompute replayed the forward's plan; nothing
        after it may (the next forward sets its own)."""
        if self.routers is not None:
            self.routers.clear()

    def optimizer_step(self) -> float:
        self._require_actor("optimizer_step")
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        # The gradients' device, not the compute device: FSDP2's CPU offload keeps them on
        # the host, where foreach=True is refused.
        grad = params[0].grad if params else None
        on_gpu = grad is not None and grad.device.type == "cuda"
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

    def _state_options(self):  # -> StateDictOptions
        """Trainable parameters only: with LoRA the frozen base weights are the model's
        files, not training state, so checkpoints hold the adapters alone (with full
        fine-tuning every parameter is trainable and this leaves out nothing)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A load of the trainable parameters alone must not miss the frozen ones (their
        # values are the model files'); with none frozen, every key must be there.
        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._require_actor("state_dict")
        self._init_optimizer_state()
        model_sd, optim_sd = get_state_dict(
            self.model, self.optimizer, options=self._state_options()
        )
        # `ignore_frozen_params` keeps a tied head (a second name of the frozen embedding,
        # which `named_parameters` lists only once): with LoRA, the largest frozen tensor.
        trainable = {
            n for n, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad
        }
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
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
        options = self._state_options()
        if "model" in state:
            set_model_state_dict(self.model, state["model"], options=options)
        if "optim" in state:
            with self._resident():  # the optimizer's load replaces its state on the device
                set_optimizer_state_dict(
                    self.model, self.optimizer, state["optim"], options=options
                )
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])


def _text_only(vision: Sequence[VisionInputs | None] | None, backend: str) -> None:
    """Refuse `vision` for a text-only model: whenever it is given, not only when this
    rank's rows hold images, so every rank refuses alike (one rank raising while another
    enters a collective would hang the job)."""
    if vision is not None:
        raise ValueError(f"train.backend={backend}: images given for a text-only model")


class AdaptersOffReference:
    """The KL reference of a LoRA actor with no `model.reference`: the actor's own module
    with its adapters disabled (peft's `disable_adapter`), which is exactly the initial
    policy (the base weights are frozen) without a second copy of the weights.

    It scores through the actor's engine, so the backend's hooks (FSDP2's unit gathers,
    ZeRO-3's parameter gathers) run as for the actor; it never trains.
    """

    role: Role = "reference"
    ema: ParameterEMA | None = None

    def __init__(self, actor: TrainEngine) -> None:
        self.actor = actor
        self.model = actor.model
        self.routers = actor.routers
        self.offload_record = OffloadRecord()  # a reference has no optimizer state to move

    def _off(self) -> contextlib.AbstractContextManager[None]:
        from rftpipe.engines.lora import adapters_disabled

        return adapters_disabled(self.actor.model)

    def train_mode(self) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("train_mode on a reference engine")

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        with self._off(), self.actor.eval_mode():
            yield

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._off():
            return self.actor.forward(prompts, responses, temperature, with_entropy, vision, routes)

    def compute_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        with self._off():
            return self.actor.compute_logprobs(
                prompts, responses, temperature, vision, routes, record
            )

    def moe_aux_loss(self) -> torch.Tensor | None:
        return self.actor.moe_aux_loss()

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        with self._off():
            return self.actor.run_module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("backward on a reference engine")

    def optimizer_step(self) -> float:
        raise RuntimeError("optimizer_step on a reference engine")

    def lr_scheduler_step(self) -> None:
        raise RuntimeError("lr_scheduler_step on a reference engine")

    def current_lr(self) -> float:
        raise RuntimeError("current_lr on a reference engine")

    def rollout_weights(self) -> torch.nn.Module | dict[str, torch.Tensor]:
        raise RuntimeError("rollout_weights on a reference engine")

    def state_dict(self) -> dict:
        raise RuntimeError("state_dict on a reference engine")

    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("load_state_dict on a reference engine")
