"""Routing replay (R3) over multi-turn episodes and agent calls (rftpipe/engines/rollout/hf.py,
rftpipe/stages/episodes.py, rftpipe/stages/agents.py): the routes of a whole episode, turn
by turn, on the HF loop with and without kept KV caches, and an agent's branched episode.

A position is routed once, by the first forward that feeds it (a turn's decode step, or the
prefill of the tokens appended since): every later forward of it (the next turn's prefill,
a resumed stage's replay, the trainer) replays that selection. The model is `tiny-moe`
perturbed so its experts differ (upcycled ones are copies, and any selection of copies
computes the same), and the rollout's routers select from noisy logits (the test-only
fault `RFTPIPE_ROUTER_NOISE`), so a position routed twice live would be routed otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import Killed, MemoryLog, OneRankLog, episode_prompts, save_perturbed_tiny

from rftpipe.config.schema import AgentConfig, EnvConfig, RolloutConfig
from rftpipe.engines import moe
from rftpipe.engines.models import load_causal_lm, load_tokenizer, resolve_model_path
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.engines.train.forward import grouped_logprobs
from rftpipe.stages import agents, episodes, rollout
from rftpipe.stages.routes import RouteColumn
from rftpipe.storage.routes import ROUTES, fed_tokens

ENV = EnvConfig(path="envs_toy:EvenChars", max_turns=3, max_total_tokens=200)
CFG = RolloutConfig(n=2, max_new_tokens=6, temperature=1.0, eos_token_ids=tuple(range(16)), env=ENV)
# The rollout engines' tolerance between their logprobs and the trainer's on CPU fp32
# (tests/test_moe_routing.py, tests/test_rollout_engines.py).
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_perturbed_tiny(
        tmp_path_factory.mktemp("moe"), resolve_model_path("builtin:tiny-moe")
    )


@pytest.fixture(scope="module")
def tiny(model_dir: Path):  # noqa: ANN201
    return load_causal_lm(model_dir, "float32"), load_tokenizer(model_dir)


@pytest.fixture
def noisy() -> Iterator[None]:
    os.environ["RFTPIPE_ROUTER_NOISE"] = "1.0"
    try:
        yield
    finally:
        del os.environ["RFTPIPE_ROUTER_NOISE"]


def _engine(tiny, cfg: RolloutConfig = CFG) -> HFGenerateEngine:  # noqa: ANN001
    model, tok = tiny
    return HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id, record_routes=True)


def _play(engine: HFGenerateEngine, tok) -> list[episodes.Episode]:  # noqa: ANN001
    from envs_toy import EvenChars

    inp = episodes.EpisodeInputs(
        cfg=engine.cfg,
        env_cfg=ENV,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=[episode_prompts(tok)],
    )
    return episodes.run(inp, engine, tok, EvenChars, OneRankLog()).episodes


def _gaps(model, seqs) -> tuple[float, float]:  # noqa: ANN001
    """The largest |trainer - rollout| logprob over the sampled tokens of `seqs`, each an
    Episode (one sequence), replaying their routes and routed live."""
    routers = moe.Routers.of(model)
    assert routers is not None
    P = [s.prompt_ids for s in seqs]
    R = [s.response for s in seqs]
    out = []
    for routes in ([s.routes for s in seqs], None):
        rr = None if routes is None else moe.RowRoutes(routers=routers, rows=routes)
        with torch.no_grad():
            lp = grouped_logprobs(model, P, R, 1.0, False, routes=rr)[0]
        routers.clear()
        worst = 0.0
        for i, s in enumerate(seqs):
            for j, (got, m) in enumerate(zip(s.logprobs, s.loss_mask, strict=True)):
                if m:
                    worst = max(worst, abs(float(lp[i, j]) - got))
        out.append(worst)
    return out[0], out[1]


@pytest.mark.kernels  # a tolerance between the rollout's kernels and the trainer's
@pytest.mark.parametrize("keep", [True, False], ids=["kept_cache", "whole_history"])
def test_an_episodes_routes_cover_its_fed_tokens_and_replay_closes_the_gap(
    tiny, noisy: None, keep: bool
) -> None:
    """Three turns with environment tokens between them: each episode's routes cover every
    token before its last sampled one; replaying them, the trainer's logprobs of every
    turn's tokens equal the rollout's, and routed live they do not. The rows keep them."""
    model, tok = tiny
    cfg = dataclasses.replace(CFG, env=dataclasses.replace(ENV, keep_kv_cache=keep))
    engine = _engine(tiny, cfg)
    assert engine.continues_turns == keep
    played = _play(engine, tok)
    shape = moe.route_shape(model)
    assert shape is not None
    for e in played:
        assert len(e.turn_offsets) == 3 and e.routes is not None and e.routes.dtype == torch.uint8
        fed = fed_tokens(len(e.prompt_ids), len(e.response), e.loss_mask)
        assert fed == len(e.prompt_ids) + len(e.response) - 1  # ended on a sampled token
        assert e.routes.shape == (fed, shape.layers, shape.top_k)
    replayed, live = _gaps(model, played)
    assert replayed < TOL, replayed
    assert live > 50 * TOL, live
    inp = rollout.RolloutInputs(step=1, rank=0, run_seed=0, prompts=episode_prompts(tok), env=ENV)
    table = rollout.episode_rows(inp, engine, tok, played)
    back = RouteColumn(column=ROUTES, shape=shape).table(table)
    assert all(torch.equal(b, e.routes) for b, e in zip(back, played, strict=True))


def test_a_turn_routes_earlier_tokens_as_first_routed_and_a_replay_rebuilds_it_bitwise(
    tiny, noisy: None
) -> None:
    """Turn 1 prefills turn 0's sampled tokens again (with the environment's after them):
    given turn 0's routes, it routes those tokens as turn 0's decode steps did (without
    them, the noisy router picks otherwise). A fresh engine that replays turn 0 with its
    committed routes (a resumed stage) samples turn 1 bit for bit."""
    _, tok = tiny
    prompts = [list(p.token_ids) for p in episode_prompts(tok)]
    keys, seeds = [0, 1], [11, 12]

    def turn1(engine: HFGenerateEngine, first, known):  # noqa: ANN001, ANN202
        nxt = [p + o.tokens + [20, 21, 22] for p, o in zip(prompts, first, strict=True)]
        return engine.generate_rows(nxt, [21, 22], [6, 6], keys=keys, routes=known)

    engine = _engine(tiny)
    first = engine.generate_rows(prompts, seeds, [6, 6], keys=keys)
    assert all(o.routes is not None for o in first)
    known = [o.routes for o in first]
    second = turn1(engine, first, known)
    for o, k in zip(second, known, strict=True):
        assert o.routes is not None and torch.equal(o.routes[: len(k)], k)
    engine.end_episodes()
    # The same turns with turn 0's routes withheld from turn 1's whole prefill: the
    # re-fed tokens are routed again, and the noise routes some otherwise.
    engine.generate_rows(prompts, seeds, [6, 6], keys=[5, 6])
    alone = turn1(engine, first, None)
    engine.end_episodes()
    assert any(
        not torch.equal(a.routes[: len(k)], k)
        for a, k in zip(alone, known, strict=True)  # type: ignore[index]
    )
    # A resumed stage: turn 0 replayed (prefilled, not sampled) with its committed routes.
    fresh = _engine(tiny)
    fed = [k[: len(p)] for k, p in zip(known, prompts, strict=True)]
    fresh.generate_rows(prompts, seeds, [0, 0], keys=keys, routes=fed)
    again = turn1(fresh, first, known)
    fresh.end_episodes()
    for a, b in zip(again, second, strict=True):
        assert (a.tokens, a.logprobs) == (b.tokens, b.logprobs)
        assert a.routes is not None and b.routes is not None and torch.equal(a.routes, b.routes)


@pytest.mark.kernels  # a tolerance between the rollout's kernels and the trainer's
def test_a_branched_agent_episode_has_routes_per_sequence_replayed_and_resumed_bitwise(
    tiny, noisy: None
) -> None:
    """An odd sample's agent rewrites its history at its second call: the episode's two
    sequences each hold their own routes (the second prefilled whole, routed afresh).
    Replayed, the trainer's logprobs of every call's tokens equal the rollout's; killed
    after call index 2 and resumed (calls answered from the committed record, the rest
    generated on caches rebuilt with the committed routes), the routes are the same bytes."""
    model, tok = tiny
    agent = AgentConfig(
        path="agents_e2e:even_tokens",
        kwargs={"calls": 3, "summarize_odd": True},
        max_total_tokens=400,
    )
    cfg = RolloutConfig(n=2, max_new_tokens=6, agent=agent)
    prompts = episode_prompts(tok, 1)
    shape = moe.route_shape(model)
    assert shape is not None

    def go(log, resumed=None, turns: int = 0):  # noqa: ANN001, ANN202
        inp = agents.AgentInputs(
            cfg=cfg,
            agent=agent,
            run_seed=0,
            step=1,
            stage="rollout",
            calls=[prompts],
            resumed=resumed or {},
            resumed_turns=turns,
            route_shape=shape,
        )
        return agents.run(inp, _engine(tiny, cfg), tok, log)[0].episodes

    whole = go(OneRankLog())
    assert [len(e.branches) for e in whole] == [0, 1]
    seqs = [s for e in whole for s in [*e.branches, e]]
    for s in seqs:
        assert s.routes is not None
        assert s.routes.shape[0] == fed_tokens(len(s.prompt_ids), len(s.response), s.loss_mask)
    replayed, live = _gaps(model, seqs)
    assert replayed < TOL, replayed
    assert live > 50 * TOL, live
    log = MemoryLog(SimpleNamespace(weight_version=0), tok, prompts, agent, kill_after=2)
    with pytest.raises(Killed):
        go(log)
    got = go(OneRankLog(), log.rows, log.turns)
    for a, b in zip(got, whole, strict=True):
        for x, y in zip([*a.branches, a], [*b.branches, b], strict=True):
            assert (x.response, x.logprobs) == (y.response, y.logprobs)
            assert x.routes is not None and y.routes is not None
            assert torch.equal(x.routes, y.routes)
