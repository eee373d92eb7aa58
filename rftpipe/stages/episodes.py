"""Multi-turn episodes (`rollout.env`): the rollout stage's rows when the model acts in an
environment over several turns.

A sample is one token sequence: the prompt, then per turn the model's sampled tokens and
the environment's tokens. Nothing that is already tokens is decoded and tokenized again:
the model's tokens are kept as sampled, and each turn's environment tokens are the chat
template's text after the model's action, tokenized on their own,

    template(history + [assistant: action] + observations, generation prompt)
      minus template(history, generation prompt) + action,

which holds only when the template renders earlier messages the same whatever follows (its
prefix is stable) and the action verbatim; otherwise the run stops with one line naming the
template. Tokens that close an assistant turn but were not sampled (`<|im_end|>\\n` after a
stop at the length limit, the newline after a sampled `<|im_end|>`) are environment tokens.

`loss_mask` is 1 on the model's tokens and 0 on the environment's: the train stage trains,
and counts KL, entropy and critic values, on the model's alone. Environment tokens carry
logprob 0.

Budgets: each turn samples at most `rollout.max_new_tokens`, and the whole response (all
turns, both roles) at most `rollout.env.max_total_tokens`. A turn is cut to what is left; an
observation that would not fit is not appended. Either way the episode ends as `truncated`.

Seeds: turn t of sample k of prompt p draws from (run seed, step, stage, p, k, t) alone, and
an environment is reset with (run seed, step, stage, p, k), so an episode is the same on any
world size and batch composition of draws.

Environments: a prompt whose dataset row names an `env_class` has its episodes made by that
environment (`rftpipe.envs.loader.row_env`), the others by `rollout.env`'s; a resumed
episode gets its row's back, so one run mixes environments and resumes bitwise.

Engine state: every turn names its rows' episodes (`Episode.slot`) to the engine, so
one that `continues_turns` (the HF loop) keeps each episode's KV cache from turn to turn; an
episode's is freed when it ends, and all at the end. A resumed stage replays the committed
turns' prefills through the same calls first, which rebuilds those caches bit for bit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from rftpipe.config.schema import EnvConfig, RolloutConfig
from rftpipe.data.prompts import Prompt
from rftpipe.engines.vision import VisionEncoder, VisionInputs
from rftpipe.envs.base import (
    Environment,
    StepResult,
    Task,
    call,
    checked_reset,
    checked_step_result,
)
from rftpipe.envs.loader import row_env
from rftpipe.envs.pool import EnvFailed, env_name, step_all
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.seeding import derive_seed
from rftpipe.stages.routes import RouteColumn
from rftpipe.storage.routes import ROUTES, RouteShape

EpisodeStatus = str
"""How an episode ended: `done` (the environment said so), `max_turns`, `truncated` (a
token budget), `error` (the environment failed, `rollout.env.on_error=end_episode`)."""


@dataclass(slots=True)
class Episode:
    """One sample's episode while it runs."""

    prompt: Prompt
    sample_idx: int
    env: Environment | None
    """None once a restored episode had ended (nothing left to step)."""
    prompt_ids: list[int]
    """The templated reset messages, generation prompt included."""
    text: str
    """The template's text of the conversation so far, generation prompt included."""
    messages: list[dict[str, Any]]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_offsets: list[int] = field(default_factory=list)
    """Where each turn's sampled tokens start in `response`."""
    turn_rewards: list[float] = field(default_factory=list)
    turn_infos: list[str] = field(default_factory=list)
    """Per turn, JSON of the environment's info and any `postprocessed_action`."""
    finish_reason: str = "length"
    status: EpisodeStatus | None = None
    """None while it runs."""
    last_action: str = ""
    tools: Any = None
    """The tool schemas `reset` offered (`info["tools"]`), passed to every templating."""
    greedy: bool = False
    """Every turn is the greedy continuation (`engine.greedy_rows`: no draws, no kept KV
    cache): held-out evaluation's greedy episodes and ReMax's baseline episode."""
    slot: int = -1
    """Its place in the stage's row-major order: the engine's name for its kept KV cache.
    Not (prompt id, sample): a step that straddles an epoch boundary may hold a prompt
    twice, and its two episodes are two caches."""
    vision: VisionInputs | None = None
    """An image prompt's images as the engine takes them, over `prompt_ids` (whose image
    pads are expanded to the images' token counts); None for a text prompt."""
    branches: list[Episode] = field(default_factory=list)
    """An agent episode's earlier sequences (`rftpipe.storage.branch_rows`), oldest first;
    the fields above are its last one. Empty for an environment's episode."""
    routes: torch.Tensor | None = None
    """An MoE policy's routes under R3: (T, L, k) uint8 over the sequence's tokens so far
    that the engine has fed (its last sampled token and the environment's tokens after it
    are fed by the next turn), as the engine returns them; None when it records none."""


def turn_columns(e: Episode) -> dict[str, Any]:
    """An ended episode's turn structure, as its trajectory or evaluation row records it
    (the columns that schema version 2 adds)."""
    return {
        "loss_mask": e.loss_mask,
        "turn_offsets": e.turn_offsets,
        "turn_rewards": e.turn_rewards,
        "turn_infos": e.turn_infos,
        "num_turns": len(e.turn_offsets),
        "env_reward": float(sum(e.turn_rewards)),
        "episode_status": e.status,
        "messages": json.dumps(e.messages, ensure_ascii=False),
    }


class TurnLog(Protocol):
    """Where a rank's episodes are committed turn by turn (the rollout stage's store)."""

    def commit(self, turns: int, episodes: Sequence[Episode]) -> None:
        """Commit every episode of this rank after `turns` turns (collective)."""
        ...

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (collective)."""
        ...


class EnvMaker(Protocol):
    """What builds an episode's environment: `make_env()` the run's (`rollout.env`),
    `make_env(cfg)` the one a dataset row's `env_class` names (`row_env`)."""

    def __call__(self, cfg: EnvConfig | None = None) -> Environment: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeInputs:
    cfg: RolloutConfig
    env_cfg: EnvConfig
    run_seed: int
    step: int
    stage: str
    """The stage name in the seeds (`rollout`, or a generation round's `rollout.rR`)."""
    calls: Sequence[Sequence[Prompt]]
    """This rank's prompts, by engine call (`rollout.groups_per_call` groups each)."""
    resumed: Mapping[tuple[int, int], Mapping[str, Any]] = field(default_factory=dict)
    """The committed rows of the newest turn before a restart, by (prompt id, sample)."""
    resumed_turns: int = 0
    """How many turns those rows hold."""
    samples: Sequence[int] | None = None
    """The sample indices of each prompt's episodes (None: `range(cfg.n)`)."""
    greedy_samples: frozenset[int] = frozenset()
    """The sample indices whose every turn is the greedy continuation (`engine.greedy_rows`,
    no draws, so no turn seeds), run turn by turn with the others: held-out evaluation's
    greedy episode (-1), ReMax's baseline episode (`cfg.n`)."""
    encoder: VisionEncoder | None = None
    """A vision-language policy's image encoding: an image prompt's episode holds its
    images' tokens and every turn's engine call sees them (None: a text policy)."""
    route_shape: RouteShape | None = None
    """An MoE policy's under R3: a restored episode's committed routes are read back and
    forced again (None: no routes)."""


@dataclass(frozen=True, slots=True)
class EpisodeOutput:
    episodes: list[Episode]
    """Row-major: the samples (`cfg.n`, or `samples`) of each prompt of each call."""
    env_s: float
    """Seconds this process spent waiting for environments (building, resetting,
    replaying and stepping them)."""


def run(
    inp: EpisodeInputs,
    engine: Any,
    tokenizer: Any,
    make_env: EnvMaker,
    log: TurnLog,
) -> EpisodeOutput:
    """Every episode of this rank's calls, `cfg.n` samples of each prompt (or `samples`):
    run turn by turn, all calls together, each turn committed through `log` before the
    next."""
    cfg, env_cfg = inp.cfg, inp.env_cfg
    samples = range(cfg.n) if inp.samples is None else inp.samples
    eos = eos_ids(tokenizer, cfg)
    images = _EpisodeImages(inp.encoder, env_cfg)
    by_call: list[list[Episode]] = []
    clock = _Clock()
    try:
        for prompts in inp.calls:
            by_call.append([])
            for p in prompts:
                for k in samples:
                    seed = derive_seed(inp.run_seed, inp.step, inp.stage, f"env/{p.prompt_id}/{k}")
                    row = inp.resumed.get((p.prompt_id, k))
                    p_env, p_make = _env_of(env_cfg, make_env, p)
                    with clock:
                        e = (
                            _reset(p_env, tokenizer, p_make, p, k, seed, inp.step)
                            if row is None
                            else _restore(p_env, tokenizer, p_make, p, k, seed, inp.step, row)
                        )
                    if row is None:
                        images.expand(e)
                    elif inp.route_shape is not None:
                        e.routes = RouteColumn(column=ROUTES, shape=inp.route_shape).of([row])[0]
                    e.vision = images.of(e)
                    e.slot = sum(len(c) for c in by_call)
                    e.greedy = k in inp.greedy_samples
                    by_call[-1].append(e)
        episodes = [e for call_eps in by_call for e in call_eps]
        if inp.resumed_turns and engine.continues_turns:
            for call_eps in by_call:
                _replay(inp, engine, call_eps)
        for turn in range(inp.resumed_turns, env_cfg.max_turns):
            if not log.any(any(e.status is None for e in episodes)):
                break
            events().write("turn_begin", step=inp.step, stage=inp.stage, turn=turn)
            for call_eps in by_call:
                _turn(inp, engine, tokenizer, eos, call_eps, turn, clock, images)
                fault("episode_mid_turn")
            fault("episode_before_turn_commit")
            log.commit(turn + 1, episodes)
    finally:
        engine.end_episodes([_key(e) for call_eps in by_call for e in call_eps])
        with clock:
            for e in (e for call_eps in by_call for e in call_eps):
                if e.env is not None:
                    call(e.env.close)
    return EpisodeOutput(episodes=episodes, env_s=clock.seconds)


def _env_of(
    env_cfg: EnvConfig, make_env: EnvMaker, p: Prompt
) -> tuple[EnvConfig, Callable[[], Environment]]:
    """The environment of `p`'s episodes (its row's `env_class`, else the run's) and what
    makes one."""
    cfg = row_env(env_cfg, p.metadata, f"prompt_id {p.prompt_id}")
    return cfg, (make_env if cfg is env_cfg else partial(make_env, cfg))


class _Clock:
    """Seconds spent inside `with clock:` blocks, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._t0


def _turn(
    inp: EpisodeInputs,
    engine: Any,
    tokenizer: Any,
    eos: set[int],
    episodes: list[Episode],
    turn: int,
    clock: _Clock,
    images: _EpisodeImages,
) -> None:
    """Turn `turn` of one call's running episodes: one engine call, then each environment."""
    cfg, env_cfg = inp.cfg, inp.env_cfg
    live = [e for e in episodes if e.status is None]
    limits = [min(cfg.max_new_tokens, env_cfg.max_total_tokens - len(e.response)) for e in live]
    for e, lim in zip(live, limits, strict=True):
        if lim <= 0:
            e.status = "truncated"
    go = [(e, lim) for e, lim in zip(live, limits, strict=True) if lim > 0]
    if not go:
        engine.end_episodes([_key(e) for e in live])
        return
    # The sampled rows in one call (a group's first turn shares its prefill), the greedy
    # ones (ReMax's baselines, or every row of a greedy evaluation) in another.
    sampled = [(e, lim) for e, lim in go if not e.greedy]
    greedy = [(e, lim) for e, lim in go if e.greedy]
    got: dict[int, Any] = {}
    if sampled:
        outs = engine.generate_rows(
            [e.prompt_ids + e.response for e, _ in sampled],
            [_turn_seed(inp, e, turn) for e, _ in sampled],
            [lim for _, lim in sampled],
            keys=[_key(e) for e, _ in sampled],
            # An engine that keeps each episode's cache took the images with its first turn.
            vision=_vision([e for e, _ in sampled], turn == 0 or not engine.continues_turns),
            routes=[e.routes for e, _ in sampled],
        )
        got.update({e.slot: out for (e, _), out in zip(sampled, outs, strict=True)})
    if greedy:
        outs = engine.greedy_rows(
            [e.prompt_ids + e.response for e, _ in greedy],
            [lim for _, lim in greedy],
            vision=_vision([e for e, _ in greedy], True),
        )
        got.update({e.slot: out for (e, _), out in zip(greedy, outs, strict=True)})
    outs = [got[e.slot] for e, _ in go]
    acted = [(e, *_sampled(tokenizer, eos, e, out)) for (e, _), out in zip(go, outs, strict=True)]
    # Every episode's step at once: environments in worker processes run in parallel.
    pairs = []
    for e, action, _ in acted:
        assert e.env is not None, "a running episode has its environment"
        pairs.append((e.env, action))
    with clock:
        answers = step_all(pairs)
    for (e, action, stopped), answer in zip(acted, answers, strict=True):
        e_env = row_env(env_cfg, e.prompt.metadata)  # what errors name: the row's environment
        _answered(e_env, tokenizer, e, action, stopped, answer, turn, inp.step, images)
    engine.end_episodes([_key(e) for e in live if e.status is not None])


def _key(e: Episode) -> int:
    """An episode's name to the engine (see `Episode.slot`)."""
    return e.slot


def _vision(rows: Sequence[Episode], send: bool) -> list[VisionInputs | None] | None:
    """The rows' images for an engine call (None: none has images, or not `send`)."""
    if not send or all(e.vision is None for e in rows):
        return None
    return [e.vision for e in rows]


class _EpisodeImages:
    """An image prompt's episode's images: its reset prompt's image pads checked against
    the prompt's images and expanded to their token counts, and the `VisionInputs` over
    it (built once per (prompt, prompt ids): a group's episodes share them)."""

    def __init__(self, encoder: VisionEncoder | None, env_cfg: EnvConfig) -> None:
        self.encoder = encoder
        self.env_cfg = env_cfg
        self._inputs: dict[tuple[int, tuple[int, ...]], VisionInputs] = {}

    def of(self, e: Episode) -> VisionInputs | None:
        if self.encoder is None or not e.prompt.images:
            return None
        key = (id(e.prompt), tuple(e.prompt_ids))
        if key not in self._inputs:
            self._inputs[key] = self.encoder.inputs(e.prompt.images, e.prompt_ids)
        return self._inputs[key]

    def expand(self, e: Episode) -> None:
        """A reset episode's `prompt_ids` with each image's pad repeated once per image
        token; exit 2 when the reset messages place another number of images than the
        prompt has."""
        enc = self.encoder
        if enc is None or not e.prompt.images:
            return
        pads = e.prompt_ids.count(enc.image_token_id)
        if pads != len(e.prompt.images):
            raise UserError(
                f"rollout.env.path {self.env_cfg.path}: reset of prompt_id "
                f"{e.prompt.prompt_id} sample_idx {e.sample_idx} gave messages with {pads} "
                f"image parts for the prompt's {len(e.prompt.images)} images; keep the "
                "task's messages' image parts, in order"
            )
        counts = iter([enc.image_tokens(im.size) for im in e.prompt.images])
        e.prompt_ids = enc.expand(e.prompt_ids, counts)

    def check_observation(self, ids: Sequence[int], where: str) -> None:
        """Exit 2 on an observation that shows images (not supported yet)."""
        if self.encoder is not None and self.encoder.image_token_id in ids:
            raise UserError(
                f"rollout.env.path {self.env_cfg.path}: the observation of {where} holds an "
                "image; environments answer with text only so far"
            )


def _turn_seed(inp: EpisodeInputs, e: Episode, turn: int) -> int:
    return derive_seed(
        inp.run_seed, inp.step, inp.stage, f"{e.prompt.prompt_id}/{e.sample_idx}/{turn}"
    )


def _replay(inp: EpisodeInputs, engine: Any, episodes: list[Episode]) -> None:
    """Rebuild an engine's kept state for one call's restored episodes: each committed
    turn's call again, with the rows it had (the episodes that sampled that turn) and their
    prompts then, prefilled and not sampled (`max_new` 0)."""
    for turn in range(inp.resumed_turns):
        # Greedy episodes keep no cache (`greedy_rows` prefills their history each turn).
        rows = [e for e in episodes if len(e.turn_offsets) > turn and not e.greedy]
        if not rows:
            break
        prompts = [e.prompt_ids + e.response[: e.turn_offsets[turn]] for e in rows]
        engine.generate_rows(
            prompts,
            [_turn_seed(inp, e, turn) for e in rows],
            [0] * len(rows),
            keys=[_key(e) for e in rows],
            vision=_vision(rows, turn == 0),
            # Forcing the committed routes over the whole prompt changes nothing where the
            # turn routed live: the same selection gives the same forward, bit for bit.
            routes=[
                None if e.routes is None else e.routes[: len(p)]
                for e, p in zip(rows, prompts, strict=True)
            ],
        )
    engine.end_episodes([_key(e) for e in episodes if e.status is not None])


def _restore(
    env_cfg: EnvConfig,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    p: Prompt,
    k: int,
    seed: int,
    step: int,
    row: Mapping[str, Any],
) -> Episode:
    """An episode as a committed turn left it. A running one gets its environment back by
    replaying the recorded actions through `reset` and `step`, each answer checked against
    the record; an environment that declares `replayable = False` gets the recorded
    conversation through `restore(messages, turn_infos)` instead."""
    messages = json.loads(row["messages"])
    e = Episode(
        prompt=p,
        sample_idx=k,
        env=None,
        prompt_ids=list(row["prompt_token_ids"]),
        text="",
        messages=messages,
        response=list(row["response_token_ids"]),
        logprobs=list(row["logprobs"]),
        loss_mask=list(row["loss_mask"]),
        turn_offsets=list(row["turn_offsets"]),
        turn_rewards=list(row["turn_rewards"]),
        turn_infos=list(row["turn_infos"]),
        finish_reason=row["finish_reason"],
        status=row["episode_status"],
        last_action=row["response"],
    )
    if e.status is not None:
        return e  # ended: it needs no environment any more
    fresh = _reset(env_cfg, tokenizer, make_env, p, k, seed, step)
    env = fresh.env
    assert env is not None, "a reset episode has its environment"
    e.env, e.tools = env, fresh.tools
    e.text = template_text(tokenizer, messages, e.tools)
    where = f"prompt_id {p.prompt_id} sample_idx {k}"
    if fresh.status == "error":
        # It succeeded before the restart and fails now (under `end_episode`).
        what = json.loads(fresh.turn_infos[0])["error"]
        raise _replay_error(env_cfg, where, "reset", f"an error ({what})")
    if fresh.messages != messages[: len(fresh.messages)]:
        raise _replay_error(env_cfg, where, "reset", "its first messages")
    if getattr(env, "replayable", True) is False:
        call(env.restore, messages, list(e.turn_infos))  # type: ignore[attr-defined]  # the documented hook of a non-replayable environment, outside the Protocol
        return e
    turns = _recorded_turns(messages[len(fresh.messages) :])
    for t, (action, observations) in enumerate(turns):
        result = checked_step_result(
            call(env.step, action), env_name(env), f"{where} turn {t} (replay)"
        )
        if float(result.reward) != e.turn_rewards[t]:
            raise _replay_error(env_cfg, f"{where} turn {t}", "step", "its reward")
        if [dict(m) for m in result.observations] != observations:
            raise _replay_error(env_cfg, f"{where} turn {t}", "step", "its observation")
    return e


def _recorded_turns(messages: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(action, the observation messages after it) per recorded turn."""
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    for m in messages:
        if m["role"] == "assistant":
            turns.append((m["content"], []))
        elif turns:
            turns[-1][1].append(m)
    return turns


def _replay_error(env_cfg: EnvConfig, where: str, method: str, what: str) -> UserError:
    return UserError(
        f"rollout.env.path {env_cfg.path}: replaying the recorded actions after a restart, "
        f"{method} on {where} gave {what} differently from the record: the environment is "
        "not deterministic given its seed; make it so, or declare `replayable = False` and "
        "implement `restore(messages, turn_infos)`"
    )


def _reset(
    env_cfg: EnvConfig,
    tokenizer: Any,
    make_env: Callable[[], Environment],
    p: Prompt,
    k: int,
    seed: int,
    step: int,
) -> Episode:
    """A new episode of sample `k` of `p`, its environment reset. A reset that fails (it
    raises, returns something malformed, or outlives `timeout_s` in a worker) is what a
    failing step is (`_failure`): under `end_episode` the episode ends before its first
    turn, as the task's templated prompt with no response, and the error in
    `turn_infos`."""
    env = make_env()
    task = Task(
        prompt_id=p.prompt_id,
        messages=[dict(m) for m in p.messages],
        answer=p.answer,
        metadata=dict(p.metadata),
    )
    where = f"step {step} prompt_id {p.prompt_id} sample_idx {k} turn 0"
    try:
        answer: Any = call(env.reset, task, seed)
    except UserError:
        # The run's own, not this environment's (as on the step path): a config error, or
        # a worker pool that could not rebuild another environment after a timeout.
        raise
    except Exception as exc:  # the environment's failure (in a worker: EnvFailed/EnvTimeout)
        answer = exc
    error = None
    try:
        if isinstance(answer, BaseException):
            raise answer
        messages, info = checked_reset(answer, env_name(env), where)
    except Exception as exc:  # the declared policy decides (a malformed return too)
        error = _failure(env_cfg, exc, f"{where} (reset)")
        messages, info = [dict(m) for m in p.messages], {}
    # Tool schemas an environment offers go to the template's `tools=` (Hermes/Qwen
    # templates render them into the system turn; others ignore them).
    tools = info.get("tools") or None
    text = template_text(tokenizer, messages, tools)
    e = Episode(
        prompt=p,
        sample_idx=k,
        env=env,
        prompt_ids=text_tokens(tokenizer, text),
        text=text,
        messages=[dict(m) for m in messages],
        tools=tools,
    )
    if error is not None:
        # No turn was taken: no turn offset or reward (the return is 0), but the error
        # is recorded where a turn's error would be.
        e.turn_infos.append(json.dumps({"error": error}))
        e.status = "error"
    return e


def template_text(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    """The chat template's text of `messages`, generation prompt included (an episode's
    and an agent call's, `stages.agents`)."""
    text: str = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return text


def _sampled(tokenizer: Any, eos: set[int], e: Episode, out: Any) -> tuple[str, bool]:
    """Append a turn's sampled tokens; their text (the action) and whether EOS ended them."""
    e.turn_offsets.append(len(e.response))
    e.response += out.tokens
    e.logprobs += out.logprobs
    e.loss_mask += [1] * len(out.tokens)
    e.finish_reason = out.finish_reason
    e.routes = out.routes
    stopped = bool(out.tokens) and out.tokens[-1] in eos
    action = tokenizer.decode(out.tokens[:-1] if stopped else out.tokens, skip_special_tokens=True)
    e.last_action = action
    e.messages.append({"role": "assistant", "content": action})
    return action, stopped


def _answered(
    env_cfg: EnvConfig,
    tokenizer: Any,
    e: Episode,
    action: str,
    stopped: bool,
    answer: Any,
    turn: int,
    step: int,
    images: _EpisodeImages,
) -> None:
    """Take the environment's answer to turn `turn` (or the exception its step raised):
    append its observation's tokens, or end the episode."""
    where = f"step {step} prompt_id {e.prompt.prompt_id} sample_idx {e.sample_idx} turn {turn}"
    try:
        if isinstance(answer, BaseException):
            raise answer
        assert e.env is not None, "a running episode has its environment"
        result = checked_step_result(answer, env_name(e.env), where)
    except Exception as exc:  # the environment's failure: the declared policy decides
        what = _failure(env_cfg, exc, where)
        e.turn_rewards.append(0.0)
        e.turn_infos.append(json.dumps({"error": what}))
        e.status = "error"
        return
    e.turn_rewards.append(float(result.reward))
    info = dict(result.info)
    if result.postprocessed_action is not None:
        info["postprocessed_action"] = result.postprocessed_action
    e.turn_infos.append(json.dumps(info, sort_keys=True, default=str))
    if result.done:
        e.status = "done"
        return
    if turn == env_cfg.max_turns - 1:
        e.status = "max_turns"
        return
    env_ids, text = _observation_tokens(tokenizer, e, action, result, stopped, env_cfg)
    images.check_observation(env_ids, where)
    if len(e.response) + len(env_ids) >= env_cfg.max_total_tokens:
        e.status = "truncated"
        return
    e.response += env_ids
    e.logprobs += [0.0] * len(env_ids)
    e.loss_mask += [0] * len(env_ids)
    e.messages += [dict(m) for m in result.observations]
    e.text = text


def _failure(env_cfg: EnvConfig, exc: Exception, where: str) -> str:
    """An environment call's failure (`reset` or `step` raised, returned something
    malformed, or its worker timed out) under `rollout.env.on_error`: `fail` raises the
    one-line UserError naming the environment and `where`; `end_episode` returns the
    error's text for the episode's record."""
    # A worker's report already reads `Type: message` (the exception in the worker).
    what = str(exc) if isinstance(exc, EnvFailed) else f"{type(exc).__name__}: {exc}"
    if env_cfg.on_error == "fail":
        if isinstance(exc, UserError):
            raise exc
        raise UserError(
            f"rollout.env.path: {env_cfg.path} failed on {where}: {what} "
            "(rollout.env.on_error=fail)"
        ) from exc
    return what


def _observation_tokens(
    tokenizer: Any,
    e: Episode,
    action: str,
    result: StepResult,
    stopped: bool,
    env_cfg: EnvConfig,
) -> tuple[list[int], str]:
    """The tokens after the model's action up to the next generation prompt, and the
    conversation's new template text."""
    history = [*e.messages, *[dict(m) for m in result.observations]]
    text = template_text(tokenizer, history, e.tools)
    where = f"prompt_id {e.prompt.prompt_id}, sample_idx {e.sample_idx}"
    closing = e.response[-1] if stopped else None
    setting = f"rollout.env.path {env_cfg.path}"
    return tokens_after(tokenizer, text, e.text + action, closing, setting, where), text


def tokens_after(
    tokenizer: Any, text: str, head: str, closing: int | None, setting: str, where: str
) -> list[int]:
    """The tokens of template `text` after `head`, the template text the episode holds (an
    environment's observations, an agent call's new messages). `closing`: the sampled EOS
    that ended the last turn, which the template's text repeats. A template that renders
    earlier messages otherwise when messages are added is refused (`setting`, at `where`)."""
    if not text.startswith(head):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise UserError(
            f"{setting}: the chat template of {name} does not keep the conversation's earlier "
            f"text when messages are added ({where}): its prefix is unstable, so the new "
            "messages' tokens cannot be cut from it; use a template that renders earlier "
            "messages unchanged"
        )
    ids = text_tokens(tokenizer, text[len(head) :])
    if closing is not None and ids and ids[0] == closing:
        ids = ids[1:]  # the sampled EOS already closed the assistant turn
    return ids


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """Template text as token ids (the template holds the special tokens itself)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(tokenizer: Any, cfg: RolloutConfig) -> set[int]:
    """Every id that ends a sampled turn: `rollout.eos_token_ids` and the tokenizer's."""
    ids = {int(t) for t in cfg.eos_token_ids}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
