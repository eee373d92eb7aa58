"""Stage 1, rollout: n samples per prompt, grouped, with sampling logprobs (and, for
estimators with a greedy baseline such as ReMax, one greedy row per prompt)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import pyarrow as pa
import torch

from rftpipe.algos.variants import ADVANTAGE_ESTIMATORS
from rftpipe.config.schema import AgentConfig, EnvConfig, RolloutConfig
from rftpipe.data.prompts import Prompt
from rftpipe.dist import Dist
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.vision import VisionEncoder
from rftpipe.envs.base import Environment
from rftpipe.envs.loader import make_environment
from rftpipe.envs.pool import shared_pool
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.seeding import derive_seed
from rftpipe.stages import agents, episodes, round_stage
from rftpipe.stages.base import NoSideEffects, Rows, Runtime, StageOutput, StepPlan
from rftpipe.stages.generation import DECODE_KEYS
from rftpipe.stages.images import prompt_inputs, store_images, with_image_refs
from rftpipe.stages.routes import with_routes
from rftpipe.storage.agreed import write_then_agree
from rftpipe.storage.branch_rows import BRANCH, BRANCHES
from rftpipe.storage.layout import schema_version
from rftpipe.storage.routes import MANIFEST_KEY, META_KEY, ROUTES, RouteShape
from rftpipe.storage.stage_store import StageStore

ROLLOUT_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("prompt_id", pa.int64()),
        ("sample_idx", pa.int32()),
        ("rank", pa.int32()),
        ("prompt", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response", pa.string()),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_length", pa.int32()),
        ("finish_reason", pa.string()),
        ("logprobs", pa.list_(pa.float32())),
        ("answer", pa.string()),
        ("metadata", pa.string()),
        ("weight_version", pa.int64()),
        ("is_baseline", pa.bool_()),
    ]
)

EPISODE_COLUMNS = [
    pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("turn_offsets", pa.list_(pa.int32())),
    pa.field("turn_rewards", pa.list_(pa.float64())),
    pa.field("turn_infos", pa.list_(pa.string())),
    pa.field("num_turns", pa.int32()),
    pa.field("env_reward", pa.float64()),
    pa.field("episode_status", pa.string()),
    pa.field("messages", pa.string()),
]
"""What a multi-turn row (`rollout.env`) adds: the trajectory schema's version 2."""
EPISODE_SCHEMA = pa.schema([*ROLLOUT_SCHEMA, *EPISODE_COLUMNS])
AGENT_SCHEMA = pa.schema(
    [*EPISODE_SCHEMA, pa.field(BRANCH, pa.int32()), pa.field(BRANCHES, pa.int32())]
)
"""An agent run's rows (`rollout.agent`): an episode is one row per sequence
(`rftpipe.storage.branch_rows`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutInputs:
    step: int
    rank: int
    run_seed: int
    prompts: Sequence[Prompt]
    """This rank's prompts; each becomes one group of `n` consecutive rows."""
    seed_stage: str = "rollout"
    """The stage name in the samples' seeds (a later generation round's own, `rollout.rR`)."""
    baseline: bool = False
    """Also generate one greedy response (with `env`, a greedy episode) per prompt
    (sample_idx n, `is_baseline`): the baseline of ReMax. Greedy decoding needs no seed, so
    it is the same on any replay."""
    env: EnvConfig | None = None
    """The multi-turn environment (`rollout.env`), if any."""
    agent: AgentConfig | None = None
    """The agent program of each episode (`rollout.agent`), if any."""
    encoder: VisionEncoder | None = None
    """A vision-language policy's image encoding (its prompts' images go to the engine)."""
    route_shape: RouteShape | None = None
    """An MoE policy's under R3: episodes restored from a committed turn force their
    committed routes again (single-turn rows take the engine's routes as they come)."""


def run(
    cfg: RolloutConfig,
    engine: RolloutEngine,
    tokenizer,
    inp: RolloutInputs,
    turns: TurnStore | None = None,
) -> pa.Table:
    """This rank's rows. Multi-turn episodes (`rollout.env`) commit each turn to `turns`
    and resume from its newest."""
    if cfg.env is not None:
        return _episode_table(cfg, cfg.env, engine, tokenizer, inp, turns)
    if cfg.agent is not None:
        return _agent_table(cfg, cfg.agent, engine, tokenizer, inp, turns)
    cols: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}
    routes: list[torch.Tensor | None] = []
    g = engine.groups_per_call
    # The HF loop's calls are `rollout.groups_per_call` groups and this rank holds whole
    # calls of the global order (rank_slice by units of g), so cutting its prompts by g gives
    # the same calls, and so the same samples, on any world size. Engines that seed every
    # sample on its own take all of a rank's groups at once.
    calls = [inp.prompts[i : i + g] for i in range(0, len(inp.prompts), g)]
    if not calls and engine.collective:
        # The ranks of a tensor-parallel engine generate together (one call each): a rank
        # without prompts this step still joins its group's call.
        engine.generate_groups([], cfg.n, [])
        if inp.baseline:
            engine.greedy([], cfg.max_new_tokens)
    for call in calls:
        seeds = [derive_seed(inp.run_seed, inp.step, inp.seed_stage, p.prompt_id) for p in call]
        vision = prompt_inputs(inp.encoder, call)
        groups = engine.generate_groups([p.token_ids for p in call], cfg.n, seeds, vision=vision)
        for p, group in zip(call, groups, strict=True):
            for k, (toks, lps, reason) in enumerate(
                zip(group.tokens, group.logprobs, group.finish_reasons, strict=True)
            ):
                _append(cols, _row(inp, engine, tokenizer, p, k, toks, lps, reason))
                routes.append(None if group.routes is None else group.routes[k])
        if inp.baseline:
            outs = engine.greedy([p.token_ids for p in call], cfg.max_new_tokens, vision=vision)
            for p, toks in zip(call, outs, strict=True):
                # Engines return greedy responses without EOS: one shorter than the budget
                # stopped on it, which is put back so the row reads like a sample.
                reason = "length" if len(toks) >= cfg.max_new_tokens else "stop"
                if reason == "stop" and tokenizer.eos_token_id is not None:
                    toks = [*toks, tokenizer.eos_token_id]
                # Never trained on, so no sampling logprobs: zeros keep the column's lengths.
                row = _row(inp, engine, tokenizer, p, cfg.n, toks, [0.0] * len(toks), reason)
                _append(cols, {**row, "is_baseline": True})
                routes.append(None)
    table = pa.Table.from_pydict(cols, schema=ROLLOUT_SCHEMA)
    # An MoE policy under R3: the engine recorded every sample's routes.
    return with_routes(table, ROUTES, routes) if any(r is not None for r in routes) else table


def _row(
    inp: RolloutInputs,
    engine: RolloutEngine,
    tokenizer,
    p: Prompt,
    k: int,
    toks: list[int],
    lps: list[float],
    reason: str,
    response: str | None = None,
) -> dict:
    """One row; `response` is its text if the caller has it (else `toks` decoded)."""
    return {
        "step": inp.step,
        "prompt_id": p.prompt_id,
        "sample_idx": k,
        "rank": inp.rank,
        "prompt": p.text,
        "prompt_token_ids": list(p.token_ids),
        "response": tokenizer.decode(toks, skip_special_tokens=True)
        if response is None
        else response,
        "response_token_ids": toks,
        "response_length": len(toks),
        "finish_reason": reason,
        "logprobs": lps,
        "answer": p.answer,
        "metadata": json.dumps(p.metadata, sort_keys=True, default=str),
        "weight_version": engine.weight_version,
        "is_baseline": False,
    }


def _episode_table(
    cfg: RolloutConfig,
    env: EnvConfig,
    engine: RolloutEngine,
    tokenizer,
    inp: RolloutInputs,
    turns: TurnStore | None,
) -> pa.Table:
    """Multi-turn rows: this rank's calls' episodes run turn by turn (`stages.episodes`),
    each turn committed to `turns` (None: not durable, a test's direct call)."""
    g = engine.groups_per_call
    rows, done = turns.resume(inp) if turns is not None else ([], 0)
    ep_inp = episodes.EpisodeInputs(
        cfg=cfg,
        env_cfg=env,
        run_seed=inp.run_seed,
        step=inp.step,
        stage=inp.seed_stage,
        calls=[inp.prompts[i : i + g] for i in range(0, len(inp.prompts), g)],
        resumed={(r["prompt_id"], r["sample_idx"]): r for r in rows},
        resumed_turns=done,
        # ReMax's baseline: one greedy episode per prompt, after its samples.
        samples=[*range(cfg.n), cfg.n] if inp.baseline else None,
        greedy_samples=frozenset({cfg.n}) if inp.baseline else frozenset(),
        encoder=inp.encoder,
        route_shape=inp.route_shape,
    )
    log: episodes.TurnLog = turns.log(inp, engine, tokenizer) if turns else Unlogged()
    out = episodes.run(ep_inp, engine, tokenizer, env_maker(env), log)
    if turns is not None:
        turns.env_s = out.env_s
    return episode_rows(inp, engine, tokenizer, out.episodes)


def _agent_table(
    cfg: RolloutConfig,
    agent: AgentConfig,
    engine: RolloutEngine,
    tokenizer,
    inp: RolloutInputs,
    turns: TurnStore | None,
) -> pa.Table:
    """Agent episodes: this rank's agents served call index by call index
    (`stages.agents`), each index committed to `turns` (None: not durable)."""
    if inp.encoder is not None:
        raise UserError("rollout.agent with image prompts: not built yet; docs/agents.md")
    g = engine.groups_per_call
    rows, done = turns.resume(inp) if turns is not None else ([], 0)
    resumed: dict[tuple[int, int], list[dict]] = {}
    for r in rows:  # an episode's sequences are consecutive, in branch order
        resumed.setdefault((r["prompt_id"], r["sample_idx"]), []).append(r)
    ag_inp = agents.AgentInputs(
        cfg=cfg,
        agent=agent,
        run_seed=inp.run_seed,
        step=inp.step,
        stage=inp.seed_stage,
        calls=[inp.prompts[i : i + g] for i in range(0, len(inp.prompts), g)],
        resumed=resumed,
        resumed_turns=done,
        route_shape=inp.route_shape,
    )
    log: episodes.TurnLog = turns.log(inp, engine, tokenizer) if turns else Unlogged()
    out, stats = agents.run(ag_inp, engine, tokenizer, log)
    if turns is not None:
        turns.env_s = out.env_s
        turns.agent = stats
    return episode_rows(inp, engine, tokenizer, out.episodes)


def episode_rows(
    inp: RolloutInputs, engine: RolloutEngine, tokenizer, finished: Sequence[episodes.Episode]
) -> pa.Table:
    """Episodes as trajectory rows (schema version 2; an agent's, one row per sequence of
    each episode, in branch order); a running one has no status yet."""
    schema = AGENT_SCHEMA if inp.agent is not None else EPISODE_SCHEMA
    cols: dict[str, list] = {name: [] for name in schema.names}
    routes: list[torch.Tensor | None] = []
    for e in finished:
        sequences = [*e.branches, e]
        for b, seq in enumerate(sequences):
            row = _row(
                inp,
                engine,
                tokenizer,
                e.prompt,
                e.sample_idx,
                seq.response,
                seq.logprobs,
                seq.finish_reason,
                # What reward functions read as the response: the last action's text (the
                # whole sequence holds environment tokens too, so it is not decoded).
                response=seq.last_action,
            )
            branch = {BRANCH: b, BRANCHES: len(sequences)} if inp.agent is not None else {}
            _append(
                cols,
                {
                    **row,
                    "prompt_token_ids": seq.prompt_ids,
                    **episodes.turn_columns(seq),
                    # How the episode ended, on each of its sequences.
                    "episode_status": e.status,
                    # ReMax's greedy baseline episode: scored, never trained on.
                    "is_baseline": e.greedy,
                    **branch,
                },
            )
            # A sequence that never sampled (truncated before its first turn) has no
            # routes to hold: an empty cell, as its fed tokens are none.
            routes.append(None if e.greedy else seq.routes if seq.routes is not None else _NONE)
    table = pa.Table.from_pydict(cols, schema=schema)
    # An MoE policy under R3: the engine recorded every turn's routes.
    recorded = any(r is not None and r is not _NONE for r in routes)
    return with_routes(table, ROUTES, routes) if recorded else table


_NONE = torch.zeros((0, 1, 1), dtype=torch.uint8)
"""The routes of a sequence that fed nothing."""


def env_maker(env: EnvConfig) -> episodes.EnvMaker:
    """What builds an episode's environment (`env`'s, or the one a row's `env_class`
    names): in this process's pool of `rollout.env.workers` processes (started once,
    shared by the rollout and held-out evaluation, closed at exit and killed with the run),
    or in-process with `workers: 0`."""
    if env.workers:
        return shared_pool(env).make

    def make(cfg: EnvConfig | None = None) -> Environment:
        return make_environment(cfg or env)

    return make


class Unlogged:
    """No turn commits: episodes that are not durable (held-out evaluation, a test's
    direct call); each rank decides alone when its episodes are over."""

    def commit(self, turns: int, finished: Sequence[episodes.Episode]) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag


@dataclass(slots=True)
class TurnStore:
    """A rollout stage's committed turns: `STAGE.tK` holds every episode of the step after
    K turns (one shard per rank, like a stage). Only the newest is kept."""

    store: StageStore
    dist: Dist
    stage: str
    env_s: float = 0.0
    """Seconds this rank waited for environments in the stage (set once it ran)."""
    agent: agents.AgentStats | None = None
    """An agent stage's counts (set once it ran)."""

    def name(self, k: int) -> str:
        return f"{self.stage}.t{k}"

    def newest(self, step: int, max_turns: int) -> int:
        """How many turns the newest committed turn directory holds (0: none)."""
        return next(
            (k for k in range(max_turns, 0, -1) if self.store.is_committed(step, self.name(k))),
            0,
        )

    def resume(self, inp: RolloutInputs) -> tuple[list[dict], int]:
        """The rows of this rank's episodes in the newest committed turn (an agent
        episode's sequences consecutive, in branch order), and its turns."""
        most = inp.env.max_turns if inp.env is not None else inp.agent.max_calls if inp.agent else 0
        k = self.newest(inp.step, most)
        if not k:
            return [], 0
        table = self.store.read_for(
            inp.step,
            self.name(k),
            self.dist.rank,
            self.dist.world,
            [p.prompt_id for p in inp.prompts],
        )
        events().write("resume_turns", step=inp.step, stage=self.stage, turns=k)
        return table.to_pylist(), k

    def log(self, inp: RolloutInputs, engine: RolloutEngine, tokenizer) -> episodes.TurnLog:
        return _StoreLog(self, inp, engine, tokenizer)


@dataclass(frozen=True, slots=True)
class _StoreLog:
    turns: TurnStore
    inp: RolloutInputs
    engine: RolloutEngine
    tokenizer: object

    def commit(self, k: int, finished: Sequence[episodes.Episode]) -> None:
        t, step = self.turns, self.inp.step
        name = t.name(k)
        table = episode_rows(self.inp, self.engine, self.tokenizer, finished)
        if self.inp.encoder is not None:
            table = with_image_refs(table, self.inp.prompts)
        meta = {
            "rftpipe.schema_version": schema_version(table.column_names),
            "rftpipe.stage": name,
            "rftpipe.step": str(step),
        }
        manifest: dict[str, object] = {"turns": k}
        shape = self.inp.route_shape
        if shape is not None and ROUTES in table.column_names:
            # As a stage's shards and manifest say it (`rftpipe.run.executor`).
            meta[META_KEY] = json.dumps(shape.to_meta(), sort_keys=True)
            manifest[MANIFEST_KEY] = shape.to_meta()
        # A full disk on any rank stops every rank alike, said once (`write_then_agree`).
        write_then_agree(t.dist, partial(t.store.write_shard, step, name, t.dist.rank, table, meta))
        write_then_agree(t.dist, partial(self._commit, step, k, manifest), main_only=True)

    def _commit(self, step: int, k: int, manifest: dict[str, object]) -> None:
        """Commit turn `k`'s stage and drop turn `k - 1`'s (rank 0)."""
        t = self.turns
        t.store.commit(step, t.name(k), t.dist.world, manifest)
        if k > 1:
            # The newer turn holds every episode: the older one is not read again.
            t.store.uncommit(step, t.name(k - 1))

    def any(self, flag: bool) -> bool:
        return self.turns.dist.any(flag)


def _append(cols: dict[str, list], row: dict) -> None:
    for name, value in row.items():
        cols[name].append(value)


@dataclass(frozen=True, slots=True)
class RolloutStage(NoSideEffects):
    """1. n samples per prompt, grouped, with their sampling logprobs."""

    round: int = 0
    """The generation round (> 0 only under dynamic sampling); its samples are seeded from
    its own stage name, so a prompt met again in a later round samples afresh."""
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = True

    @property
    def name(self) -> str:
        return round_stage("rollout", self.round)

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        inp = RolloutInputs(
            step=plan.step,
            rank=rt.dist.rank,
            run_seed=rt.cfg.seed,
            prompts=plan.mine,
            baseline=ADVANTAGE_ESTIMATORS.of(
                rt.cfg.advantage.estimator
            ).traits.needs_baseline_rollout,
            seed_stage=self.name,
            env=rt.cfg.rollout.env,
            agent=rt.cfg.rollout.agent,
            encoder=rt.vision,
            route_shape=rt.route_shape if rt.replay == "r3" else None,
        )
        turns = TurnStore(rt.store, rt.dist, self.name)
        if rt.vision is not None:
            # The images are durable before any shard that references them is written (a
            # multi-turn stage's turn shards too).
            store_images(rt.run.root, plan.mine)
        rt.rollout_engine.take_decode_counts()  # not this stage's (an evaluation's, say)
        table = run(rt.cfg.rollout, rt.rollout_engine, rt.tokenizer, inp, turns)
        if rt.vision is not None:
            table = with_image_refs(table, plan.mine)
        extra: dict[str, object] = {"sampler": plan.sampler, "prompt_ids": plan.global_ids}
        counts = rt.rollout_engine.take_decode_counts()
        if counts is not None:
            # Summed over the ranks that generated (each runs the same number of stages).
            values = asdict(counts)
            total = rt.dist.all_reduce_sum(torch.tensor([values[k] for k in DECODE_KEYS]))
            extra["decode"] = dict(zip(DECODE_KEYS, map(int, total.tolist()), strict=True))
        if rt.replay == "r3" and rt.route_shape is not None:
            if ROUTES not in table.column_names and len(table):
                raise RuntimeError(f"{self.name}: the engine recorded no routes under r3")
            extra["routes"] = rt.route_shape.to_meta()
        if rt.cfg.rollout.env is not None:
            extra["env_s"] = turns.env_s  # rank 0's
        if turns.agent is not None:
            extra["agent_s"] = turns.agent.agent_s  # rank 0's
            extra["agent_from_record"] = turns.agent.from_record
            extra["agent_engine_calls"] = turns.agent.engine_calls
        return StageOutput(rows=table, extra=extra)
