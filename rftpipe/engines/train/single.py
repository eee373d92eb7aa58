"""The single-device backend (`train.backend=single`): the whole model and AdamW on one
device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rftpipe.engines.train.base import _EngineBase, _text_only
from rftpipe.engines.train.forward import grouped_logprobs
from rftpipe.engines.train.vision import build_vision_micro_batch, vision_response_logprobs
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) response logprobs (and entropies) with gradients, prompts computed once per group.

        A vision-language policy's rows (`vision`: each row's prompt's images, None for a
        text row; `vision` None: text rows) take one right-padded forward with the model's
        M-RoPE positions instead (`rftpipe.engines.train.vision`): no prefix sharing there,
        each row's prompt and images are computed once per row. Text rows too, as on the
        sharded backends, whose ranks must all run the tower: its gradients are then zero,
        not absent, in a step without images, and AdamW moves it alike on every backend.

        With `param_dtype=bfloat16` the forward runs under autocast: matmuls in bf16 from
        the fp32 weights, which (and so AdamW's state and the gradients) stay fp32.
        """
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            if self._vlm:
                rows = [None] * len(prompts) if vision is None else list(vision)
                vb = build_vision_micro_batch(self.model, prompts, responses, rows, pad_id=0)
                return vision_response_logprobs(
                    self.model,
                    vb.to(self.device),
                    temperature,
                    with_entropy,
                    self._entropy_grad,
                    self._chunk,
                )
            _text_only(vision, "single")
            return grouped_logprobs(
                self.model,
                prompts,
                responses,
                temperature,
                with_entropy,
                self._entropy_grad,
                self._chunk,
            )

    def run_module(self, **inputs: torch.Tensor) -> torch.Tensor:
        """As the base, under the same autocast as `forward` with `param_dtype=bfloat16`."""
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.cfg.param_dtype == "bfloat16"
        ):
            return super().run_module(**inputs)

    def rollout_weights(self) -> torch.nn.Module:
        return self.model
