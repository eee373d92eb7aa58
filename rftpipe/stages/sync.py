"""Stage 5, sync: the rollout engine takes the weights just trained and records their version."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rftpipe.config.schema import LoraConfig
from rftpipe.dist import Dist
from rftpipe.engines import lora
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.rollout.vllm import VLLMEngine
from rftpipe.engines.train.base import TrainEngine
from rftpipe.space import writing
from rftpipe.stages import StageName
from rftpipe.stages.base import Rows, Runtime, StageOutput, StepPlan
from rftpipe.storage.agreed import write_then_agree


def run(
    engine: RolloutEngine,
    trainer: TrainEngine,
    version: int,
    dist: Dist,
    via: Path | None,
    lora_cfg: LoraConfig | None = None,
    lora_dir: Path | None = None,
    vision: bool = False,
) -> None:
    """After this, samples from `engine` are drawn from the step-`version` weights.

    Collective under FSDP2 and ZeRO-3 (the full weights are gathered), so every rank calls
    it. With `via` (rollout.inference.weight_sync=disk) rank 0 writes the weights as a
    safetensors directory there and every engine reloads that directory.

    With LoRA (`lora_cfg`) the HF loop that shares the trainer's module samples from it as
    it is (the live adapters); every engine that holds its own copy takes the adapters
    merged into the base weights, under the transformers model's own names; vLLM takes
    only the adapters, saved under `via` (or `lora_dir`) by rank 0, as a LoRA request.
    """
    weights: torch.nn.Module | Mapping[str, torch.Tensor] = trainer.rollout_weights()
    if lora_cfg is not None and isinstance(engine, VLLMEngine):
        # Only what changed: the adapters, as a LoRA request on the base weights vLLM
        # loaded at start (always through a directory: vLLM loads adapters from one).
        parent = via or lora_dir
        assert parent is not None, "vLLM takes LoRA adapters from a directory"
        target = parent / f"lora-v{version}"
        _publish(
            dist, target, lambda tmp: lora.save_adapter(weights, lora_cfg, "", tmp, vision=vision)
        )
        engine.update_adapter(target, version)
        return
    if lora_cfg is not None and weights is not getattr(engine, "model", None):
        weights = lora.merged_weights(weights, lora_cfg)
    if via is None:
        engine.update_weights(weights, version)
        return
    target = via / f"v{version}"
    _publish(dist, target, lambda tmp: write_weights(weights, tmp))
    engine.update_weights(target, version)


def _publish(dist: Dist, target: Path, write: Callable[[Path], None]) -> None:
    """On rank 0, `_replace_with(target, write)`; every rank waits for it, and a full file
    system or a spent quota there is raised on every rank alike (`write_then_agree`)."""
    write_then_agree(dist, functools.partial(_replace_with, target, write), main_only=True)


def _replace_with(target: Path, write: Callable[[Path], None]) -> None:
    """Replace every older version under `target.parent` with `target`, written whole (by
    `write`, into a temporary directory) before it appears under its name (a reader never
    sees half a directory). A full file system or a spent quota stops the run naming
    `target` (`rftpipe.space.writing`)."""
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    # The engines loaded every older version before this step's collective began.
    for old in parent.iterdir():
        shutil.rmtree(old)
    with writing(target):
        tmp = parent / f".{target.name}.tmp"
        tmp.mkdir()
        try:
            write(tmp)
        except BaseException:
            # A full disk or a stop: the half-written version goes (a reader never sees it;
            # the next start writes it again).
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tmp.rename(target)


def write_weights(weights: torch.nn.Module | Mapping[str, torch.Tensor], tmp: Path) -> None:
    """The weights as one safetensors file in `tmp`."""
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    # Every name is written, a tied lm_head too: vLLM's in-place reload puts back the old
    # weights of a layer the directory lacks, and with a tied lm_head (absent when only
    # the first of two names sharing storage was written) that reverted the embedding:
    # samples after the first sync were 0.19 off in logprob (2026-11-28, train.backend
    # single; FSDP2's gathered state holds both names apart). safetensors refuses tensors
    # that share storage, so the second name gets a copy.
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        tensor = tensor.detach().to("cpu")
        tensors[name] = tensor.clone() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "index.json").write_text(json.dumps({"tensors": len(tensors)}))


@dataclass(frozen=True, slots=True)
class SyncStage:
    """5. The rollout engine takes the new weights; the step's rows become its dataset."""

    name: StageName = "sync"
    publish: bool = True
    replay_reads_rows: bool = False
    engine_awake: bool = True

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        sync_weights(rt, plan.step)
        # `step` is the hive key of the dataset's directory: a column of the same name would
        # make pandas and pyarrow refuse to read it.
        return StageOutput(rows=rows().drop_columns(["step"]), extra={"weight_version": plan.step})

    def replay(self, rt: Runtime, plan: StepPlan, rows: Rows, manifest: dict[str, Any]) -> None:
        sync_weights(rt, plan.step)


def sync_weights(rt: Runtime, version: int) -> None:
    """The sync stage's work (also a restart's, for the weights it loaded). With
    `weight_sync=disk` the weights go through RUN/sync, transient: a replay writes it again."""
    # Beside rollout ranks (`rt.handoff`) this engine is the trainers' own HF loop, which
    # takes the weights in memory; the rollout ranks get theirs from the handoff.
    disk = rt.cfg.rollout.inference.weight_sync == "disk" and rt.handoff is None
    via = rt.run.root / "sync" if disk else None
    run(
        rt.rollout_engine,
        rt.train_engine,
        version,
        rt.dist,
        via,
        rt.cfg.model.lora,
        lora_dir=rt.run.root / "sync",
        vision=rt.vision is not None,
    )
    if rt.handoff is not None:
        rt.handoff(rt, version)
