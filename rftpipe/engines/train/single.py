"""The single-device backend (`train.backend=single`): the whole model and AdamW on one
device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rftpipe.engines.train.base import _EngineBase, _text_only
from rftpipe.engines.train.forward import grouped_logprobs
from rftpipe.engines.train.vision import (
    build_vision_micro_batch,
    hf_model,
    vision_response_logprobs,
    vision_tower,
)
from rftpipe.engines.vision import VisionInputs
from rftpipe.errors import UserError


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
        vision: Sequence[VisionInputs | None] | None = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) response logprobs (and entropies) with gradients, prompts computed once per group.

        A vision-language policy's micro-batch with images (`vision`: each row's prompt's
        images, None for a text row) takes one right-padded forward with the model's M-RoPE
        positions instead (`rftpipe.engines.train.vision`): no prefix sharing of the text
        there, a group's images through the tower once. Its text-only micro-batches keep the
        prefix forest (text rows' positions are the same on all three M-RoPE axes);
        `optimizer_step` gives the tower zero gradients where no micro-batch ran it.

        With `param_dtype=bfloat16` the forward runs under autocast: matmuls in bf16 from
        the fp32 weights, which (and so AdamW's state and the gradients) stay fp32.
        """
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            if self._vlm and vision is not None and any(v is not None for v in vision):
                vb = build_vision_micro_batch(self.model, prompts, responses, vision, pad_id=0)
                return vision_response_logprobs(
                    self.model,
                    vb.to(self.device),
                    temperature,
                    with_entropy,
                    self._entropy_grad,
                    self._chunk,
                )
            if not self._vlm:
                _text_only(vision, "single")
            return grouped_logprobs(
                self.model,
                prompts,
                responses,
                temperature,
                with_entropy,
                self._entropy_grad,
                self._chunk,
                self._row_routes(routes, len(prompts)),
            )

    def optimizer_step(self) -> float:
        if self._vlm:
            # A step whose micro-batches held no image never ran the tower: zero gradients,
            # not none, as on the sharded backends (whose every forward runs it), so AdamW
            # moves the tower alike there and here (its moments decay, its update goes on).
            for p in vision_tower(hf_model(self.model)).parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        return super().optimizer_step()

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """As the base, under the same autocast as `forward` with `param_dtype=bfloat16`."""
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            return super().run_module(**inputs)

    def rollout_weights(self) -> torch.nn.Module:
        return self.model
