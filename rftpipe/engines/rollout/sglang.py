"""SGLang rollout engine (GPU only) behind the `RolloutEngine` protocol.

SGLang is imported inside the constructor, so this module imports on any machine; without
SGLang the constructor raises a `UserError` with the install hint.

What this engine relies on in SGLang's offline `sglang.Engine` (late 2025 / 2026 API; read in
the sgl-project/sglang sources: python/sglang/srt/entrypoints/engine.py,
srt/sampling/sampling_params.py, srt/layers/sampler.py, srt/sampling/sampling_batch_info.py,
srt/managers/schedule_batch.py, srt/managers/scheduler_update_weights_mixin.py,
srt/constants.py, docs/advanced_features/sglang_for_rl.md and deterministic_inference.md):

* Seeds. A request's `sampling_params["sampling_seed"]` is honoured only when the engine runs
  with `enable_deterministic_inference=True` (otherwise the sampler draws from the global
  torch RNG); the sampler then draws each token with Gumbel noise hashed from (seed, token
  position), on batch-invariant kernels, with the `pytorch` sampling backend (the flashinfer
  backend refuses seeds). So this engine always enables deterministic inference and sends
  n separate requests per prompt, each with its own seed from `rftpipe.seeding.sample_seed` (SGLang's `n`
  would give every copy the same seed, hence the same sample). Seeds are cut to 31 bits
  because some SGLang releases keep them in an int32 tensor.
* Logprobs. With `return_logprob=True`, `meta_info["output_token_logprobs"]` holds one
  `(logprob, token_id, text_or_None)` per generated token, EOS included when generated. The
  sampler computes them as log softmax(logits / T) over the whole vocabulary, before top-k
  and top-p (top-p no longer renormalizes them since SGLang PR #5961, May 2025; every release
  with `sampling_seed` is newer), so top-k/top-p need no refusal here.
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1` would instead return log softmax(logits), before the
  temperature; the constructor refuses it when temperature != 1.
* min_new_tokens. SGLang's `min_new_tokens` masks the stop ids (our EOS) as a logit penalty
  applied *before* the sampler computes logprobs, so for the first `min_new_tokens` tokens
  the recorded logprob is of the EOS-masked distribution: log softmax(logits / T) minus
  log(1 - p_eos) (what was actually sampled from), not the unmasked value the HF engine
  records. The constructor logs a warning when `rollout.min_new_tokens > 0`.
* Stopping. A request stops at `stop_token_ids` and also, always, at the model's own EOS ids
  (config.json / generation_config.json) and the tokenizer's; `ignore_eos=True` would
  disable `stop_token_ids` too. So the constructor refuses a model that declares EOS ids
  other than ours, and a sample that stops on any other token raises at run time.
  `meta_info["finish_reason"]` is `{"type": "stop", "matched": id}` or
  `{"type": "length", ...}` ("abort" raises).
* Weights. `update_weights_from_tensor(named_tensors=[(hf_name, tensor), ...],
  flush_cache=...)` loads HF-named full tensors through the model's `load_weights` (stacked
  qkv / gate-up and tied embeddings handled by SGLang); the tensors travel by CUDA IPC, so
  they are copied to this engine's GPU first, one chunk of at most `CHUNK_BYTES` at a time.
  `update_weights_from_disk(model_path)` reloads in place from an HF directory. Both return
  a tuple whose first element is the success flag.
* Sleep. With `enable_memory_saver=True` (needs the `torch_memory_saver` package),
  `release_memory_occupation(tags)` / `resume_memory_occupation(tags)` free and re-map the
  tagged GPU memory ("kv_cache", "weights", "cuda_graph", ...; tags=None means all). Released
  weights come back intact only with `enable_weights_cpu_backup=True` (level 1); otherwise
  their memory returns uninitialized (level 2). Releasing needs an idle engine, which holds
  here because every call waits for its results; resuming a tag that is not released fails,
  so the engine tracks what it released.

* Images. A prompt with images goes in as its token ids, each image's pad token already
  repeated once per image token (as `VisionEncoder` encodes it), with one `image_data`
  item in SGLang's `processor_output` format: the image processor's output for the
  prompt (`pixel_values`, `image_grid_thw`, `input_ids`; docs/advanced_features/
  vlm_query.md, "Call with Processor Output"). SGLang then neither re-runs the image
  processor nor re-expands the pads, so its prompt is ours token for token and its
  pixels the trainer's. A frozen vision tower (`frozen_vision`) is left out of a weight
  sync in memory.

Not verified on a GPU from this repository's machine (SGLang has no CPU wheel): float32 with
the triton attention backend under deterministic inference (chosen for `dtype="float32"`),
and the exact SGLang release range; tests/test_sglang_engine.py checks all of it on a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rftpipe.config.schema import RolloutConfig
from rftpipe.engines.rollout.base import (
    FinishReason,
    GroupOutput,
    SampleOutput,
    Vision,
    split_groups,
)
from rftpipe.engines.vision import VisionInputs, is_vision_tower_name
from rftpipe.errors import UserError
from rftpipe.seeding import sample_seed

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rollout.engine=sglang: SGLang is not installed; pip install sglang (GPU only) "
    "or use rollout.engine=vllm|hf"
)

CHUNK_BYTES = 512 << 20
"""Most bytes of weights copied to the GPU and handed to SGLang in one `update_weights`
message (one tensor larger than this goes alone)."""

_SEED_BITS = 31
_KV_CACHE = "kv_cache"
_WEIGHTS = "weights"


def _sglang_seed(group_seed: int, sample: int) -> int:
    """`sample_seed`, cut to the 31 bits older SGLang releases keep (int32)."""
    return sample_seed(group_seed, sample) & ((1 << _SEED_BITS) - 1)


def model_eos_ids(model_dir: Path) -> set[int]:
    """EOS ids a model directory declares (config.json and generation_config.json)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


def check_stop_tokens(model_dir: Path, eos_id: int) -> None:
    """Refuse a model on which SGLang would stop at ids other than ours (see module doc)."""
    extra = sorted(model_eos_ids(model_dir) - {eos_id})
    if extra:
        raise UserError(
            f"rollout.engine=sglang: {model_dir} declares EOS ids {extra} besides the "
            f"tokenizer's EOS {eos_id} (config.json / generation_config.json); SGLang always "
            "stops at a model's EOS ids, so its samples would end where the hf and vllm "
            f"engines go on; list only {eos_id} there or use rollout.engine=vllm|hf"
        )


def chunk_by_bytes(
    items: Iterable[tuple[str, torch.Tensor]], limit: int, dtype: torch.dtype
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of (name, tensor) of at most `limit` bytes once floating tensors are
    cast to `dtype`; a tensor larger than `limit` is a run of its own."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in items:
        itemsize = dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
        nbytes = tensor.numel() * itemsize
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _raise_unless_ok(result: Any, what: str) -> None:
    """SGLang's weight calls answer (success, message, ...); raise when success is False."""
    ok, message = True, ""
    if isinstance(result, tuple | list) and result and isinstance(result[0], bool):
        ok = result[0]
        message = str(result[1]) if len(result) > 1 else ""
    elif hasattr(result, "success"):
        ok, message = bool(result.success), str(getattr(result, "message", ""))
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def processor_output(prompt: Sequence[int], vision: VisionInputs | None) -> dict | None:
    """The `image_data` item of one prompt (SGLang's `processor_output` format: the image
    processor's output, its ids already expanded), None for a text prompt."""
    if vision is None:
        return None
    vision.check(len(prompt), "sglang prompt")
    n = len(vision.mm_token_type_ids)
    return {
        "format": "processor_output",
        "input_ids": torch.tensor([list(prompt[:n])]),
        "pixel_values": vision.pixel_values,
        "image_grid_thw": vision.image_grid_thw,
    }


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


class SGLangEngine:
    """Rollout engine over an in-process `sglang.Engine` (its scheduler runs in child
    processes on `tensor_parallel_size` GPUs from `base_gpu_id`, default this process's
    current device).

    Samples: each of the n samples of each prompt is its own request with its own seed
    (`sample_seed`), decoded with deterministic inference, so a sample depends only on the
    call's seed, its (group, sample) place and the weights, not on batch or rank. Top-k and
    top-p follow SGLang's pytorch sampler (top-k, then top-p on the unrenormalized mass);
    logprobs are log softmax(logits / T) of the sampled token before both (see the module
    doc for the min_new_tokens caveat).

    Weights: `update_weights(module_or_mapping, v)` loads full HF-named tensors in place,
    in `CHUNK_BYTES` chunks (`rollout.inference.weight_sync=memory`);
    `update_weights(Path, v)` reloads from an HF directory (config.json + safetensors, what
    the trainer's HF export writes), which is the only form `weight_sync=disk` takes.

    Sleep (`rollout.inference.sleep_level`): 0 keeps everything; 1 frees KV cache and
    weights, the weights kept in host memory and restored by `wake`; 2 discards both:
    `wake` maps the weight memory back (uninitialized) and generating refuses until the
    next `update_weights`, after which the KV cache is mapped back too (so the trainer's
    gathered weights and the KV cache are never resident together).
    """

    def __init__(
        self,
        model_dir: Path,
        cfg: RolloutConfig,
        eos_id: int,
        pad_id: int,
        dtype: str,
        seed: int,
        *,
        base_gpu_id: int | None = None,
        frozen_vision: bool = False,
    ) -> None:
        try:
            import sglang
        except ImportError as e:
            raise UserError(INSTALL_HINT) from e
        _check_supported(model_dir, cfg, eos_id)
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype, got {dtype!r}")

        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.dtype = torch_dtype
        self.weight_version = 0
        self.frozen_vision = frozen_vision
        """`train.freeze_vision`: a sync in memory leaves the vision tower's tensors out."""
        gpu = torch.cuda.current_device() if base_gpu_id is None else base_gpu_id
        self.device = torch.device("cuda", gpu)
        self._level = cfg.inference.sleep_level
        self._released: set[str] = set()
        self._needs_weights = False

        kwargs = _engine_kwargs(self.model_dir, cfg, dtype, seed, gpu)
        started = time.perf_counter()
        self._engine: Any = sglang.Engine(**kwargs)
        self._tags = _memory_tags()
        log.debug("sglang engine up in %.1fs", time.perf_counter() - started)

    # -- generation ---------------------------------------------------------------------

    @property
    def groups_per_call(self) -> int:
        """All of a rank's groups at once: every sample carries its own seed."""
        return 1 << 30

    @property
    def collective(self) -> bool:
        """One engine per rank (its own tensor parallelism stays inside SGLang)."""
        return False

    def generate_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seeds: Sequence[int],
        vision: Vision = None,
    ) -> list[GroupOutput]:
        """n samples of each prompt; `vision`: each prompt's images (None: text), sent as
        `processor_output` items (module doc)."""
        self._check_ready()
        if not prompts:
            return []
        cfg = self.cfg
        base = {
            "temperature": cfg.temperature,
            "top_k": cfg.top_k if cfg.top_k > 0 else -1,
            "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens,
            "min_new_tokens": cfg.min_new_tokens,
            "stop_token_ids": [self.eos_id],
            "skip_special_tokens": False,
        }
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        images: list[dict | None] = []
        items = _items(prompts, vision)
        for g, prompt in enumerate(prompts):
            for j in range(n):
                input_ids.append(list(prompt))
                params.append({**base, "sampling_seed": _sglang_seed(seeds[g], j)})
                images.append(items[g])
        rows = [self._parse(out) for out in self._generate(input_ids, params, images)]
        return split_groups([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], n)

    @property
    def continues_turns(self) -> bool:
        return False

    def end_episodes(self, keys: Iterable[Hashable] | None = None) -> None:
        """Nothing kept: SGLang runs no episodes."""

    def generate_rows(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_new: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        vision: Vision = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleOutput]:
        """Multi-turn episodes are not built on SGLang (the config refuses `rollout.env` with
        `rollout.engine=sglang`; this guards any other caller)."""
        raise NotImplementedError(
            "multi-turn episodes (rollout.env) are not built for rollout.engine=sglang; "
            "use rollout.engine=vllm or hf"
        )

    def greedy_rows(
        self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], vision: Vision = None
    ) -> list[SampleOutput]:
        """See `generate_rows`: no multi-turn episodes on SGLang, so none to evaluate."""
        raise NotImplementedError(
            "multi-turn episodes (rollout.env) are not built for rollout.engine=sglang; "
            "use rollout.engine=vllm or hf"
        )

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, vision: Vision = None
    ) -> list[list[int]]:
        """Greedy completions without the EOS (for evaluation, not for training rows);
        `vision` as in `generate_groups`."""
        self._check_ready()
        if not prompts:
            return []
        params = {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": [self.eos_id],
            "skip_special_tokens": False,
        }
        outs = self._generate(
            [list(p) for p in prompts], [dict(params) for _ in prompts], _items(prompts, vision)
        )
        completions = []
        for out in outs:
            tokens = self._parse(out)[0]
            completions.append(
                tokens[: tokens.index(self.eos_id)] if self.eos_id in tokens else tokens
            )
        return completions

    def _generate(
        self,
        input_ids: list[list[int]],
        params: list[dict[str, Any]],
        images: Sequence[dict | None] | None = None,
    ) -> list[dict]:
        extra: dict[str, Any] = {}
        if images is not None and any(im is not None for im in images):
            # One item (all the prompt's images) per request; None for a text request.
            extra["image_data"] = [None if im is None else [im] for im in images]
        outs = self._engine.generate(
            input_ids=input_ids, sampling_params=params, return_logprob=True, **extra
        )
        return [outs] if isinstance(outs, dict) else list(outs)

    def _parse(self, out: dict) -> tuple[list[int], list[float], FinishReason]:
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        tokens = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "length":
            return tokens, logprobs, "length"
        if kind == "stop":
            if not tokens or tokens[-1] != self.eos_id:
                matched = finish.get("matched") if isinstance(finish, dict) else None
                raise RuntimeError(
                    f"SGLang stopped a sample on {matched!r}, not on EOS id {self.eos_id} "
                    "(a model or tokenizer EOS other than ours?); its samples would differ "
                    "from the other engines'"
                )
            return tokens, logprobs, "stop"
        raise RuntimeError(f"SGLang request ended with finish_reason={finish!r}")

    def _check_ready(self) -> None:
        if self._engine is None:
            raise RuntimeError("SGLangEngine is closed")
        if _WEIGHTS in self._released:
            raise RuntimeError("SGLangEngine is asleep: call wake() first")
        if self._needs_weights:
            raise RuntimeError(
                "SGLangEngine woke from sleep level 2, which discarded its weights: call "
                "update_weights() before generating (it would sample from garbage weights)"
            )

    # -- weights ------------------------------------------------------------------------

    def update_weights(
        self,
        weights: torch.nn.Module | Mapping[str, torch.Tensor] | Path | str,
        version: int,
    ) -> None:
        """Load full (unsharded) HF-named weights: a module or name -> tensor mapping in
        place, or a `Path` to an HF directory reloaded from disk; then `weight_version`."""
        if self._engine is None:
            raise RuntimeError("SGLangEngine is closed")
        if _WEIGHTS in self._released:
            raise RuntimeError("SGLangEngine is asleep: call wake() before update_weights()")
        started = time.perf_counter()
        if isinstance(weights, str | os.PathLike):
            self._load_from_disk(Path(weights))
        elif self.cfg.inference.weight_sync == "disk":
            raise TypeError(
                "rollout.inference.weight_sync=disk: pass update_weights the Path of an HF "
                "directory (config.json + *.safetensors), not tensors"
            )
        else:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            if self.frozen_vision:
                # SGLang keeps the tensors it is not given: the tower it loaded at start.
                state = {k: v for k, v in state.items() if not is_vision_tower_name(k)}
            self._load_from_memory(state)
        if _KV_CACHE in self._released:
            self._resume([_KV_CACHE])
        self._needs_weights = False
        self.weight_version = version
        log.debug("sglang weights v%d in %.2fs", version, time.perf_counter() - started)

    def _load_from_memory(self, state: Mapping[str, torch.Tensor]) -> None:
        chunks = list(chunk_by_bytes(state.items(), CHUNK_BYTES, self.dtype))
        if not chunks:
            raise ValueError("update_weights: no tensors given")
        for i, chunk in enumerate(chunks):
            named = [(name, self._to_engine(t)) for name, t in chunk]
            result = self._engine.update_weights_from_tensor(
                named_tensors=named, flush_cache=i == len(chunks) - 1
            )
            del named
            _raise_unless_ok(result, "update_weights_from_tensor")
        # Let go of the IPC references SGLang's processes held on the copies.
        torch.cuda.ipc_collect()

    def _to_engine(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(device=self.device, dtype=self.dtype)
        else:
            tensor = tensor.to(device=self.device)
        return tensor.contiguous()

    def _load_from_disk(self, path: Path) -> None:
        if not (path / "config.json").is_file():
            raise ValueError(
                f"update_weights: {path} is not an HF model directory (no config.json)"
            )
        _raise_unless_ok(
            self._engine.update_weights_from_disk(str(path)), "update_weights_from_disk"
        )

    # -- sleep / wake -------------------------------------------------------------------

    def sleep(self) -> None:
        """Free GPU memory while the trainer runs (`rollout.inference.sleep_level`)."""
        if self._level == 0 or self._engine is None:
            return
        tags = [t for t in self._tags if t not in self._released]
        if not tags:
            return
        started = time.perf_counter()
        self._engine.release_memory_occupation(tags=tags)
        self._released.update(tags)
        log.debug("sglang sleep (level %d) in %.2fs", self._level, time.perf_counter() - started)

    def wake(self) -> None:
        """Map the memory back; at level 2 the weights must then come from `update_weights`."""
        if self._level == 0 or self._engine is None or _WEIGHTS not in self._released:
            return
        started = time.perf_counter()
        if self._level == 1:
            self._resume([t for t in self._tags if t in self._released])
        else:
            # The KV cache waits for the new weights (update_weights maps it back).
            self._resume([t for t in self._tags if t in self._released and t != _KV_CACHE])
            self._needs_weights = True
        log.debug("sglang wake (level %d) in %.2fs", self._level, time.perf_counter() - started)

    def _resume(self, tags: list[str]) -> None:
        if tags:
            self._engine.resume_memory_occupation(tags=tags)
            self._released.difference_update(tags)

    # -- lifetime -----------------------------------------------------------------------

    def take_decode_counts(self) -> None:
        """None: the engine's scheduler batches requests itself, an ended one leaving at once."""
        return None

    def close(self) -> None:
        """Shut the engine and its processes down (idempotent)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _items(prompts: Sequence[Sequence[int]], vision: Vision) -> list[dict | None]:
    """Each prompt's `processor_output` item (all None without `vision`)."""
    if vision is None:
        return [None] * len(prompts)
    if len(vision) != len(prompts):
        raise ValueError(f"vision: {len(vision)} entries for {len(prompts)} prompts")
    return [processor_output(p, v) for p, v in zip(prompts, vision, strict=True)]


def _memory_tags() -> list[str]:
    """Every memory tag SGLang releases for tags=None, in its own order."""
    try:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    except ImportError:
        return [_KV_CACHE, _WEIGHTS]
    return list(GPU_MEMORY_ALL_TYPES)


def _check_supported(model_dir: Path, cfg: RolloutConfig, eos_id: int) -> None:
    """Refuse what this engine cannot serve exactly (module doc): no GPU, an SGLang without
    per-request seeds, sleep without `torch_memory_saver`, logprobs recorded before the
    temperature, and stop ids besides ours; warn of min_new_tokens' masked logprobs."""
    if not torch.cuda.is_available():
        raise UserError(
            "rollout.engine=sglang: no CUDA device; SGLang runs on GPUs only, use "
            "rollout.engine=vllm|hf"
        )
    _check_sampling_seed_support()
    inf = cfg.inference
    if inf.sleep_level > 0 and not _has_module("torch_memory_saver"):
        raise UserError(
            f"rollout.inference.sleep_level={inf.sleep_level} with rollout.engine=sglang "
            "needs torch_memory_saver (pip install torch_memory_saver), or set "
            "rollout.inference.sleep_level=0"
        )
    if cfg.temperature != 1.0 and _env_true("SGLANG_RETURN_ORIGINAL_LOGPROB"):
        raise UserError(
            "rollout.temperature: SGLANG_RETURN_ORIGINAL_LOGPROB is set, which makes "
            "SGLang record logprobs before the temperature; unset it (the rollout "
            "logprobs must be of logits / temperature)"
        )
    check_stop_tokens(model_dir, eos_id)
    if cfg.min_new_tokens > 0:
        log.warning(
            "rollout.min_new_tokens=%d with rollout.engine=sglang: SGLang records the "
            "logprobs of the first %d tokens with EOS masked (log softmax(logits/T) - "
            "log(1 - p_eos)), not the unmasked values the hf engine records",
            cfg.min_new_tokens,
            cfg.min_new_tokens,
        )


def _engine_kwargs(
    model_dir: Path, cfg: RolloutConfig, dtype: str, seed: int, gpu: int
) -> dict[str, Any]:
    """`sglang.Engine`'s arguments: deterministic inference on GPUs from `gpu`, with
    memory saving for `rollout.inference.sleep_level` > 0."""
    inf = cfg.inference
    kwargs: dict[str, Any] = dict(
        model_path=str(model_dir),
        dtype=dtype,
        random_seed=seed & ((1 << _SEED_BITS) - 1),
        tp_size=inf.tensor_parallel_size,
        base_gpu_id=gpu,
        mem_fraction_static=inf.memory_fraction,
        max_running_requests=inf.max_num_seqs,
        # Per-request seeds take effect only in deterministic mode (module doc).
        enable_deterministic_inference=True,
        enable_memory_saver=inf.sleep_level > 0,
        log_level="error",
    )
    if inf.sleep_level == 1:
        kwargs["enable_weights_cpu_backup"] = True
    if dtype == "float32":
        # Of the attention backends deterministic mode allows (fa3, flashinfer, triton),
        # only triton computes in float32.
        kwargs["attention_backend"] = "triton"
    return kwargs


def _check_sampling_seed_support() -> None:
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams

        SamplingParams(sampling_seed=1)
    except (ImportError, TypeError) as e:
        raise UserError(
            "rollout.engine=sglang: this SGLang has no per-request sampling_seed; upgrade "
            "SGLang (a late-2025 release or newer) or use rollout.engine=vllm|hf"
        ) from e


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
