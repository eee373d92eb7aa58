"""SGLangEngine: CPU checks that need no SGLang, and GPU checks on the tiny model.

The GPU tests skip without CUDA or SGLang; on the GPU machine:
``python3 -m pytest -q -m gpu tests/test_sglang_engine.py``. They share one level-1 engine
(float32, so logprobs can be held to 1e-3 against a transformers forward; bfloat16 would
need about 5e-2) and start a second one for sleep level 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rftpipe.config.schema import InferenceConfig, RolloutConfig
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.errors import UserError

# -- CPU: no SGLang needed ------------------------------------------------------------------


def test_module_imports_without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # any `import sglang` now fails
    import rftpipe.engines.rollout.sglang as mod

    importlib.reload(mod)
    assert mod.SGLangEngine.__name__ == "SGLangEngine"


def test_constructor_without_sglang_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    from rftpipe.engines.rollout.sglang import SGLangEngine

    with pytest.raises(UserError) as err:
        SGLangEngine(tmp_path, RolloutConfig(engine="sglang"), 1, 0, "float32", 0)
    assert str(err.value) == (
        "rollout.engine=sglang: SGLang is not installed; pip install sglang (GPU only) "
        "or use rollout.engine=vllm|hf"
    )


def _seeds(first: int, prompts: list) -> list[int]:
    """One seed per group, as the rollout stage derives them (here: consecutive)."""
    return list(range(first, first + len(prompts)))


def test_sample_seeds_are_per_sample_and_stable() -> None:
    from rftpipe.engines.rollout.sglang import _sglang_seed

    seeds = {_sglang_seed(g, j) for g in range(7, 11) for j in range(8)}
    assert len(seeds) == 32
    assert all(0 <= s < 2**31 for s in seeds)
    assert _sglang_seed(7, 2) == _sglang_seed(7, 2) != _sglang_seed(8, 2)


def test_stop_token_check(tmp_path: Path) -> None:
    from rftpipe.engines.rollout.sglang import check_stop_tokens

    tiny = prepare_tiny()
    check_stop_tokens(tiny, load_tokenizer(tiny).eos_token_id)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    check_stop_tokens(tmp_path / "missing", 5)
    with pytest.raises(UserError, match=r"EOS ids \[9\]"):
        check_stop_tokens(tmp_path, 5)


def test_weight_chunks_are_bounded_and_ordered() -> None:
    from rftpipe.engines.rollout.sglang import chunk_by_bytes

    items = [
        ("a", torch.zeros(10)),  # 20 bytes as bf16
        ("b", torch.zeros(10)),
        ("big", torch.zeros(100)),  # 200 bytes: alone
        ("c", torch.zeros(5, dtype=torch.int64)),  # 40 bytes, not cast
        ("d", torch.zeros(5)),
    ]
    chunks = list(chunk_by_bytes(items, 50, torch.bfloat16))
    assert [[n for n, _ in c] for c in chunks] == [["a", "b"], ["big"], ["c", "d"]]


# -- GPU ------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _need_sglang() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("sglang", reason="SGLang is not installed (GPU only)")


def _cfg(sleep_level: int = 1) -> RolloutConfig:
    return RolloutConfig(
        engine="sglang",
        n=4,
        max_new_tokens=24,
        temperature=0.7,
        inference=InferenceConfig(memory_fraction=0.15, sleep_level=sleep_level),
    )


@contextlib.contextmanager
def _using(engine, **changes) -> Iterator[None]:
    """Run with some rollout settings changed (they are read at each call)."""
    saved = engine.cfg
    engine.cfg = dataclasses.replace(saved, **changes)
    try:
        yield
    finally:
        engine.cfg = saved


@pytest.fixture(scope="module")
def tiny() -> tuple[Path, int, int, list[list[int]]]:
    path = prepare_tiny()
    tok = load_tokenizer(path)
    prompts = [tok.encode(text) for text in ("What is 2 + 3?", "Name a color.", "Hi")]
    return path, tok.eos_token_id, tok.pad_token_id, prompts


@pytest.fixture(scope="module")
def engine(tiny):
    _need_sglang()
    from rftpipe.engines.rollout.sglang import SGLangEngine

    path, eos, pad, _ = tiny
    eng = SGLangEngine(path, _cfg(), eos, pad, "float32", seed=0)
    yield eng
    eng.close()


def _tokens(groups) -> list[list[list[int]]]:
    return [g.tokens for g in groups]


def _perturbed(path: Path, device: str = "cpu") -> torch.nn.Module:
    model = load_causal_lm(path, "float32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.to(device).eval()


def _assert_logprobs_match(model: torch.nn.Module, prompts, groups, temperature: float) -> None:
    """Recorded logprobs equal log softmax(logits / T) of a transformers forward."""
    model = model.cuda().eval()
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for tokens, logprobs in zip(group.tokens, group.logprobs, strict=True):
            assert len(tokens) == len(logprobs) > 0
            ids = torch.tensor([list(prompt) + tokens], device="cuda")
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float()
            start = len(prompt) - 1
            ref = torch.log_softmax(logits[start : start + len(tokens)] / temperature, dim=-1)
            ref = ref.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1)
            worst = max(worst, (ref.cpu() - torch.tensor(logprobs)).abs().max().item())
    assert worst < 1e-3, f"largest logprob difference {worst:.2e}"


@gpu
def test_samples_are_determined_by_seed(engine, tiny) -> None:
    prompts = tiny[3]
    a = engine.generate_groups(prompts, 4, seeds=_seeds(11, prompts))
    b = engine.generate_groups(prompts, 4, seeds=_seeds(11, prompts))
    assert _tokens(a) == _tokens(b)
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert _tokens(engine.generate_groups(prompts, 4, seeds=_seeds(12, prompts))) != _tokens(a)
    # Each sample has its own seed ...
    assert len({tuple(t) for t in a[0].tokens}) > 1
    # ... fixed by its place in the call, not by what else is in the batch.
    assert (
        engine.generate_groups(prompts[:1], 4, seeds=_seeds(11, prompts[:1]))[0].tokens
        == a[0].tokens
    )


@gpu
def test_logprobs_match_transformers_fp32(engine, tiny) -> None:
    path, _, _, prompts = tiny
    model = load_causal_lm(path, "float32")
    groups = engine.generate_groups(prompts, 3, seeds=_seeds(5, prompts))
    _assert_logprobs_match(model, prompts, groups, engine.cfg.temperature)
    # Recorded before top-k/top-p: still the unfiltered distribution.
    with _using(engine, top_k=20, top_p=0.8):
        groups = engine.generate_groups(prompts, 3, seeds=_seeds(5, prompts))
    _assert_logprobs_match(model, prompts, groups, engine.cfg.temperature)


@gpu
def test_finish_reasons(engine, tiny) -> None:
    eos, prompts = tiny[1], tiny[3]
    # The random tiny model gives EOS about 1/259 per token: with 32 x 64 tokens some
    # samples stop and most run to the limit (fixed seed, so this is deterministic).
    with _using(engine, max_new_tokens=64):
        groups = engine.generate_groups(prompts[:2], 16, seeds=_seeds(3, prompts[:2]))
    reasons = [r for g in groups for r in g.finish_reasons]
    assert set(reasons) == {"stop", "length"}
    for g in groups:
        for tokens, reason in zip(g.tokens, g.finish_reasons, strict=True):
            assert eos not in tokens[:-1]
            if reason == "stop":
                assert tokens[-1] == eos
            else:
                assert len(tokens) == 64 and tokens[-1] != eos
    # EOS masked until min_new_tokens: every sample runs to the limit.
    with _using(engine, max_new_tokens=8, min_new_tokens=8):
        groups = engine.generate_groups(prompts, 8, seeds=_seeds(3, prompts))
    assert all(r == "length" for g in groups for r in g.finish_reasons)
    assert all(len(t) == 8 and eos not in t for g in groups for t in g.tokens)
    # Greedy: no EOS in the completions, and the same twice.
    greedy = engine.greedy(prompts, 8)
    assert greedy == engine.greedy(prompts, 8)
    assert all(len(t) <= 8 and eos not in t for t in greedy)


@gpu
def test_update_weights_changes_samples(engine, tiny) -> None:
    path, _, _, prompts = tiny
    before = engine.generate_groups(prompts, 4, seeds=_seeds(3, prompts))
    perturbed = _perturbed(path)  # on the CPU: the engine copies chunks to its GPU
    try:
        engine.update_weights(perturbed.state_dict(), version=1)
        assert engine.weight_version == 1
        after = engine.generate_groups(prompts, 4, seeds=_seeds(3, prompts))
        assert _tokens(after) != _tokens(before)
        _assert_logprobs_match(perturbed, prompts, after, engine.cfg.temperature)
        # weight_sync=disk takes a directory, not tensors.
        with (
            _using(engine, inference=dataclasses.replace(engine.cfg.inference, weight_sync="disk")),
            pytest.raises(TypeError, match="weight_sync=disk"),
        ):
            engine.update_weights(perturbed, version=2)
        # A directory reloads from disk: the original weights, the original samples.
        engine.update_weights(path, version=2)
        assert engine.weight_version == 2
        assert _tokens(engine.generate_groups(prompts, 4, seeds=_seeds(3, prompts))) == _tokens(
            before
        )
    finally:
        engine.update_weights(path, version=0)


@gpu
def test_sleep_wake_level1(engine, tiny) -> None:
    prompts = tiny[3]
    before = engine.generate_groups(prompts, 4, seeds=_seeds(9, prompts))
    free_awake = torch.cuda.mem_get_info(engine.device)[0]
    engine.sleep()
    assert torch.cuda.mem_get_info(engine.device)[0] > free_awake
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate_groups(prompts, 4, seeds=_seeds(9, prompts))
    engine.wake()
    assert _tokens(engine.generate_groups(prompts, 4, seeds=_seeds(9, prompts))) == _tokens(before)


@gpu
def test_sleep_wake_level2_needs_new_weights(tiny) -> None:
    _need_sglang()
    from rftpipe.engines.rollout.sglang import SGLangEngine

    path, eos, pad, prompts = tiny
    with SGLangEngine(path, _cfg(sleep_level=2), eos, pad, "float32", seed=0) as eng:
        before = eng.generate_groups(prompts, 4, seeds=_seeds(9, prompts))
        free_awake = torch.cuda.mem_get_info(eng.device)[0]
        eng.sleep()
        assert torch.cuda.mem_get_info(eng.device)[0] > free_awake
        original = load_causal_lm(path, "float32").cuda()
        with pytest.raises(RuntimeError, match="wake"):
            eng.update_weights(original, version=1)
        eng.wake()
        with pytest.raises(RuntimeError, match="update_weights"):
            eng.generate_groups(prompts, 4, seeds=_seeds(9, prompts))
        with pytest.raises(RuntimeError, match="update_weights"):
            eng.greedy(prompts, 4)
        eng.update_weights(original, version=1)
        assert _tokens(eng.generate_groups(prompts, 4, seeds=_seeds(9, prompts))) == _tokens(before)
