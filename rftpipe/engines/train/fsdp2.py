"""The FSDP2 backend (`train.backend=fsdp2`): parameters, gradients and AdamW state
sharded with `fully_shard`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from rftpipe.engines import moe
from rftpipe.engines.models import as_decoder_model
from rftpipe.engines.train.base import _EngineBase, _text_only
from rftpipe.engines.train.ulysses import (
    SPContext,
    gather_list,
    gather_recorded,
    gather_rows,
    install,
    sp_context,
    sp_forward,
)
from rftpipe.engines.train.vision import hf_model, vision_tower
from rftpipe.engines.vision import VisionInputs
from rftpipe.errors import UserError


class FSDP2Engine(_EngineBase):
    """Parameters, gradients and optimizer state sharded with `fully_shard` (gloo/nccl).

    Every decoder layer and the root are sharded. Gradients are *summed* over ranks
    (divide factor 1) because the losses are already normalised by global token counts.
    With `cpu_offload=all` the shards, their gradients and AdamW state live in host memory
    (construct it from a model on the compute device: inputs follow the model).
    Each micro-batch is one forward of the root module (its rows packed end to end, or
    right-padded, by `train.packing`), so every rank issues the same collectives in the
    same order whatever prompts it holds. A vision-language model's vision blocks are
    units too, and its rows (with or without images) take `_vision_forward`: right-padded,
    the tower run on every rank. With `sp_size` > 1 each forward is
    sequence-parallel (`ulysses`, rows right-padded): the ranks of an SP group pass the
    same rows.
    """

    _sp: SPContext | None = None

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
        if self.cfg.sp_size > 1 and self._vlm:
            # Ulysses splits each row's sequence over the group; the tower's patches and
            # the 3-D positions are not split with it yet.
            raise UserError(
                f"train.sp_size: {self.cfg.sp_size} with a vision-language model; "
                "sequence parallelism takes text models only so far (set train.sp_size=1)"
            )
        if self.cfg.sp_size > 1:
            self._sp = sp_context(self.dist, self.cfg.sp_size)
            install(model, self.cfg.sp_size)
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
        # A vision tower's blocks are units of their own (a Qwen2-VL-7B tower is 675M
        # parameters, which the root unit would otherwise gather whole): every forward
        # runs the tower on every rank (`vision.rows_hidden`), so they gather alike.
        blocks = list(vision_tower(hf_model(model)).blocks) if self._vlm else []  # type: ignore[arg-type]
        mesh = self._mesh()
        units = [
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
            for layer in [*blocks, *as_decoder_model(model).get_decoder().layers]
        ]
        units.append(fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload))
        # Each unit reduces its own gradients, so each needs both settings: a plain SUM
        # (gloo has no PREMUL_SUM, and with factor 1 there is nothing to scale anyway).
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    def _mesh(self) -> Any:
        """The ranks to shard over: `dist`'s group when it has one (the training ranks of a
        job whose other ranks only generate, `rftpipe.run.placement`); None: the job's."""
        if self.dist.group is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        device_type = "cuda" if self.device.type == "cuda" else "cpu"
        return DeviceMesh.from_group(self.dist.group, device_type)

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
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._vlm:
            return self._vision_forward(prompts, responses, temperature, with_entropy, vision)
        _text_only(vision, "fsdp2")
        if self._sp is not None:
            return sp_forward(
                self._runner,
                self._sp,
                prompts,
                responses,
                temperature,
                with_entropy,
                self._entropy_grad,
                self.device,
                self._chunk,
                self._row_routes(routes, len(prompts)),
            )
        return self._root_forward(prompts, responses, temperature, with_entropy, routes)

    def compute_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        temperature: float,
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> list[list[float]]:
        if self._sp is None:
            return super().compute_logprobs(prompts, responses, temperature, vision, routes, record)
        _text_only(vision, "fsdp2")  # a vision-language model has no SP context
        # Ranks of an SP group score different rows here (the advantage stage's and the
        # reference's own shares): the group scores all of them together, in micro-batches.
        every_prompt, every_response, mine = gather_rows(self._sp, prompts, responses)
        every_route = None if routes is None else gather_list(self._sp, routes)
        every_record: list[torch.Tensor] | None = None if record is None else []
        out = super().compute_logprobs(
            every_prompt, every_response, temperature, routes=every_route, record=every_record
        )
        if record is not None and every_record is not None:
            record.extend(every_record[mine.start : mine.stop])
        return out[mine.start : mine.stop]

    def _recorded_rows(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        if self._sp is None:
            return super()._recorded_rows(prompts, responses)
        # Each rank of the SP group recorded its slice of the rows: put them together.
        assert self.routers is not None and self.routers.last_slots is not None
        slots, recorded = gather_recorded(self._sp, self.routers.last_slots, self.routers.take())
        return moe.cut_pairs(recorded, slots, prompts, responses)

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on every rank, for the rollout engine's own copy."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Typed for every option; full_state_dict=True gives plain tensors.
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return cast(dict[str, torch.Tensor], full)
