"""Rollout engines, and the registry that `rollout.engine` picks from.

Each entry builds its engine from the run config; the serving engines (vLLM, SGLang) are
optional and import their library only when built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rftpipe.config.schema import RunConfig, episode_limits
from rftpipe.dist import Dist
from rftpipe.engines import models, moe
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.rollout.hf import HFGenerateEngine


def _hf_engine(
    cfg: RunConfig, model_dir: Path, dist: Dist, tokenizer: Any, actor: torch.nn.Module
) -> RolloutEngine:
    # Colocated single-device training shares its module with the rollout engine; a sharded
    # trainer hands full weights to a per-rank rollout copy at every sync, and so does a
    # trainer whose updates run while the engine generates (rollout.overlap).
    rollout_model = (
        actor
        if cfg.train.backend == "single" and not cfg.rollout.overlap
        # transformers declares PreTrainedModel.to as functools.wraps(nn.Module.to), which
        # mypy reads as the unbound function (self first).
        else models.load_causal_lm(model_dir, cfg.model.dtype).to(dist.device)  # type: ignore[arg-type]
    )
    return HFGenerateEngine(
        rollout_model,
        cfg.rollout,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        # Special tokens stay in the text, as in vLLM's detokenizer (skip_special_tokens off).
        decode=functools.partial(tokenizer.decode, skip_special_tokens=False),
        record_routes=moe.replay_mode(cfg, model_dir) == "r3",
    )


def max_model_len(cfg: RunConfig) -> int:
    """The longest sequence a serving engine is sized for: the longest prompt plus a
    response, which in a multi-turn episode is the whole conversation after the prompt
    (`rollout.env.max_total_tokens`, the model's and the environment's tokens)."""
    limits = episode_limits(cfg.rollout)
    return cfg.data.max_prompt_tokens + (
        limits[1] if limits is not None else cfg.rollout.max_new_tokens
    )


def engine_spec(cfg: RunConfig, model_dir: Path, tokenizer: Any) -> Any:
    """The run's `rftpipe.engines.rollout.vllm.EngineSpec` (what a vLLM engine is built from
    besides the rollout config)."""
    from rftpipe.engines.rollout.vllm import EngineSpec

    return EngineSpec(
        model_dir=model_dir,
        dtype=cfg.model.dtype,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        seed=cfg.seed,
        max_model_len=max_model_len(cfg),
        lora_rank=cfg.model.lora.r if cfg.model.lora is not None else None,
        max_images_per_prompt=cfg.data.images.max_per_prompt,
        min_pixels=cfg.data.images.min_pixels,
        max_pixels=cfg.data.images.max_pixels,
        frozen_vision=cfg.train.freeze_vision,
    )


def _vllm_engine(
    cfg: RunConfig, model_dir: Path, dist: Dist, tokenizer: Any, actor: torch.nn.Module
) -> RolloutEngine:
    from rftpipe.engines.rollout.vllm import VLLMEngine

    return VLLMEngine(cfg.rollout, engine_spec(cfg, model_dir, tokenizer), dist)


def _sglang_engine(
    cfg: RunConfig, model_dir: Path, dist: Dist, tokenizer: Any, actor: torch.nn.Module
) -> RolloutEngine:
    from rftpipe.engines.rollout.sglang import SGLangEngine

    return SGLangEngine(
        model_dir,
        cfg.rollout,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        cfg.model.dtype,
        cfg.seed,
        frozen_vision=cfg.train.freeze_vision,
    )


def _vllm_preflight(cfg: RunConfig, model_dir: Path) -> None:
    from rftpipe.engines.rollout.vllm import preflight

    preflight(model_dir, cfg.model.dtype, max_model_len(cfg))


@dataclass(frozen=True, slots=True)
class RolloutEngineEntry:
    build: Callable[..., RolloutEngine]
    """(cfg, model_dir, dist, tokenizer, actor module) -> the engine."""
    preflight: Callable[[RunConfig, Path], None] | None = None
    """Refuses (UserError) what would fail later, before the run directory is written."""


#: Rollout engines by `rollout.engine`; serving engines import their library lazily.
ROLLOUT_ENGINES: dict[str, RolloutEngineEntry] = {
    "hf": RolloutEngineEntry(_hf_engine),
    "vllm": RolloutEngineEntry(_vllm_engine, _vllm_preflight),
    "sglang": RolloutEngineEntry(_sglang_engine),
}
