"""The HF-format export of the final policy (RUN/export) and of the actor's parameter
average (RUN/export_ema), each done once and published by a directory rename."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from rftpipe.atomic import atomic_write_json, read_json
from rftpipe.config.schema import LoraConfig
from rftpipe.engines import lora, models
from rftpipe.engines.train.ema import ParameterEMA
from rftpipe.space import writing
from rftpipe.stages.base import Runtime

EXPORT_MARKER = "rftpipe_export.json"

WeightsLike = torch.nn.Module | Mapping[str, torch.Tensor]


def export_policies(rt: Runtime) -> None:
    """Export the final policy, and its parameter average with `train.ema_decay`, unless
    already exported at the last step (collective: every rank calls it)."""
    # The trainer's full weights, whatever the rollout engine holds (a serving engine's
    # copy is not a transformers module): the module itself on one device, gathered from
    # the shards otherwise.
    if (lora_cfg := rt.cfg.model.lora) is not None:
        _export_lora(rt, lora_cfg)
        return
    _export_once(rt, rt.run.root / "export", rt.train_engine.rollout_weights)
    if (ema := rt.train_engine.ema) is not None:
        _export_once(rt, rt.run.root / "export_ema", lambda: _ema_weights(rt, ema))


def _export_lora(rt: Runtime, cfg: LoraConfig) -> None:
    """With `model.lora`: the adapters in peft's format (RUN/export, RUN/export_ema for
    their average), and with `export_merged` the policy with them merged in, HF format
    (RUN/export_merged). The base weights are `model.path`'s, which the adapter config
    names."""
    base = str(rt.model_dir)
    vision = rt.vision is not None

    _export_once(
        rt,
        rt.run.root / "export",
        rt.train_engine.rollout_weights,
        write=lambda tmp, state: lora.save_adapter(state, cfg, base, tmp, vision=vision),
    )
    if cfg.export_merged:
        _export_once(
            rt,
            rt.run.root / "export_merged",
            lambda: lora.merged_weights(rt.train_engine.rollout_weights(), cfg),
        )
    if (ema := rt.train_engine.ema) is not None:
        # The average of the trainable parameters: of the adapters alone.
        _export_once(
            rt,
            rt.run.root / "export_ema",
            ema.full_params,
            write=lambda tmp, state: lora.save_adapter(state, cfg, base, tmp, vision=vision),
        )


def _export_once(
    rt: Runtime,
    final: Path,
    weights: Callable[[], WeightsLike],
    write: Callable[[Path, WeightsLike], None] | None = None,
) -> None:
    """`export_final(final, weights())`, unless `final` already holds the last step's;
    `write` (into the export's temporary directory) replaces the HF-format model files."""
    marker = final / EXPORT_MARKER
    # Re-exported when a run is extended past the step its export was taken at. Rank 0
    # decides for all: gathering sharded weights is collective.
    stale = rt.dist.is_main and not (
        marker.exists() and read_json(marker)["step"] == rt.cfg.total_steps
    )
    if rt.dist.any(stale):
        state = weights()
        if rt.dist.is_main:
            export_final(rt, final, state, write)


def _ema_weights(rt: Runtime, ema: ParameterEMA) -> torch.nn.Module | Mapping[str, torch.Tensor]:
    """The averages, gathered on every rank (collective under fsdp2); on rank 0, the one
    that exports, as a fresh policy module holding them (by parameter name, so a tied head
    takes its embedding's average, as it does in training)."""
    params = ema.full_params()
    if not rt.dist.is_main:
        return params
    model = models.load_causal_lm(rt.model_dir, rt.cfg.model.dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def _write_export(
    rt: Runtime, tmp: Path, weights: WeightsLike, write: Callable[[Path, WeightsLike], None] | None
) -> None:
    if write is not None:
        write(tmp, weights)
    else:
        if isinstance(weights, torch.nn.Module):
            model = weights
        else:
            model = models.load_causal_lm(rt.model_dir, rt.cfg.model.dtype)
            model.load_state_dict(weights)
        models.as_causal_lm(model).save_pretrained(tmp)
    rt.tokenizer.save_pretrained(tmp)
    if rt.vision is not None:
        # The image processor as the run used it (data.images' pixel range included), so
        # the export sees images as the policy was trained to.
        rt.vision.image_processor.save_pretrained(tmp)
    atomic_write_json(tmp / EXPORT_MARKER, {"step": rt.cfg.total_steps})


def export_final(
    rt: Runtime,
    final: Path,
    weights: WeightsLike,
    write: Callable[[Path, WeightsLike], None] | None = None,
) -> None:
    """HF-format export of a policy (RUN/export, RUN/export_ema), or what `write` puts in
    the directory instead (LoRA adapters), published by a dir rename."""
    tmp = rt.run.root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(tmp):
            _write_export(rt, tmp, weights, write)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export deletes its own files
        raise
    old = rt.run.root / f".tmp-old-{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
