"""Everything a step needs, built once per process from the run directory into a
`rftpipe.stages.base.Runtime`."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any, cast

import torch

from rftpipe.algos.kl_controller import KLController, make_kl_controller
from rftpipe.atomic import atomic_write_json, read_json
from rftpipe.checkpoint import writer
from rftpipe.checkpoint.policy import make_schedule
from rftpipe.config.schema import RunConfig
from rftpipe.data.prompts import PromptSet, load_prompts, split_held_out
from rftpipe.data.ptx import PTXExample, data_fingerprint, load_ptx_examples
from rftpipe.dist import Dist
from rftpipe.engines import lora as lora_mod
from rftpipe.engines import models, moe
from rftpipe.engines.rollout import ROLLOUT_ENGINES
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.engines.train.base import AdaptersOffReference, TrainEngine
from rftpipe.engines.train.critic import Critic, critic_train_config, head_seed, load_value_model
from rftpipe.engines.train.forward import train_block_bytes
from rftpipe.engines.train.vision import freeze_vision
from rftpipe.engines.vision import VisionEncoder
from rftpipe.envs.loader import check_environments
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.rewards import check_coverage, resolve_all
from rftpipe.run import handoff
from rftpipe.run.overlap import second_stream
from rftpipe.run.placement import Placement
from rftpipe.run.preemption import NoStop, StopFlag
from rftpipe.stages.base import Runtime
from rftpipe.storage.fresh_start import committed_work
from rftpipe.storage.layout import RUN_LAYOUT_VERSION, RunDir
from rftpipe.storage.stage_store import StageStore

log = logging.getLogger(__name__)


def configure_threads(cfg: RunConfig, dist: Dist) -> None:
    threads = cfg.launch.threads or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", dist.world))
    )
    torch.set_num_threads(threads)


#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

RETAINED_BLOCK_BYTES = 16 * 2**20
"""Blocks below this always come from the retained heap (see `retain_host_memory`)."""


def retain_host_memory(block_bytes: int = RETAINED_BLOCK_BYTES) -> bool:
    """Make glibc malloc keep freed blocks under `block_bytes` (at least
    `RETAINED_BLOCK_BYTES`) for reuse; False where the C library is not glibc or refuses.

    By default glibc serves every block above its mmap threshold (which it raises as large
    blocks are freed, up to 32 MiB) with a fresh mapping and unmaps it on free, so the same
    activation-sized tensors re-fault their pages in at every step. A fixed threshold and a
    huge trim threshold keep those in the heap. Larger blocks stay mapped per use: retained
    without a bound (a micro-batch's full logits, whose size grows with it), their varying
    sizes fragmented the heap, and a train stage's resident set grew with its number of
    micro-batches and over the run (tests/test_stage_memory.py). The worker raises the bound
    to the CPU train step's own recurring blocks once the actor is built
    (`train_block_bytes`). May be called again to change the bound.
    """
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (ValueError, OSError):
        return False
    libc = ctypes.CDLL(None)
    ok = libc.mallopt(_M_MMAP_THRESHOLD, max(RETAINED_BLOCK_BYTES, block_bytes)) == 1
    return ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1


_ALLOCATION_SLACK = 2**20
"""Room over a block's bytes for the padding glibc adds to an aligned request."""


def retain_train_blocks(cfg: RunConfig, engine: TrainEngine, dist: Dist) -> None:
    """On a CPU train device, keep blocks up to the largest parameter's gradient in the heap.

    A train step frees and allocates again blocks larger than `RETAINED_BLOCK_BYTES` at
    every step: parameter-sized gradients (SmolLM2-135M's tied embedding, 113 MB, three
    times) and float32 logits (50 MB, five of them at `tools.bench`'s 256 response
    positions). Mapped per use they were faulted in afresh every step: ~140k page faults,
    +0.25 s on a 1.85 s train stage on 2 cores (issue 31). The gradients recur at exactly
    the same sizes, so the heap reuses their space step after step; blocks below them (a
    chunk of logits, at real hidden sizes) come along. On a GPU those blocks live in device
    memory, and the host's large blocks (checkpoint and weight-sync buffers) stay mapped
    per use.
    """
    if not cfg.launch.retain_host_memory or dist.device.type != "cpu":
        return
    if not retain_host_memory(train_block_bytes(engine.model) + _ALLOCATION_SLACK):
        log.info("launch.retain_host_memory: the allocator kept its 16 MiB bound")


def check_fingerprints(
    run: RunDir, model_fp: str, data_fp: str, allow_mismatch: bool, dist: Dist
) -> bool:
    """Refuse a resume whose model or data changed since the run's first start; returns
    whether run.json is to be written anew: at the first start, or when an earlier start
    recorded other fingerprints but committed nothing (it was killed, or refused later):
    nothing was computed from its model or data, so this start's are the run's."""
    if not run.run_json.exists():
        return True
    info = read_json(run.run_json)
    if info.get("schema_version") != RUN_LAYOUT_VERSION:
        raise UserError(
            f"run_dir: {run.root} was written with run layout {info.get('schema_version')}, "
            f"this rftpipe writes layout {RUN_LAYOUT_VERSION}; resume it with the rftpipe "
            "that created it, or start a new run directory"
        )
    changed = [
        key
        for key, new in (("model_fingerprint", model_fp), ("data_fingerprint", data_fp))
        if info.get(key) not in (None, new)
    ]
    if changed and committed_work(run) is None:
        log.warning(
            "run.json: an earlier start that committed nothing recorded another %s; "
            "recording this start's",
            " and ".join(changed),
        )
        if dist.is_main:
            events().write("fingerprints_replaced", keys=changed)
        return True
    for key in changed:
        if not allow_mismatch:
            new = model_fp if key == "model_fingerprint" else data_fp
            raise UserError(
                f"resume: the {key.split('_')[0]} differs from the one this run started with "
                f"({info[key][:12]} != {new[:12]}); pass --allow-fingerprint-mismatch to "
                "resume anyway"
            )
        log.warning("resuming despite a changed %s (explicitly allowed)", key)
    if dist.is_main and allow_mismatch:
        atomic_write_json(
            run.run_json, {**info, "model_fingerprint": model_fp, "data_fingerprint": data_fp}
        )
    return False


def check_round_size(cfg: RunConfig, num_prompts: int) -> None:
    """A step's (or a generation round's) prompts must be distinct: a group is keyed by its
    prompt id, so a window longer than the training set would hold a prompt twice."""
    ds = cfg.rollout.dynamic_sampling
    size = ds.round_size(cfg.data.prompts_per_step)
    if size <= num_prompts:
        return
    field = (
        "rollout.dynamic_sampling.prompts_per_round"
        if ds.enabled and ds.prompts_per_round
        else "data.prompts_per_step"
    )
    raise UserError(
        f"{field}={size} exceeds the {num_prompts} training prompts (after the held-out "
        "split): a step would hold a prompt twice"
    )


def build(
    cfg: RunConfig,
    run: RunDir,
    dist: Dist,
    allow_mismatch: bool = False,
    stop: StopFlag | NoStop | None = None,
    placement: Placement | None = None,
) -> Runtime:
    """This rank's runtime; with `placement`, its role's (`dist` is then the role's)."""
    place = placement or Placement("both", dist, dist)
    configure_threads(cfg, dist)
    if cfg.launch.retain_host_memory and not retain_host_memory():
        log.info("launch.retain_host_memory: not glibc, the allocator is left as it is")
    model_dir = models.resolve_policy_path(cfg.model)
    tokenizer = models.load_tokenizer(model_dir)
    ref_dir = _reference_dir(cfg, tokenizer)
    vision = load_vision(cfg, model_dir)
    prompts, held_out = split_held_out(
        cfg.data, cfg.eval, load_prompts(cfg.data, tokenizer, vision), tokenizer
    )
    check_coverage(cfg.reward, prompts.data_sources())
    check_round_size(cfg, len(prompts))
    # Before any model loads, so a bad PTX file fails in seconds.
    ptx = _load_ptx(cfg, tokenizer)
    rewards = resolve_all(cfg.reward, prompts.scorer, cfg.rollout.max_new_tokens, dist.device)
    _check_before_models(cfg, model_dir, prompts, held_out)
    _record_fingerprints(run, model_dir, ref_dir, prompts, ptx, allow_mismatch, place.job)
    common: dict[str, Any] = {
        "cfg": cfg,
        "run": run,
        "store": StageStore(run),
        "dist": dist,
        "tokenizer": tokenizer,
        "prompts": prompts,
        "held_out": held_out,
        "rewards": rewards,
        "kl_ctrl": new_kl_controller(cfg),
        "model_dir": model_dir,
        "stop": stop or NoStop(),
        "ckpt_schedule": make_schedule(cfg.checkpoint, run.events_path),
        "vision": vision,
        "replay": moe.replay_mode(cfg, model_dir),
        "route_shape": moe.dir_route_shape(model_dir),
    }
    if place.role == "rollout":
        # Generation only: no actor, reference, critic or checkpoints on these ranks.
        return Runtime(**common, **_generator_fields(cfg, model_dir, dist, tokenizer))
    return Runtime(
        **common, **_trainer_fields(cfg, dist, place, model_dir, ref_dir, tokenizer, ptx)
    )


def _reference_dir(cfg: RunConfig, tokenizer: Any) -> Path | None:
    """`model.reference`'s directory, its vocabulary checked against the policy's
    `tokenizer` (None without one: the reference, if any, is the initial policy)."""
    # The config refuses model.reference without a KL term, so a set one is always used.
    if cfg.model.reference is None:
        return None
    ref_dir = models.resolve_model_path(cfg.model.reference, "model.reference")
    models.check_reference_vocab(tokenizer, ref_dir)
    return ref_dir


def _load_ptx(cfg: RunConfig, tokenizer: Any) -> tuple[PTXExample, ...]:
    """`train.ptx`'s examples (none without its term)."""
    if not cfg.train.ptx.coef:
        return ()
    return tuple(load_ptx_examples(cfg.train.ptx, tokenizer, cfg.data.system_prompt))


def _check_before_models(
    cfg: RunConfig, model_dir: Path, prompts: PromptSet, held_out: PromptSet | None
) -> None:
    """What can fail before any model loads: the rollout engine's preflight, the
    environments the rows name, and `model.lora`'s target modules."""
    if (preflight := ROLLOUT_ENGINES[cfg.rollout.engine].preflight) is not None:
        preflight(cfg, model_dir)
    moe.replay_mode(cfg, model_dir)  # refuses a replay the policy or engine cannot run
    if cfg.rollout.env is not None:
        # One environment of the run's and of each other a row's `env_class` names, built
        # and closed here: a path that does not import, a class without step, kwargs it
        # does not take or an unknown `env_class` fail before any model loads.
        rows = [*prompts.prompts, *(held_out.prompts if held_out is not None else [])]
        check_environments(
            cfg.rollout.env, [(p.where or f"prompt_id {p.prompt_id}", p.metadata) for p in rows]
        )
    if cfg.model.lora is not None:
        lora_mod.check_targets_of(model_dir, cfg.model.lora)


def _record_fingerprints(
    run: RunDir,
    model_dir: Path,
    ref_dir: Path | None,
    prompts: PromptSet,
    ptx: tuple[PTXExample, ...],
    allow_mismatch: bool,
    job: Dist,
) -> None:
    """The model's and data's fingerprints checked against run.json's
    (`check_fingerprints`), and run.json written anew (by the job's rank 0) when that
    says so."""
    model_fp = models.model_fingerprint(model_dir, ref_dir)
    anew = check_fingerprints(run, model_fp, data_fingerprint(prompts, ptx), allow_mismatch, job)
    if job.is_main and anew:
        atomic_write_json(
            run.run_json,
            {
                "schema_version": RUN_LAYOUT_VERSION,
                "model_fingerprint": model_fp,
                "data_fingerprint": data_fingerprint(prompts, ptx),
                "num_prompts": len(prompts),
            },
        )


def _generator_fields(
    cfg: RunConfig, model_dir: Path, dist: Dist, tokenizer: Any
) -> dict[str, Any]:
    """The `Runtime` fields of a rank that only generates: its engine and checkpoint
    writer, and no actor or reference."""
    return {
        "trainer": None,
        "reference": None,
        "rollout_engine": build_generator(cfg, model_dir, dist, tokenizer),
        "ckpt_writer": writer.Writer(dist, cfg.checkpoint.direct_io),
    }


def _trainer_fields(
    cfg: RunConfig,
    dist: Dist,
    place: Placement,
    model_dir: Path,
    ref_dir: Path | None,
    tokenizer: Any,
    ptx: tuple[PTXExample, ...],
) -> dict[str, Any]:
    """The `Runtime` fields of a training rank: the actor, the engine it generates (or
    only evaluates) with, the reference, the critic and the checkpoint writer."""
    # Beside rollout ranks the trainers' own engine only evaluates: the HF loop, which
    # shares the actor's module where it can, rather than a second serving engine.
    name = "hf" if place.role == "train" else None
    engine, rollout = build_actor(cfg, model_dir, dist, tokenizer, engine_name=name)
    retain_train_blocks(cfg, engine, dist)
    reference = build_reference(cfg, engine, ref_dir or model_dir, dist)
    return {
        "trainer": engine,
        "reference": reference,
        "rollout_engine": rollout,
        "ckpt_writer": writer.Writer(dist, cfg.checkpoint.direct_io, place.checkpoint_group),
        "critic": build_critic(cfg, model_dir, dist),
        "ptx": ptx,
        "generation_dist": second_stream(dist) if cfg.rollout.overlap else None,
        "handoff": handoff.publish if place.role == "train" else None,
    }


def build_generator(cfg: RunConfig, model_dir: Path, dist: Dist, tokenizer: Any) -> RolloutEngine:
    """The engine of a rank that only generates, at the initial weights; the HF loop gets
    a model of its own (there is no actor to share)."""
    own = None
    if cfg.rollout.engine == "hf":
        # transformers declares PreTrainedModel.to as functools.wraps(nn.Module.to), which
        # mypy reads as the unbound function (self first).
        own = models.load_causal_lm(model_dir, cfg.model.dtype).to(dist.device)  # type: ignore[arg-type]
    return ROLLOUT_ENGINES[cfg.rollout.engine].build(cfg, model_dir, dist, tokenizer, own)


def load_vision(cfg: RunConfig, model_dir: Path) -> VisionEncoder | None:
    """The policy's image encoding (None: a text-only model, whose data must hold no
    images, which loading the prompts checks)."""
    if not models.is_vision_model(model_dir):
        if cfg.train.freeze_vision:
            raise UserError(
                f"train.freeze_vision: model.path '{cfg.model.path}' has no vision tower"
            )
        return None
    if cfg.rollout.overlap:
        raise UserError(
            f"rollout.overlap with the vision-language model {cfg.model.path} is not built "
            "yet (its image encoding would be shared by both threads); set it false"
        )
    if cfg.launch.rollout_ranks or cfg.launch.rollout_nodes:
        raise UserError(
            f"launch.rollout_ranks/rollout_nodes with the vision-language model "
            f"{cfg.model.path}: separate rollout ranks take text models only so far"
        )
    images = cfg.data.images
    return VisionEncoder.load(model_dir, min_pixels=images.min_pixels, max_pixels=images.max_pixels)


def build_reference(
    cfg: RunConfig, actor: TrainEngine, ref_dir: Path, dist: Dist
) -> TrainEngine | None:
    """The KL term's frozen reference (None without one): `model.reference`'s weights, else
    the policy's initial ones; with LoRA and no `model.reference`, the actor's own module
    with its adapters disabled (the base weights never change, so no second copy)."""
    if cfg.kl.mode == "none":
        return None
    if cfg.model.lora is not None and cfg.model.reference is None:
        return AdaptersOffReference(actor)
    return TRAIN_ENGINES[cfg.train.backend](
        load_for_engine(cfg, ref_dir, dist, lora=False), cfg.train, dist, role="reference"
    )


def build_critic(cfg: RunConfig, model_dir: Path, dist: Dist) -> Critic | None:
    """The value model at its initial weights (backbone from `critic.model.path`, else the
    actor's `model_dir`; head from the run seed), trained by an engine of the actor's backend."""
    if cfg.critic is None:
        return None
    path = models.resolve_model_path(cfg.critic.model.path) if cfg.critic.model.path else model_dir
    seed = head_seed(cfg.seed)
    value_model = load_value_model(path, cfg.model.dtype, seed)
    if cfg.model.lora is not None:
        # Its own adapters on the backbone; the value head (new, so nothing to adapt) trains
        # whole. A PeftModel forwards every attribute of the model it wraps, hence the Any.
        backbone = lora_mod.apply_lora(value_model.model, cfg.model.lora, cfg.seed, "critic")
        value_model.model = cast(Any, backbone)
    model = place_for_engine(value_model, cfg.train.backend, dist)
    train_cfg = critic_train_config(cfg.train, cfg.critic)
    updates = cfg.total_steps * cfg.train.ppo_epochs * cfg.train.mini_batches
    engine = TRAIN_ENGINES[cfg.train.backend](
        model, train_cfg, dist, role="actor", total_updates=updates
    )
    return Critic(engine=engine, cfg=cfg.critic, train_cfg=train_cfg, dist=dist)


def build_actor(
    cfg: RunConfig,
    model_dir: Path,
    dist: Dist,
    tokenizer: Any,
    rollout: RolloutEngine | None = None,
    engine_name: str | None = None,
) -> tuple[TrainEngine, RolloutEngine]:
    """The actor at its initial weights, and the rollout engine that samples from it
    (`engine_name`, default `rollout.engine`).

    A serving engine given as `rollout` is kept (it is expensive to start and takes its
    weights at the next sync); the HF loop is rebuilt, since it may share the actor's module.
    """
    model = load_for_engine(cfg, model_dir, dist)
    updates = cfg.total_steps * cfg.train.ppo_epochs * cfg.train.mini_batches
    engine = TRAIN_ENGINES[cfg.train.backend](
        model, cfg.train, dist, role="actor", total_updates=updates
    )
    if isinstance(rollout, HFGenerateEngine):
        engine_name = "hf"
    if rollout is None or engine_name == "hf":
        name = engine_name or cfg.rollout.engine
        rollout = ROLLOUT_ENGINES[name].build(cfg, model_dir, dist, tokenizer, model)
    return engine, rollout


def load_for_engine(
    cfg: RunConfig, model_dir: Path, dist: Dist, *, lora: bool = True
) -> torch.nn.Module:
    """The initial weights, with `model.lora`'s adapters (unless `lora` is False: a
    separate reference model), placed for `cfg.train.backend` (`place_for_engine`)."""
    model: torch.nn.Module = models.load_causal_lm(model_dir, cfg.model.dtype)
    if cfg.train.freeze_vision:
        # Before any engine builds its optimizer from the trainable parameters.
        freeze_vision(model)
    if lora and cfg.model.lora is not None:
        # On the CPU, before any backend wraps or shards it: every backend and rank then
        # starts from the same adapters.
        model = lora_mod.apply_lora(model, cfg.model.lora, cfg.seed, "actor")
    return place_for_engine(model, cfg.train.backend, dist)


def place_for_engine(model: torch.nn.Module, backend: str, dist: Dist) -> torch.nn.Module:
    """A CPU-loaded model where the training backend `backend` takes it.

    `single` trains the module where it finds it, so it goes to this rank's device here.
    Sharded backends get it on the CPU and place it themselves (FSDP2's `fully_shard` moves
    one unit at a time to the process group's device and shards it; DeepSpeed does its
    own), so the whole model never has to fit on one device at once.
    """
    return model.to(dist.device) if backend == "single" else model


def new_kl_controller(cfg: RunConfig) -> KLController:
    return make_kl_controller(cfg.kl.controller, init_coef=cfg.kl.coef)


def rebuild_actor(rt: Runtime) -> None:
    """Back to the initial actor, critic, optimizers, schedulers and KL controller (after a failed
    checkpoint load left them partly overwritten)."""
    rt.train_engine, rt.rollout_engine = build_actor(
        rt.cfg, rt.model_dir, rt.dist, rt.tokenizer, rt.rollout_engine
    )
    if isinstance(rt.reference, AdaptersOffReference):
        rt.reference = AdaptersOffReference(rt.train_engine)
    rt.kl_ctrl = new_kl_controller(rt.cfg)
    rt.critic = build_critic(rt.cfg, rt.model_dir, rt.dist)
    rt.ckpt_schedule = make_schedule(rt.cfg.checkpoint, rt.run.events_path)
