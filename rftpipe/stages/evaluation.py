"""The `eval` stage: greedy and sampled completions of held-out problems, scored.

It runs after a step's sync when `eval.due(step)` (step 0: the initial weights), with the
weights of that step. Rows carry `mode` (greedy or sampled) and the score stage's reward
columns and `correct`; `rftpipe.run.metrics.eval_metrics` turns committed rows into greedy
accuracy and pass@k, overall and per data source.

With `rollout.env` every completion is an episode (`rftpipe.stages.episodes`) with the
training's environment, budgets, tool parser and `on_error` policy: a greedy one per
problem (each turn the greedy continuation, `engine.greedy_rows`) and `eval.samples`
sampled ones (turn t of sample k of problem p drawn from (run seed, step, "eval", p, k, t);
the environment reset with (run seed, step, "eval", p, k)). Rows add the rollout's episode
columns (`num_turns`, `episode_status`, `messages`, ...); `response` is the last action's
text and `response_token_ids` the whole episode's tokens, both roles (an agent episode
that branched: its last sequence's, and `num_turns` counts the calls of all of them). The
score stage adds the environment's return (`reward_env`), so `eval.metric: env` evaluates
an environment-only reward. The stage's episodes are not durable turn by turn: the stage
commits once, and a run killed during it runs the whole evaluation again, to the same rows
(every episode is a function of its seeds and the step's weights).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rftpipe.config.schema import EvalConfig, RewardConfig, RolloutConfig
from rftpipe.data.prompts import Prompt, content_key
from rftpipe.data.sampler import rank_slice
from rftpipe.engines.rollout.base import RolloutEngine
from rftpipe.engines.vision import VisionEncoder
from rftpipe.rewards.types import RewardComponent
from rftpipe.seeding import derive_seed
from rftpipe.stages import StageName, agents, episodes, score
from rftpipe.stages.base import NoSideEffects, Rows, Runtime, StageOutput, StepPlan
from rftpipe.stages.images import prompt_inputs, store_images, with_image_refs
from rftpipe.stages.rollout import EPISODE_COLUMNS, Unlogged, env_maker

EVAL_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("prompt_id", pa.int64()),
        ("sample_idx", pa.int32()),
        ("mode", pa.string()),
        ("rank", pa.int32()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_length", pa.int32()),
        ("finish_reason", pa.string()),
        ("answer", pa.string()),
        ("metadata", pa.string()),
        ("weight_version", pa.int64()),
    ]
)


EVAL_EPISODE_SCHEMA = pa.schema([*EVAL_SCHEMA, *EPISODE_COLUMNS])
"""An evaluation episode's row (`rollout.env`): the rollout's episode columns added."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalInputs:
    step: int
    rank: int
    run_seed: int
    prompts: Sequence[Prompt]
    """This rank's held-out problems, whole calls of the global order."""
    eval: EvalConfig
    rollout: RolloutConfig
    reward: RewardConfig
    encoder: VisionEncoder | None = None
    """A vision-language policy's image encoding (its problems' images go to the engine)."""
    run_root: Path | None = None
    """The run directory: its image store takes the rows' images (with `encoder`), and
    reward functions read them from there."""


def run(
    engine: RolloutEngine,
    tokenizer: Any,
    components: Mapping[str, RewardComponent],
    inp: EvalInputs,
) -> pa.Table:
    """One greedy row (sample_idx -1) and `eval.samples` sampled rows per problem, scored;
    with `rollout.env`, each an episode."""
    # This rank holds whole units of eval.problems_per_call, so cutting its problems by that
    # unit gives the calls, and the completions, of any world size. An engine that takes
    # all of a rank's groups at once (seeding each sample on its own) gets them so: ranks
    # sharing a tensor-parallel engine must each make one call.
    g = max(engine.groups_per_call, inp.eval.problems_per_call)
    calls = [inp.prompts[i : i + g] for i in range(0, len(inp.prompts), g)]
    if inp.rollout.env is not None or inp.rollout.agent is not None:
        table = _episode_table(engine, tokenizer, inp, calls)
    else:
        table = _completion_table(engine, tokenizer, inp, calls)
    if inp.encoder is not None:
        assert inp.run_root is not None, "a vision run stores its images"
        # Stored before scoring: reward functions read the images from the store.
        store_images(inp.run_root, inp.prompts)
        table = with_image_refs(table, inp.prompts)
    scored = score.run(inp.reward, components, table, inp.run_root)
    metric = scored.column(f"reward_{inp.eval.metric}").to_pylist()
    # Null where the metric's function does not score the row's data source.
    correct = [None if v is None else v >= inp.eval.threshold for v in metric]
    return scored.append_column(pa.field("correct", pa.bool_()), pa.array(correct, pa.bool_()))


def _completion_table(
    engine: RolloutEngine, tokenizer: Any, inp: EvalInputs, calls: list[Sequence[Prompt]]
) -> pa.Table:
    """Single-turn rows: one greedy completion and `eval.samples` sampled ones per problem."""
    cols: dict[str, list] = {name: [] for name in EVAL_SCHEMA.names}
    budget = inp.rollout.max_new_tokens
    if not calls and engine.collective:
        calls = [[]]  # a tensor-parallel group generates together, even for no prompts

    def add(p: Prompt, idx: int, mode: str, toks: list[int], reason: str) -> None:
        row = {
            "step": inp.step,
            "prompt_id": p.prompt_id,
            "sample_idx": idx,
            "mode": mode,
            "rank": inp.rank,
            "prompt": p.text,
            "response": tokenizer.decode(toks, skip_special_tokens=True),
            "response_token_ids": toks,
            "response_length": len(toks),
            "finish_reason": reason,
            "answer": p.answer,
            "metadata": json.dumps(p.metadata, sort_keys=True, default=str),
            "weight_version": engine.weight_version,
        }
        for name, value in row.items():
            cols[name].append(value)

    for call in calls:
        vision = prompt_inputs(inp.encoder, call)
        greedy = engine.greedy([p.token_ids for p in call], budget, vision=vision)
        for p, toks in zip(call, greedy, strict=True):
            # `greedy` drops the EOS, so a completion shorter than the budget ended on one.
            add(p, -1, "greedy", toks, "stop" if len(toks) < budget else "length")
        if not inp.eval.samples:
            continue
        seeds = [derive_seed(inp.run_seed, inp.step, "eval", p.prompt_id) for p in call]
        groups = engine.generate_groups(
            [p.token_ids for p in call], inp.eval.samples, seeds, vision=vision
        )
        for p, group in zip(call, groups, strict=True):
            for k, (toks, reason) in enumerate(
                zip(group.tokens, group.finish_reasons, strict=True)
            ):
                add(p, k, "sampled", list(toks), reason)
    return pa.Table.from_pydict(cols, schema=EVAL_SCHEMA)


def _episode_table(
    engine: RolloutEngine,
    tokenizer: Any,
    inp: EvalInputs,
    calls: list[Sequence[Prompt]],
) -> pa.Table:
    """Episode rows: each problem's greedy episode (-1) and its sampled ones, run turn by
    turn (an agent's call by call) over this rank's calls as the rollout runs them (not
    committed per turn; each rank ends its own, so no collective)."""
    samples, greedy = [-1, *range(inp.eval.samples)], frozenset({-1})
    env, agent = inp.rollout.env, inp.rollout.agent
    if agent is not None:
        out, _ = agents.run(
            agents.AgentInputs(
                cfg=inp.rollout,
                agent=agent,
                run_seed=inp.run_seed,
                step=inp.step,
                stage="eval",
                calls=calls,
                samples=samples,
                greedy_samples=greedy,
            ),
            engine,
            tokenizer,
            Unlogged(),
        )
    else:
        assert env is not None
        ep_inp = episodes.EpisodeInputs(
            cfg=inp.rollout,
            env_cfg=env,
            run_seed=inp.run_seed,
            step=inp.step,
            stage="eval",
            calls=calls,
            samples=samples,
            greedy_samples=greedy,
            encoder=inp.encoder,
        )
        out = episodes.run(ep_inp, engine, tokenizer, env_maker(env), Unlogged())
    cols: dict[str, list] = {name: [] for name in EVAL_EPISODE_SCHEMA.names}
    # Greedy row first, then the samples, per problem in the rank's order (as single-turn).
    order = {p.prompt_id: i for i, p in enumerate(inp.prompts)}
    played = sorted(out.episodes, key=lambda e: (order[e.prompt.prompt_id], e.sample_idx))
    for e in played:
        mode = "greedy" if e.greedy else "sampled"
        row = {
            "step": inp.step,
            "prompt_id": e.prompt.prompt_id,
            "sample_idx": e.sample_idx,
            "mode": mode,
            "rank": inp.rank,
            "prompt": e.prompt.text,
            # What reward functions read as the response: the last action's text, as in
            # the rollout's episode rows.
            "response": e.last_action,
            "response_token_ids": e.response,
            "response_length": len(e.response),
            "finish_reason": e.finish_reason,
            "answer": e.prompt.answer,
            "metadata": json.dumps(e.prompt.metadata, sort_keys=True, default=str),
            "weight_version": engine.weight_version,
            **episodes.turn_columns(e),
            # An agent episode that branched holds its last sequence's turn structure; it
            # took the calls of all of its sequences.
            "num_turns": sum(len(s.turn_offsets) for s in [*e.branches, e]),
        }
        for name, value in row.items():
            cols[name].append(value)
    return pa.Table.from_pydict(cols, schema=EVAL_EPISODE_SCHEMA)


@dataclass(frozen=True, slots=True)
class EvalStage(NoSideEffects):
    """After sync, when `eval.due(step)`: greedy and sampled completions of the held-out
    problems with the step's weights, scored (its rows are the evaluation's record)."""

    name: StageName = "eval"
    publish: bool = False
    replay_reads_rows: bool = False
    engine_awake: bool = True

    def run(self, rt: Runtime, plan: StepPlan, rows: Rows) -> StageOutput:
        assert rt.held_out is not None, "eval is due only with eval.size > 0"
        held = rt.held_out.prompts
        # Dealt in whole calls of the problems' order (see evaluation.run).
        mine = rank_slice(
            range(len(held)), rt.dist.rank, rt.dist.world, rt.cfg.eval.problems_per_call
        )
        inp = EvalInputs(
            step=plan.step,
            rank=rt.dist.rank,
            run_seed=rt.cfg.seed,
            prompts=[held[i] for i in mine],
            eval=rt.cfg.eval,
            rollout=rt.cfg.rollout,
            reward=rt.cfg.reward,
            encoder=rt.vision,
            run_root=rt.run.root,
        )
        table = run(rt.rollout_engine, rt.tokenizer, rt.rewards, inp)
        train = {content_key(p) for p in rt.prompts.prompts}
        overlap = sum(content_key(p) in train for p in held)
        extra = {
            "problems": len(held),
            "overlap_with_train": overlap,
            "k": list(rt.cfg.eval.k) if rt.cfg.eval.samples else [],
        }
        return StageOutput(rows=table, extra=extra)
