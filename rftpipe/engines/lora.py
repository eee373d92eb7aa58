"""LoRA adapters through `peft` (`model.lora`): applied to a loaded model before a training
backend wraps it, and the forms the rollout engines and the export take them in.

A LoRA model is a `peft.PeftModel` around the transformers model: its frozen base weights
are named ``base_model.model.<hf name with .base_layer>`` and its adapters
``base_model.model.<hf module>.lora_A.default.weight`` (and ``lora_B``). Only the adapters
require gradients, so every backend's AdamW (built from the trainable parameters) holds
their state alone, and checkpoints (trainable parameters only) hold only them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from rftpipe.config.schema import LoraConfig
from rftpipe.engines.moe import route_shape
from rftpipe.errors import UserError
from rftpipe.seeding import derive_seed

logger = logging.getLogger(__name__)

ADAPTER = "default"
"""peft's name of the one adapter a model has."""
PREFIX = "base_model.model."
"""What `peft.PeftModel` puts before the wrapped model's own parameter names."""


VISION_TOWER = r"(.*\.)?visual(\..*)?"
"""peft's `exclude_modules` pattern (fully matched against a module's dotted name) of a
Qwen2-VL-family vision tower and its merger: `visual` in the conditional-generation model
(``model.visual``) and in the critic's backbone (``visual``) alike."""


def tower_excluded(model: torch.nn.Module, cfg: LoraConfig) -> bool:
    """Whether `model`'s vision tower stays without adapters: it has one and
    `cfg.vision_tower` is off."""
    return not cfg.vision_tower and any(
        re.fullmatch(VISION_TOWER, n) for n, _ in model.named_modules()
    )


DEFAULT_TARGETS = LoraConfig().target_modules


def effective(model: torch.nn.Module, cfg: LoraConfig) -> LoraConfig:
    """`cfg` for `model`: on an MoE model the default targets keep only the names it has.

    An MoE model's experts are fused 3-D parameters (transformers 5.x), with no
    `gate_proj`/`up_proj`/`down_proj` modules, and its router is a parameter too: the
    default adapters go on attention (and on any dense MLP layer among the MoE ones),
    with the router and the experts frozen. Why not adapters on every expert (peft's
    `target_parameters`): they multiply the adapter state by E while a token trains k of
    them, and a frozen router keeps each token's experts those the base model chose, which
    is what routing replay keeps equal between rollout and trainer. Targets the user names
    are checked as given (`check_targets`)."""
    if cfg.target_modules != DEFAULT_TARGETS or route_shape(model) is None:
        return cfg
    names = [n for n, _ in model.named_modules()]
    kept = tuple(t for t in cfg.target_modules if any(n == t or n.endswith(f".{t}") for n in names))
    if kept != cfg.target_modules:
        logger.info("model.lora on an MoE model: adapters on %s (experts and router frozen)", kept)
    return dataclasses.replace(cfg, target_modules=kept)


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Refuse target module names that match no module of `model` that takes adapters (a
    typo would otherwise train nothing of what the user meant, or, when none matches, fail
    deep inside peft)."""
    cfg = effective(model, cfg)
    excluded = tower_excluded(model, cfg)
    names = [
        n for n, _ in model.named_modules() if not (excluded and re.fullmatch(VISION_TOWER, n))
    ]
    missing = [
        t for t in cfg.target_modules if not any(n == t or n.endswith(f".{t}") for n in names)
    ]
    if missing:
        leaves = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if _is_linear(m) and n in names}
        )
        where = "outside its vision tower (model.lora.vision_tower is off) " if excluded else ""
        raise UserError(
            f"model.lora.target_modules: {', '.join(missing)} match no module of the model "
            f"{where}(its linear layers{' there' if excluded else ''} are named "
            f"{', '.join(leaves) or 'nothing'})"
        )


def check_targets_of(model_dir: Path, cfg: LoraConfig) -> None:
    """`check_targets` on the model at `model_dir`, built on the meta device (no weights
    read): a run refuses a bad `model.lora` before it writes anything."""
    from transformers import AutoConfig

    from rftpipe.engines.models import auto_class

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        check_targets(auto_class(model_dir).from_config(config), cfg)


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def _peft_config(cfg: LoraConfig, vision: bool, **extra: Any) -> Any:
    """peft's LoraConfig for `cfg`: the one the model is built with and the one exported.
    `vision`: the model's vision tower gets no adapters (`tower_excluded`)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(cfg.target_modules),
        exclude_modules=VISION_TOWER if vision else None,
        bias="none",
        **extra,
    )


def apply_lora(
    model: torch.nn.Module, cfg: LoraConfig, run_seed: int, role: str
) -> torch.nn.Module:
    """`model` (on the CPU, before any backend wraps it) with LoRA adapters on
    `cfg.target_modules`, its own weights frozen.

    The adapters' initial values (peft draws A, B starts at zero) come from a generator
    seeded by (run seed, `role`), the same on every rank and every restart, and the
    process's global RNG is left as it was.
    """
    from peft import get_peft_model

    cfg = effective(model, cfg)
    check_targets(model, cfg)
    peft_cfg = _peft_config(cfg, tower_excluded(model, cfg))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(run_seed, 0, f"lora/{role}", 0))
        return cast(torch.nn.Module, get_peft_model(cast(Any, model), peft_cfg))


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (as `apply_lora` returns)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model: `model`'s forwards run without the adapters (peft's
    `disable_adapter`), through whatever wraps its layers (FSDP2, DeepSpeed)."""
    with cast(Any, model).disable_adapter():
        yield


def scaling(cfg: LoraConfig) -> float:
    """What an adapter's B @ A is multiplied by (peft's plain LoRA: alpha / r)."""
    return cfg.alpha / cfg.r


def merged_weights(
    weights: torch.nn.Module | Mapping[str, torch.Tensor], cfg: LoraConfig
) -> dict[str, torch.Tensor]:
    """The transformers model's own state dict (its names, adapters merged into their base
    weights: ``W + alpha / r * B @ A``) from a peft model's full state (a module, or its
    gathered state dict as the sharded backends' `rollout_weights` give it): what engines
    that hold their own plain copy of the weights load (SGLang, the HF loop beside a
    sharded trainer). Merged in float32, then cast back to the base weight's dtype."""
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    scale = scaling(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name:
            continue
        key = name.removeprefix(PREFIX)
        if ".base_layer." in key:
            module, leaf = key.split(".base_layer.", 1)
            key = f"{module}.{leaf}"
            if leaf == "weight":
                prefix = name[: name.index(".base_layer.")]
                a = state[f"{prefix}.lora_A.{ADAPTER}.weight"].float()
                b = state[f"{prefix}.lora_B.{ADAPTER}.weight"].float()
                tensor = (tensor.float() + scale * (b @ a)).to(tensor.dtype)
        out[key] = tensor.detach()
    return out


def adapter_weights(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The adapters alone, named as peft's saved adapter files name them
    (``base_model.model.<module>.lora_A.weight``: no adapter name)."""
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    return {
        name.replace(f".{ADAPTER}.", "."): tensor.detach()
        for name, tensor in state.items()
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name
    }


def save_adapter(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
    cfg: LoraConfig,
    base_model: str,
    target: Path,
    *,
    vision: bool = False,
) -> None:
    """Write the adapters to `target` in peft's format (adapter_config.json and
    adapter_model.safetensors), which `peft.PeftModel.from_pretrained` and vLLM's LoRA
    requests load. `vision`: the policy is a vision-language model (its config then
    excludes the tower unless `cfg.vision_tower`, as the adapters were made)."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu").contiguous() for k, v in adapter_weights(weights).items()}
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    if cfg.target_modules == DEFAULT_TARGETS:
        # An MoE model's default adapters are on the names it has (`effective`).
        present = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}
        kept = tuple(t for t in cfg.target_modules if t in present)
        cfg = dataclasses.replace(cfg, target_modules=kept or cfg.target_modules)
    peft_cfg = _peft_config(
        cfg, vision and not cfg.vision_tower, base_model_name_or_path=base_model
    )
    config = peft_cfg.to_dict()
    # Sets are not JSON; peft writes its own config the same way.
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
