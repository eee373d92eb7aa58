"""Ended rows leave the HF loop's decode batch (`rollout.compact_decode`,
rftpipe/engines/rollout/decode_batch.py).

Each rollout path runs on one engine three ways: the static batch (`decode_batch.STATIC`,
every row fed until the call's last row ends, each row drawing from its own generator), each
ended row leaving at once (`EVERY`, the most cache selections), and the default rule
(`AUTO`). The samples must be the static batch's: the same tokens and finish reasons, and
logprobs within `BATCH_BOUND`. They are not bitwise the same on CI's CPU: its matmul kernels
round a batch of M rows differently for different M (the largest difference seen on the
perturbed tiny model was 1.4e-6, on AVX2 and on ATen's scalar kernels alike; on
SmolLM2-135M 1.3e-5, 2026-12-02), and the test records which held (`bitwise`). Where rows
keep a KV cache between turns, the cache a call leaves behind is bitwise the static batch's:
rows that left are put back by exact copies.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TESTS_ON_PATH, kill_mid_turn_and_resume, save_perturbed_tiny, submit

from rftpipe.config.schema import RolloutConfig
from rftpipe.engines import models
from rftpipe.engines.models import load_causal_lm, load_tokenizer
from rftpipe.engines.rollout import decode_batch
from rftpipe.engines.rollout.base import SampleOutput
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.vision import EncodedPrompt, VisionEncoder

BATCH_BOUND = 1e-5
"""|logprob with rows leaving - the static batch's|, float32 (docs/engines.md)."""

RULES = {"every": decode_batch.EVERY, "auto": decode_batch.AUTO}
# Sixteen byte tokens end a response besides EOS, so rows of one call end at many lengths
# (the perturbed tiny model almost never samples its EOS).
ENDS = tuple(range(16))
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [70, 71], [90, 91, 92, 93]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Any]:
    path = save_perturbed_tiny(tmp_path_factory.mktemp("perturbed"))
    return load_causal_lm(path, "float32").eval(), load_tokenizer(path)


def _engine(model: torch.nn.Module, tok: Any, cfg: RolloutConfig, **kw: Any) -> HFGenerateEngine:
    decode = functools.partial(tok.decode, skip_special_tokens=False)
    return HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id, decode=decode, **kw)


def _three_ways(
    engine: HFGenerateEngine, run: Callable[[], list[SampleOutput]]
) -> tuple[list[SampleOutput], dict[str, list[SampleOutput]]]:
    """`run` under the static batch, then under each rule; asserts rows left under them."""
    engine.compaction = decode_batch.STATIC
    static = run()
    counts = engine.take_decode_counts()
    assert counts.forwards > 0 and counts.row_steps == counts.static_row_steps
    out = {}
    for name, rule in RULES.items():
        engine.compaction = rule
        out[name] = run()
        got = engine.take_decode_counts()
        assert got.forwards == counts.forwards and got.static_row_steps == counts.static_row_steps
        assert got.row_steps < counts.row_steps, (name, got)  # rows left the batch
    return static, out


def _assert_within_bound(
    static: Sequence[SampleOutput], other: Sequence[SampleOutput], record: Any
) -> None:
    lengths = {len(s.tokens) for s in static}
    assert len(lengths) > 2, lengths  # rows ended at several lengths
    worst = 0.0
    for a, b in zip(static, other, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert (a.routes is None) == (b.routes is None)
        if a.routes is not None:
            assert torch.equal(a.routes, b.routes)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            worst = max(worst, abs(x - y))
    assert worst <= BATCH_BOUND, worst
    record("bitwise", [s.logprobs for s in static] == [s.logprobs for s in other])
    record("worst_logprob_difference", worst)


def _groups(engine: HFGenerateEngine, n: int, prompts: list[list[int]]) -> list[SampleOutput]:
    groups = engine.generate_groups(prompts, n, [11 + g for g in range(len(prompts))])
    return [
        SampleOutput(
            tokens=t, logprobs=lp, finish_reason=r, routes=None if g.routes is None else g.routes[k]
        )
        for g in groups
        for k, (t, lp, r) in enumerate(zip(g.tokens, g.logprobs, g.finish_reasons, strict=True))
    ]


@pytest.mark.kernels
@pytest.mark.parametrize(
    "how",
    [
        pytest.param(RolloutConfig(n=8, max_new_tokens=16, eos_token_ids=ENDS), id="sampled"),
        pytest.param(
            RolloutConfig(
                n=8,
                max_new_tokens=16,
                top_k=20,
                top_p=0.9,
                min_new_tokens=2,
                stop=tuple("abcdefghijkl"),
            ),
            id="stop_strings",
        ),
        pytest.param(RolloutConfig(n=1, max_new_tokens=16, eos_token_ids=ENDS), id="greedy"),
    ],
)
def test_rows_that_ended_leave_and_the_samples_stay_the_static_batchs(
    tiny: tuple[torch.nn.Module, Any], how: RolloutConfig, record_property: Any
) -> None:
    model, tok = tiny
    engine = _engine(model, tok, how)
    if how.n == 1:  # greedy: evaluation's episodes and greedy baselines

        def run() -> list[SampleOutput]:
            prompts = [p for p in PROMPTS for _ in range(3)]
            return engine.greedy_rows(prompts, [16, 9, 4] * len(PROMPTS))

    else:
        run = functools.partial(_groups, engine, how.n, PROMPTS)
    static, other = _three_ways(engine, run)
    for name, got in other.items():
        _assert_within_bound(static, got, lambda k, v, n=name: record_property(f"{n}_{k}", v))


def test_a_sample_draws_alike_whichever_rows_share_its_batch(
    tiny: tuple[torch.nn.Module, Any],
) -> None:
    """A group alone and beside another group of the same prompt length (no other padding):
    the same samples, its draws being its own (`sample_seed` of its group's seed)."""
    model, tok = tiny
    cfg = RolloutConfig(n=4, max_new_tokens=12, eos_token_ids=ENDS)
    engine = _engine(model, tok, cfg)
    alone = engine.generate_groups([PROMPTS[1]], 4, [21])[0]
    beside = engine.generate_groups([PROMPTS[1], [50, 51, 52]], 4, [21, 22])[0]
    assert alone.tokens == beside.tokens and alone.finish_reasons == beside.finish_reasons
    for a, b in zip(alone.logprobs, beside.logprobs, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= BATCH_BOUND
    # compact_decode=off: one generator per call, by row position, so the second group's
    # draws move the first's.
    off = _engine(
        model, tok, RolloutConfig(n=4, max_new_tokens=12, eos_token_ids=ENDS, compact_decode="off")
    )
    assert off.compaction is None
    a = off.generate_groups([PROMPTS[1]], 4, [21])[0]
    b = off.generate_groups([[50, 51, 52], PROMPTS[1]], 4, [22, 21])[1]
    assert a.tokens != b.tokens
    counts = off.take_decode_counts()  # off never compacts
    assert counts.row_steps == counts.static_row_steps > 0


def _session_state(engine: HFGenerateEngine) -> list[tuple[Any, ...]]:
    """Every kept session's rows: keys, mask, next positions, tokens and each layer's K/V."""
    out = []
    for sess in {id(s): s for s in engine._sessions.values()}.values():
        layers = [(x.keys.clone(), x.values.clone()) for x in sess.cache.layers]
        out.append((list(sess.keys), sess.mask.clone(), sess.next_pos.clone(), sess.tokens, layers))
    return out


def _same_state(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
        assert x[3] == y[3]
        for (k1, v1), (k2, v2) in zip(x[4], y[4], strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _turns(engine: HFGenerateEngine, prompts: list[list[int]], kill: set[int]) -> Any:
    """Three turns of `generate_rows` on kept caches, rows `kill` ending after turn 1; each
    turn appends the row's sample and two environment tokens. Returns (the samples of
    each turn, the kept caches after each turn)."""
    keys = list(range(len(prompts)))
    convo = [list(p) for p in prompts]
    samples, states = [], []
    for turn in range(3):
        seeds = [100 * turn + k for k in keys]
        got = engine.generate_rows([convo[k] for k in keys], seeds, [8] * len(keys), keys=keys)
        samples.append(got)
        states.append(_session_state(engine))
        for k, s in zip(keys, got, strict=True):
            convo[k] += [*s.tokens, 30 + turn, 31 + turn]
        if turn == 0:
            engine.end_episodes(kill)
            keys = [k for k in keys if k not in kill]
    engine.end_episodes()
    return samples, states


def test_kept_session_caches_are_put_back_bitwise(tiny: tuple[torch.nn.Module, Any]) -> None:
    """Multi-turn episodes and agents keep each row's KV cache between turns: rows that
    left a turn's decode batch are put back, and every kept cache is bitwise the static
    batch's after each turn (prefilled positions only), episodes ending between turns too."""
    model, tok = tiny
    cfg = RolloutConfig(n=1, max_new_tokens=8, eos_token_ids=ENDS)
    prompts = [p for p in PROMPTS for _ in range(2)]
    engine = _engine(model, tok, cfg)
    assert engine.continues_turns
    engine.compaction = decode_batch.STATIC
    want, want_states = _turns(engine, prompts, {1, 4})
    static = engine.take_decode_counts()
    for rule in RULES.values():
        engine.compaction = rule
        got, states = _turns(engine, prompts, {1, 4})
        assert engine.take_decode_counts().row_steps < static.row_steps
        for a, b in zip(want_states, states, strict=True):
            _same_state(a, b)
        for a, b in zip(want, got, strict=True):
            assert [s.tokens for s in a] == [s.tokens for s in b]
            for x, y in zip(a, b, strict=True):
                diffs = [abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)]
                assert max(diffs, default=0.0) <= BATCH_BOUND


def test_an_moe_policys_recorded_routes_are_the_static_batchs(
    tmp_path: Path, record_property: Any
) -> None:
    """R3 records every fed token's experts; a row that left was fed nothing more, and the
    routes of the tokens it was fed are recorded from the batches it was in."""
    path = save_perturbed_tiny(tmp_path / "moe", src=models.resolve_model_path("builtin:tiny-moe"))
    model, tok = load_causal_lm(path, "float32").eval(), load_tokenizer(path)
    cfg = RolloutConfig(n=8, max_new_tokens=12, eos_token_ids=ENDS)
    engine = _engine(model, tok, cfg, record_routes=True)
    static, other = _three_ways(engine, functools.partial(_groups, engine, 8, PROMPTS))
    assert all(s.routes is not None for s in static)
    for name, got in other.items():
        _assert_within_bound(static, got, lambda k, v, n=name: record_property(f"{n}_{k}", v))


def test_image_rows_leave_like_text_rows(
    tiny_vl: Path, vl_encoder: VisionEncoder, vl_prompts: list[EncodedPrompt], record_property: Any
) -> None:
    """A vision-language model's rows decode on M-RoPE positions carried per row: a row
    that leaves takes its positions with it."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    tok = vl_encoder.tokenizer
    ends = tuple(range(0, len(tok), 6))  # a sixth of this larger vocabulary ends a row
    cfg = RolloutConfig(n=4, max_new_tokens=10, eos_token_ids=ends)
    engine = HFGenerateEngine(model, cfg, -1, tok.pad_token_id)
    prompts = [e.input_ids for e in vl_prompts]
    vision = [e.vision_inputs() for e in vl_prompts]

    def run() -> list[SampleOutput]:
        groups = engine.generate_groups(prompts, 4, [7, 8, 9], vision)
        return [
            SampleOutput(tokens=t, logprobs=lp, finish_reason=r)
            for g in groups
            for t, lp, r in zip(g.tokens, g.logprobs, g.finish_reasons, strict=True)
        ]

    static, other = _three_ways(engine, run)
    for name, got in other.items():
        _assert_within_bound(static, got, lambda k, v, n=name: record_property(f"{n}_{k}", v))


def test_a_run_directory_from_before_the_key_decodes_as_it_did() -> None:
    """A saved config without `rollout.compact_decode` was written before it existed: it
    resumes with `off`, the loop and draws it started with (tests/test_migration.py)."""
    from rftpipe.config.loader import from_dict, load_config, to_dict
    from rftpipe.config.schema import RunConfig

    saved = to_dict(load_config(RunConfig))
    assert saved["rollout"]["compact_decode"] == "auto"
    del saved["rollout"]["compact_decode"]
    assert from_dict(RunConfig, saved, saved=True).rollout.compact_decode == "off"


@pytest.mark.slow
def test_a_run_killed_mid_turn_with_rows_leaving_resumes_bitwise(tmp_path: Path) -> None:
    """Multi-turn episodes whose responses also end at sixteen byte tokens, so rows leave
    every turn's decode batch (the run's counts say so): killed in the middle of step 2's
    third turn, the resumed stage rebuilds the kept caches by replaying the committed turns
    and ends bitwise equal to the uninterrupted run."""
    steps = (
        "rollout.env.path=envs_toy:EvenChars",
        "rollout.env.max_turns=3",
        "rollout.env.max_total_tokens=200",
        f"rollout.eos_token_ids=[{', '.join(map(str, ENDS))}]",
        "reward.functions=[]",
        "total_steps=2",
    )
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = submit(ref, *steps, env=TESTS_ON_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        assert 0 < m["rollout/decode_row_steps"] < m["rollout/decode_static_row_steps"], m
    kill_mid_turn_and_resume(ref, run, steps, TESTS_ON_PATH, skip=21, resumed=[(2, 2)])
