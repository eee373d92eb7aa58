"""The DeepSpeed ZeRO backend (stage 2 or 3) behind the `TrainEngine` interface.

DeepSpeed drives the parts it is good at: partitioned gradients and AdamW state (ZeRO-2),
partitioned parameters gathered per layer (ZeRO-3), bf16 mixed precision and CPU offload.
Everything that defines the update stays ours, so the backends agree: the same AdamW
(torch's fused kernel, decay on matrices only), the same LambdaLR
schedule, pre-clip global norm clipping, and gradients *summed* over ranks because the
losses are normalised by global token counts.

Checkpoints stay inside rftpipe's own durable flow (DCP files with digests, committed by
rename), not DeepSpeed's `save_checkpoint`, whose per-rank files are pickles that only
`torch.load(weights_only=False)` reads and that are tied to the world size that wrote them.
The state is written per parameter as full, unpartitioned fp32 tensors (master weights and
AdamW moments, assembled from the ZeRO partitions), so a checkpoint written
by N ranks loads on any number of ranks and on any ZeRO stage: resharding is DCP's, and no
universal-checkpoint conversion step exists to forget. The price is one full fp32 copy of
the parameter being gathered at a time, moved to host memory as it is gathered.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from rftpipe.config.schema import TrainConfig
from rftpipe.dist import Dist
from rftpipe.engines.train.base import (
    Role,
    _EngineBase,
    _text_only,
    adamw,
    lr_lambda,
)
from rftpipe.engines.train.offload import move_data, move_state
from rftpipe.engines.vision import VisionInputs
from rftpipe.errors import UserError

_MOMENTS = ("exp_avg", "exp_avg_sq")


class _ZeroOptimizer(Protocol):
    """DeepSpeed's ZeRO-2/3 optimizer as used here (it is no `torch.optim.Optimizer`)."""

    optimizer: torch.optim.Optimizer
    """The client AdamW, stepping the flat fp32 partitions."""
    fp32_partitioned_groups_flat: list[torch.Tensor]
    """ZeRO-3: this rank's fp32 partition of each sub-group."""
    single_partition_of_fp32_groups: list[torch.Tensor]
    """ZeRO-2: this rank's fp32 partition of each param group."""
    _hp_optimizer_states_linked: bool
    """ZeRO-2: whether each parameter's mapping holds views of the AdamW moments."""

    def _clear_hp_buffer_references(self) -> None:
        """ZeRO-2: drop the per-parameter views of the fp32 partitions and AdamW moments
        (and the partitions' spent gradients), which would keep their device memory."""

    def _link_all_hp_params(self) -> None:
        """ZeRO-2: map every parameter to its slice of the fp32 partitions again."""

    def get_full_hp_param(
        self, param: torch.nn.Parameter, optim_state_key: str | None = None
    ) -> torch.Tensor: ...

    def set_full_hp_param(
        self, value: torch.Tensor, param: torch.nn.Parameter, optim_state_key: str | None = None
    ) -> None: ...


class _FragmentAddress(Protocol):
    numel: int
    start: int


class _Fragment(Protocol):
    """DeepSpeed's `tensor_fragment`: where a ZeRO-2 parameter's slice on this rank lies."""

    param_group_index: int
    hp_fragment_address: _FragmentAddress
    """In the rank's flat fp32 partition of the param group."""
    lp_fragment_address: _FragmentAddress
    """In the flattened parameter."""


class _ZeroParameter(Protocol):
    """What DeepSpeed sets on each parameter it manages (torch's `Parameter` declares none)."""

    ds_shape: torch.Size
    """ZeRO-3: the full shape of the partitioned parameter."""
    ds_tensor: torch.Tensor
    """ZeRO-3: this rank's partition."""
    _hp_mapping: _Fragment | None
    """ZeRO-2: this rank's slice; None where the rank holds none of it."""


def _zero(p: torch.nn.Parameter) -> _ZeroParameter:
    """`p` through the attributes DeepSpeed set on it at run time."""
    return cast(_ZeroParameter, p)


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise UserError(
            "train.backend=deepspeed: DeepSpeed is not installed; "
            'install it with DS_BUILD_OPS=0 pip install -e ".[deepspeed]" or use train.backend=fsdp2'
        ) from exc
    if not torch.cuda.is_available():
        # On a CPU, DeepSpeed's communication backend JIT-compiles a shared-memory
        # all-reduce op (`deepspeed_shm_comm`: 78 s of C++ the first time on the 2-core
        # machine, a build check in every process after) that only its
        # `inference_all_reduce` calls; training's collectives go through torch.distributed
        # (gloo). DeepSpeed keeps this table for edits like this one.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def ds_config(cfg: TrainConfig, world: int, role: Role) -> dict[str, Any]:
    """The DeepSpeed config for `cfg` (nothing here is left to DeepSpeed's defaults that
    would change the update)."""
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        # Gradients reduce during the backward, in the same order on every rank, into
        # one preallocated buffer (no fragmentation from per-parameter gradients).
        "contiguous_gradients": True,
        "overlap_comm": False,
    }
    if cfg.cpu_offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.cpu_offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if cfg.zero_stage == 3:
        # Every parameter is partitioned, however small. Prefetching the next layer's
        # parameters overlaps their gather with compute on a GPU; a CPU has nothing to
        # overlap it with.
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = 0 if not torch.cuda.is_available() else 5e7
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        # Our train stage decides how many micro-batches a mini-batch has (it varies with
        # token budgets and ranks); step() is the accumulation boundary.
        "managed_gradient_accumulation": role != "actor",
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": cfg.param_dtype == "bfloat16"},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # A torch optimizer runs on the offloaded partition (no compiled DeepSpeedCPUAdam).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine(_EngineBase):
    """Actor or reference under DeepSpeed ZeRO-2/3 (gloo on CPU, nccl on GPU)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        dist: Dist,
        *,
        role: Role = "actor",
        total_updates: int = 0,
    ) -> None:
        self._ds_module = _import_deepspeed()
        self._fresh = True
        """No update has run and no state was loaded: a `state_dict` is only a load target."""
        super().__init__(model, cfg, dist, role=role, total_updates=total_updates)

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        # DeepSpeed expects the module on the rank's device before it partitions it.
        return model.to(self.dist.device)

    def _init_role(self, role: Role, total_updates: int) -> None:
        deepspeed = self._ds_module
        # DeepSpeed reads the local rank from the environment, which a plain (non-torchrun)
        # single-process start does not set.
        os.environ.setdefault("LOCAL_RANK", str(self.dist.local_rank))
        self.role = role
        config = ds_config(self.cfg, self.dist.world, role)
        if role == "reference":
            for p in self.model.parameters():
                p.requires_grad_(False)
            if self.cfg.zero_stage != 3:
                # ZeRO-2 shards only what training has (gradients, AdamW state): a frozen
                # reference is replicated, which stage 0 is.
                config["zero_optimization"] = {"stage": 0}
            self.ds, *_ = deepspeed.initialize(model=self.model, config=config)
            self.ds.eval()
            self.device = self.ds.device
            return
        client = adamw(self.cfg, self.model)
        self.ds, zero, *_ = deepspeed.initialize(model=self.model, optimizer=client, config=config)
        self.optimizer = zero
        self._zero: _ZeroOptimizer = zero
        self.device = self.ds.device
        # DeepSpeed keeps the client optimizer as its inner optimizer (now stepping the flat
        # fp32 partitions) and its param groups as they were, so the schedule drives it.
        self._inner: torch.optim.Optimizer = self._zero.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._inner, lr_lambda(self.cfg, total_updates)
        )

    @property
    def _stage3(self) -> bool:
        return self.cfg.zero_stage == 3

    @property
    def _runner(self) -> torch.nn.Module:
        return self.ds

    def forward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        with_entropy: bool,
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._vlm:
            # Through DeepSpeed's forward, inside whose hooks ZeRO-3 gathers the tower's
            # parameters as every other module's (the tower runs on every rank).
            return self._vision_forward(prompts, responses, temperature, with_entropy, vision)
        _text_only(vision, "deepspeed")
        return self._root_forward(prompts, responses, temperature, with_entropy, routes)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages gradients over data-parallel ranks; the losses are normalised by
        # global counts and need the sum.
        self.ds.backward(loss * self.dist.world)
        self._routes_done()

    def optimizer_step(self) -> float:
        self._require_actor("optimizer_step")
        self.ds.step()
        self._fresh = False
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def current_lr(self) -> float:
        return float(self._inner.param_groups[0]["lr"])

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """Full weights (the compute-dtype copy) on every rank, named as the HF module's
        state dict, for the rollout engine's own copy."""
        module = self.ds.module
        if not self._stage3:
            return {k: v.detach() for k, v in module.state_dict().items()}
        gather = self._ds_module.zero.GatheredParameters(list(module.parameters()))
        with gather:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    # -- checkpoint state ---------------------------------------------------------------

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.ds.module.named_parameters() if p.requires_grad]

    def _full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        return _zero(p).ds_shape if self._stage3 else p.shape

    def state_dict(self) -> dict:
        """Full fp32 master weights and AdamW moments per parameter (world-size and stage
        independent), the AdamW step and the LR schedule.

        A fresh engine's state is only ever the target of a load, so it is allocated
        instead of gathered: no collective, no values that anything reads.
        """
        self._require_actor("state_dict")
        named = self._named()
        if self._fresh:
            shapes = {n: self._full_shape(p) for n, p in named}
            full = {
                k: {n: torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
                for k in ("master", *_MOMENTS)
            }
            step = torch.zeros((), dtype=torch.float32)
        else:
            full = {
                k: {n: self._gather(p, None if k == "master" else k).cpu() for n, p in named}
                for k in ("master", *_MOMENTS)
            }
            step = next(iter(self._inner.state.values()))["step"].detach().to("cpu").float().clone()
        return {
            "model": full.pop("master"),
            "optim": {**full, "step": step},
            "scheduler": self.scheduler.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self._require_actor("load_state_dict")
        with self._resident():
            self._load(state)

    def _load(self, state: dict) -> None:
        named = self._named()
        if "model" in state:
            for n, p in named:
                value = state["model"][n]
                self._scatter(p, None, value)
                self._set_compute_copy(p, value)
        if "optim" in state:
            step = float(state["optim"]["step"])
            for flat in self._flat_partitions():
                # AdamW creates its state at its first step; a load may come before that.
                st = self._inner.state[flat]
                if not st:
                    st["exp_avg"] = torch.zeros_like(flat)
                    st["exp_avg_sq"] = torch.zeros_like(flat)
                    # fused AdamW keeps its step as a float32 tensor on the state's device
                    st["step"] = torch.zeros((), dtype=torch.float32, device=flat.device)
                st["step"].fill_(step)
            for k in _MOMENTS:
                for n, p in named:
                    self._scatter(p, k, state["optim"][k][n])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self._fresh = False

    def _move_optimizer_state(self, to_host: bool) -> int:
        """The fp32 master partitions and the AdamW moments and step that the inner AdamW
        keeps for them. The module's parameters (ZeRO-3: this rank's partitions) and
        DeepSpeed's gradient buffers stay on the device."""
        device = torch.device("cpu") if to_host else self.device
        flats = self._flat_partitions()
        if to_host and not self._stage3:
            self._zero._clear_hp_buffer_references()
        for flat in flats:
            flat.grad = None  # spent by the step; ZeRO makes a new one at the next
        moved = move_state(self._inner.state, device) + move_data(flats, device)
        if not to_host and not self._stage3:
            self._zero._link_all_hp_params()
            # The moments' per-parameter views are linked again at the next step.
            self._zero._hp_optimizer_states_linked = False
        return moved

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The fp32 partitions the inner AdamW steps (its param groups hold them only
        while ZeRO-3 steps a sub-group, so they are listed from the ZeRO optimizer)."""
        if self._stage3:
            return list(self._zero.fp32_partitioned_groups_flat)
        return list(self._zero.single_partition_of_fp32_groups)

    def _fragment(self, p: torch.nn.Parameter, key: str | None) -> tuple[torch.Tensor, int] | None:
        """ZeRO-2: this rank's slice of `p`'s fp32 master (key None) or AdamW state, and
        where it starts in the flattened parameter; None where this rank holds none of it.

        Read from the partition directly: DeepSpeed's own per-parameter optimizer-state
        views are linked lazily and miss parameters of the second param group.
        """
        mapping = _zero(p)._hp_mapping
        if mapping is None:
            return None
        flat = self._zero.single_partition_of_fp32_groups[mapping.param_group_index]
        src = flat if key is None else self._inner.state[flat][key]
        hp = mapping.hp_fragment_address
        return src.narrow(0, hp.start, hp.numel), mapping.lp_fragment_address.start

    def _gather(self, p: torch.nn.Parameter, key: str | None) -> torch.Tensor:
        """The full fp32 tensor (master weights or an AdamW moment) of `p`; collective."""
        if self._stage3:
            return self._zero.get_full_hp_param(p, key)
        buf = torch.zeros(p.numel(), dtype=torch.float32, device=self.device)
        frag = self._fragment(p, key)
        if frag is not None:
            part, start = frag
            buf.narrow(0, start, part.numel()).copy_(part)
        torch.distributed.all_reduce(buf)
        return buf.view(p.shape)

    def _scatter(self, p: torch.nn.Parameter, key: str | None, value: torch.Tensor) -> None:
        """Set this rank's partition of `p`'s master weights or AdamW moment from the full
        tensor `value` (held by every rank); local."""
        if self._stage3:
            self._zero.set_full_hp_param(value.to(self.device), p, key)
            return
        frag = self._fragment(p, key)
        if frag is not None:
            part, start = frag
            part.copy_(value.flatten().narrow(0, start, part.numel()))

    def _set_compute_copy(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """The module's parameter (the bf16 copy in bf16 mode) from its fp32 master."""
        if not self._stage3:
            p.data.copy_(value.to(p.dtype))
            return
        rank = self.dist.rank
        part = _zero(p).ds_tensor
        flat = value.to(part.dtype).flatten()
        start = rank * part.numel()
        n = max(0, min(part.numel(), flat.numel() - start))
        with torch.no_grad():
            part.view(-1)[:n].copy_(flat[start : start + n])
