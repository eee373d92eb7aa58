"""Agent episodes (`rollout.agent`): the rollout stage's rows when each episode is a user's
agent program calling the policy through an OpenAI-compatible endpoint.

The stage serves the endpoint (`rftpipe.agents.server`) while it runs and starts one agent
process per episode (`rftpipe.agents.pool`), each with a key that binds its calls to that
episode. Every model call is a turn of the episode (`stages.episodes.Episode`, the same
row columns as an environment's episode):

- **A barrier per call index.** The stage waits until every running episode has made its
  next call or returned, then answers the calls of each engine call group
  (`rollout.groups_per_call` groups) with one engine call, commits the call index for all
  of the rank's episodes (`TurnLog`, as environment turns are committed), and only then
  answers the requests. The engine's batches are therefore the same on any timing and
  after any restart. Call c of sample k of prompt p draws from (run seed, step, stage, p,
  k, c) alone, as turns do.
- **Token-exact.** The first call's messages are rendered with the policy's chat template;
  a later call must extend the previous one: its messages start with the earlier ones and
  the answer as it was returned (tool calls matched by id, name and arguments), and only
  the new messages are rendered, as the template's text after the sampled action (the
  environment episodes' template-delta rule). The sampled tokens are kept as sampled,
  never re-rendered from the parsed tool calls. A call of the token endpoint extends the
  episode when its prompt starts with the episode's tokens.
- **Branches.** A call that does not extend the episode (the agent rewrote or summarised
  its history, a sub-agent's call, or a chat template that renders earlier text otherwise
  once messages follow) starts the episode's next sequence, rendered whole like a first
  call (`rollout.agent.branches=split`; `refuse` answers it with HTTP 400). The episode's
  sequences are consecutive rows (`rftpipe.storage.branch_rows`); every one gets the
  episode's reward and advantage, and its own sampled tokens are its loss mask.
- **Durable call by call.** After a restart the agents of unfinished episodes start again;
  each call the record holds is answered from it when its rendered tokens equal the
  recorded ones, without generating, and the first call past the record is generated with
  its own seed. A call that differs from the record follows `rollout.agent.on_divergence`.
  Episodes that had returned before the kill are not run again. The agent's own side
  effects (files, services) are its business.
- **Reward.** What the agent returns is the episode's environment return (`env_reward`,
  added to the last call's `turn_rewards`); reward functions add to it as for any episode.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from rftpipe.agents.pool import AgentProcesses, AgentSpec, Failed, Finished, Started
from rftpipe.agents.server import Answer, ChatCall, Endpoint, Limits, PendingCall, TokenCall
from rftpipe.config.schema import AgentConfig, RolloutConfig
from rftpipe.data.prompts import Prompt
from rftpipe.engines.rollout.hf import last_token_stops, stop_length
from rftpipe.envs.tools import PARSERS, without_calls
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.faults import fault
from rftpipe.seeding import derive_seed
from rftpipe.stages.episodes import (
    Episode,
    EpisodeOutput,
    TurnLog,
    eos_ids,
    template_text,
    text_tokens,
    tokens_after,
)
from rftpipe.stages.routes import RouteColumn
from rftpipe.storage.routes import ROUTES, RouteShape

log = logging.getLogger(__name__)

_START_S = 300.0
"""How long an episode's agent process may take to start (at the stage's first episodes,
the agents' interpreter importing `openai` and the agent's module), or `timeout_s` if
longer: that start is not the agent's time, and on a loaded node it takes seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentInputs:
    cfg: RolloutConfig
    agent: AgentConfig
    run_seed: int
    step: int
    stage: str
    """The stage name in the seeds."""
    calls: Sequence[Sequence[Prompt]]
    """This rank's prompts, by engine call group (`rollout.groups_per_call` groups each)."""
    resumed: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    """The committed rows of the newest call index before a restart, by (prompt id,
    sample): each episode's sequences in branch order."""
    resumed_turns: int = 0
    """How many call indices those rows hold."""
    samples: Sequence[int] | None = None
    """The sample indices of each prompt's episodes (None: `range(cfg.n)`)."""
    greedy_samples: frozenset[int] = frozenset()
    """The sample indices whose every call is answered with the greedy continuation
    (held-out evaluation's greedy episode, -1): no draws, so no call seeds."""
    route_shape: RouteShape | None = None
    """An MoE policy's under R3: the record's routes are read back, answered calls take
    theirs and replayed calls force them (None: no routes)."""


@dataclass(frozen=True, slots=True)
class AgentStats:
    """What the stage's metrics report besides the rows (never part of them: a resumed run's
    rows equal an uninterrupted run's)."""

    agent_s: float
    """Seconds from the agents' start to their last return (rank's)."""
    from_record: int
    """Calls answered from the committed record after a restart."""
    engine_calls: list[int]
    """Engine calls made at each call index this process ran."""


@dataclass(slots=True)
class _Live:
    """An episode while its agent runs."""

    e: Episode
    group: int
    """Its engine call group (index into `AgentInputs.calls`)."""
    record: list[_Recorded]
    """The committed calls a restart answers from, in call order (empty: none)."""
    convo: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as the agent sees it: the last call's messages and the answer,
    normalised for comparison (`_norm`)."""
    render: list[dict[str, Any]] = field(default_factory=list)
    """The same conversation as the template renders it: each answer as its sampled text."""
    calls: int = 0
    """Calls answered so far."""
    kind: str = "chat"
    """Which endpoint its calls use (`chat` or `tokens`): one per episode."""
    pending: PendingCall | None = None
    pending_ids: list[int] | None = None
    """The pending call's whole prompt (the episode's tokens plus the new ones)."""
    pending_starts: bool = False
    """The pending call starts a sequence of the episode (its first call, or a branch)."""
    pending_text: str = ""
    """A pending chat call's prompt as the template's text (the episode's `text` once
    answered)."""
    deadline: float = 0.0
    """When the agent must have called or returned (it is not waiting for the model), or,
    before it is `started`, when its process must have started."""
    started: bool = False
    """Its process runs (the pool's `Started` came)."""
    session: int = -1
    """The engine's kept cache its rows are in (`_Server.keys_for`; -1: none)."""
    held: list[int] | None = None
    """The prompt of its last engine call, which that cache holds."""
    ended: bool = False
    """Its agent returned (or failed, or was killed)."""


def run(
    inp: AgentInputs, engine: Any, tokenizer: Any, turns: TurnLog
) -> tuple[EpisodeOutput, AgentStats]:
    """Every episode of this rank's calls, `cfg.n` samples of each prompt: each an agent
    process, all served together call index by call index, each index committed through
    `turns` before its answers go out."""
    acfg = inp.agent
    inbox: queue.Queue[Any] = queue.Queue()
    endpoint = Endpoint(
        model=acfg.model,
        inbox=inbox,
        limits=Limits(
            max_body_bytes=acfg.max_body_bytes,
            max_messages=acfg.max_messages,
            max_tokens=acfg.max_total_tokens,
            max_n=1,
        ),
        host=acfg.host,
    )
    pool = AgentProcesses(
        AgentSpec(path=acfg.path, kwargs=dict(acfg.kwargs), python=acfg.python), inbox
    )
    server = _Server(inp, engine, tokenizer, endpoint, pool, inbox)
    t0 = time.perf_counter()
    try:
        endpoint.start()
        server.replay()
        server.start_all()
        turn = inp.resumed_turns
        while True:
            server.gather()
            pending = [lv for lv in server.live if lv.pending is not None]
            if not turns.any(bool(pending)):
                break
            events().write("agent_call_begin", step=inp.step, stage=inp.stage, call=turn)
            answers = server.generate(pending, turn)
            fault("agent_before_call_commit")
            turns.commit(turn + 1, [lv.e for lv in server.live])
            fault("agent_after_call_commit")
            for lv, a in zip(pending, answers, strict=True):
                server.answered(lv, a)
            turn += 1
    finally:
        pool.close()
        endpoint.stop()
        engine.end_episodes(server.keys_used)
    stats = AgentStats(
        agent_s=time.perf_counter() - t0,
        from_record=server.from_record,
        engine_calls=server.engine_calls,
    )
    return EpisodeOutput(episodes=[lv.e for lv in server.live], env_s=stats.agent_s), stats


class _Server:
    """The stage's side of the endpoint: episodes, their calls and their agents."""

    def __init__(
        self,
        inp: AgentInputs,
        engine: Any,
        tokenizer: Any,
        endpoint: Endpoint,
        pool: AgentProcesses,
        inbox: queue.Queue[Any],
    ) -> None:
        self.inp, self.engine, self.tokenizer = inp, engine, tokenizer
        self.endpoint, self.pool, self.inbox = endpoint, pool, inbox
        self.acfg = inp.agent
        self.start_s = max(_START_S, self.acfg.timeout_s)
        """How long an episode's process may take to start (`_START_S`)."""
        self.eos = eos_ids(tokenizer, inp.cfg)
        self.decode = partial(tokenizer.decode, skip_special_tokens=False)
        """What stop strings are found in (the engine's own decode)."""
        self.parse = PARSERS[self.acfg.tool_parser]
        self.live: list[_Live] = []
        self.from_record = 0
        self.engine_calls: list[int] = []
        self.sessions: dict[int, int] = {}
        """Each call group's current kept cache (`keys_for`)."""
        self.caches = 0
        """Kept caches opened so far (the next one's id)."""
        self.keys_used: set[tuple[int, int]] = set()
        """Every engine key given, (slot, cache id): freed at the stage's end."""
        for g, prompts in enumerate(inp.calls):
            for p in prompts:
                for k in range(inp.cfg.n) if inp.samples is None else inp.samples:
                    rows = inp.resumed.get((p.prompt_id, k), ())
                    e = Episode(
                        prompt=p,
                        sample_idx=k,
                        env=None,
                        prompt_ids=list(p.token_ids),
                        text="",
                        messages=[dict(m) for m in p.messages],
                        slot=len(self.live),
                        greedy=k in inp.greedy_samples,
                    )
                    routes = _row_routes(rows, inp.route_shape)
                    lv = _Live(e=e, group=g, record=_recorded(rows, self.eos, routes))
                    if rows and rows[-1]["episode_status"] is not None:
                        # It had returned before the restart: the record is the episode.
                        _restore_ended(e, rows, routes)
                        lv.ended = True
                    self.live.append(lv)

    # -- agents -------------------------------------------------------------------------
    def start_all(self) -> None:
        now = time.monotonic()
        for lv in self.live:
            if lv.ended:
                continue
            p = lv.e.prompt
            task = {
                "prompt_id": p.prompt_id,
                "sample_idx": lv.e.sample_idx,
                "messages": [dict(m) for m in p.messages],
                "answer": p.answer,
                "metadata": dict(p.metadata),
            }
            key = self.endpoint.open_episode(lv.e.slot)
            self.pool.start(lv.e.slot, task, self.endpoint.base_url, key, self.acfg.model)
            lv.deadline = now + self.start_s

    def gather(self) -> None:
        """Wait until every running episode has a call pending or has ended; calls the
        record holds are answered on the way."""
        while waiting := [lv for lv in self.live if not lv.ended and lv.pending is None]:
            left = min(lv.deadline for lv in waiting) - time.monotonic()
            try:
                item = self.inbox.get(timeout=max(0.0, left))
            except queue.Empty:
                now = time.monotonic()
                for lv in waiting:
                    if lv.deadline > now:
                        continue
                    self.pool.kill(lv.e.slot)
                    if lv.started:
                        self._failed(lv, f"took over rollout.agent.timeout_s={self.acfg.timeout_s}")
                    else:
                        self._failed(lv, f"its agent process did not start in {self.start_s:g} s")
                continue
            if isinstance(item, Started):
                lv = self.live[item.episode]
                lv.started = True
                if not lv.ended and lv.pending is None and lv.calls == 0:
                    lv.deadline = time.monotonic() + self.acfg.timeout_s  # its clock starts
            elif isinstance(item, PendingCall):
                self._call(item)
            elif isinstance(item, Finished):
                self._finished(self.live[item.episode], item)
            elif isinstance(item, Failed):
                lv = self.live[item.episode]
                if item.kind in ("import", "not_async"):
                    raise UserError(f"rollout.agent.path {self.acfg.path}: {item.message}")
                self._failed(lv, item.message)

    def _where(self, lv: _Live) -> str:
        e = lv.e
        return (
            f"step {self.inp.step} prompt_id {e.prompt.prompt_id} sample_idx {e.sample_idx} "
            f"call {lv.calls}"
        )

    def _finished(self, lv: _Live, item: Finished) -> None:
        if lv.ended:
            return
        lv.ended = True
        self.endpoint.close_episode(lv.e.slot)
        e = lv.e
        if e.status is None:
            e.status = "done"
        if e.turn_rewards:
            e.turn_rewards[-1] += float(item.reward)
        else:
            e.turn_rewards.append(float(item.reward))
        if item.info:
            info = json.loads(e.turn_infos[-1]) if e.turn_infos else {}
            info["agent_info"] = item.info
            text = json.dumps(info, sort_keys=True, default=str)
            if e.turn_infos:
                e.turn_infos[-1] = text
            else:
                e.turn_infos.append(text)

    def _failed(self, lv: _Live, message: str) -> None:
        if lv.ended:
            return
        where = self._where(lv)
        if lv.e.status is not None:
            # It raised on the refusal of a call past its budget: the episode ended there,
            # with what it had (reward 0), whatever `on_error` says.
            lv.ended = True
            self.endpoint.close_episode(lv.e.slot)
            lv.e.turn_infos.append(json.dumps({"error": message, "call": lv.calls}))
            lv.e.turn_rewards.append(0.0)
            return
        if self.acfg.on_error == "fail":
            raise UserError(
                f"rollout.agent.path {self.acfg.path} failed on {where}: {message} "
                "(rollout.agent.on_error=fail)"
            )
        lv.ended = True
        self.endpoint.close_episode(lv.e.slot)
        e = lv.e
        e.status = "error"
        e.turn_infos.append(json.dumps({"error": message, "call": lv.calls}))
        if len(e.turn_rewards) < len(e.turn_infos):
            e.turn_rewards.append(0.0)

    # -- calls --------------------------------------------------------------------------
    def _call(self, pc: PendingCall) -> None:
        lv = self.live[int(pc.episode)]  # type: ignore[call-overload]  # keys are opened for slots
        e = lv.e
        if lv.ended or e.status is not None:
            pc.refuse(400, f"the episode has ended ({e.status or 'returned'})")
            return
        kind = "chat" if isinstance(pc.call, ChatCall) else "tokens"
        if lv.calls >= self.acfg.max_calls:
            self._refuse(lv, pc, "max_turns", f"rollout.agent.max_calls={self.acfg.max_calls}")
            return
        try:
            if lv.calls and kind != lv.kind:
                raise _Refused(f"a {kind} call after {lv.kind} calls: an episode uses one endpoint")
            ids, render, convo, lv.pending_text, starts = self._render(lv, pc.call)
        except _Refused as exc:
            pc.refuse(400, str(exc))
            lv.deadline = time.monotonic() + self.acfg.timeout_s
            return
        lv.kind = kind
        if lv.calls < len(lv.record) and self._from_record(lv, pc, ids, render, convo, starts):
            return
        if not starts and len(ids) - len(e.prompt_ids) >= self.acfg.max_total_tokens:
            limit = f"rollout.agent.max_total_tokens={self.acfg.max_total_tokens}"
            self._refuse(lv, pc, "truncated", limit)
            return
        lv.pending, lv.pending_ids, lv.pending_starts = pc, ids, starts
        lv.render, lv.convo = render, convo

    def _refuse(self, lv: _Live, pc: PendingCall, status: str, limit: str) -> None:
        """End the episode at a budget: its call is refused (HTTP 400) and what the agent
        then returns (or raises) ends it."""
        lv.e.status = status
        pc.refuse(400, f"{limit} reached: the episode ends here")
        lv.deadline = time.monotonic() + self.acfg.timeout_s

    def _render(
        self, lv: _Live, call: ChatCall | TokenCall
    ) -> tuple[list[int], list[dict[str, Any]], list[dict[str, Any]], str, bool]:
        """The call's whole prompt in tokens, the conversation as rendered and as the
        agent sees it, the prompt's template text (a token call's: the episode's, as it
        was), and whether the call starts a sequence: the episode's first call, or one that
        does not extend the episode's tokens (a branch; `_Refused` under `branches=refuse`)."""
        e = lv.e
        if isinstance(call, TokenCall):
            ids = list(call.prompt_token_ids)
            starts = not lv.calls or (
                ids[: len(e.prompt_ids) + len(e.response)] != e.prompt_ids + e.response
            )
            if starts and lv.calls:
                self._branch_allowed(lv, "prompt_token_ids do not extend the episode's tokens")
            return ids, lv.render, lv.convo, e.text, starts
        convo = [_norm(m) for m in call.messages]
        head = e.text + e.last_action
        if lv.calls and convo[: len(lv.convo)] == lv.convo:
            render = [*lv.render, *(_for_template(m) for m in call.messages[len(lv.convo) :])]
            text = template_text(self.tokenizer, render, call.tools or None)
            if text.startswith(head) or self.acfg.branches == "refuse":
                stopped = bool(e.response) and e.response[-1] in self.eos
                closing = e.response[-1] if stopped else None
                setting = f"rollout.agent.path {self.acfg.path}"
                # Under `refuse`, a template that rewrites earlier text stops the run here,
                # as an environment episode's does.
                new = tokens_after(self.tokenizer, text, head, closing, setting, self._where(lv))
                return e.prompt_ids + e.response + new, render, convo, text, False
            # The template renders the earlier messages otherwise once these follow.
        elif lv.calls:
            self._branch_allowed(
                lv,
                f"the messages do not extend the episode's call {lv.calls - 1} and its answer "
                "(a rewritten history)",
            )
        render = [_for_template(m) for m in call.messages]
        text = template_text(self.tokenizer, render, call.tools or None)
        return text_tokens(self.tokenizer, text), render, convo, text, True

    def _branch_allowed(self, lv: _Live, why: str) -> None:
        if self.acfg.branches == "refuse":
            raise _Refused(f"{why}: a new sequence of the episode (rollout.agent.branches=refuse)")

    def _from_record(
        self,
        lv: _Live,
        pc: PendingCall,
        ids: list[int],
        render: list[dict[str, Any]],
        convo: list[dict[str, Any]],
        starts: bool,
    ) -> bool:
        """Answer call `lv.calls` from the record if the agent asked what it asked before
        the restart; under `on_divergence=discard` a differing call drops the record from
        here on (False: generate it)."""
        rec = lv.record[lv.calls]
        if ids != rec.prompt or starts != rec.starts:
            if self.acfg.on_divergence == "fail":
                raise UserError(
                    f"rollout.agent.path {self.acfg.path}: after a restart the agent's call "
                    f"differs from the committed record ({self._where(lv)}): the agent is not "
                    "deterministic given its task and answers; make it so, or set "
                    "rollout.agent.on_divergence=discard"
                )
            lv.record = []
            events().write("agent_divergence", step=self.inp.step, call=lv.calls, slot=lv.e.slot)
            return False
        lv.pending_ids, lv.pending_starts, lv.render, lv.convo = ids, starts, render, convo
        a = self._take(lv, pc.call, list(rec.tokens), list(rec.logprobs), rec.reason, rec.routes)
        self.from_record += 1
        self.answered(lv, a, pc)
        return True

    def keys_for(self, group: int, rows: list[_Live], prompts: list[list[int]]) -> list | None:
        """The engine keys of one call group's sampled rows (None: the engine keeps no
        cache). They continue the group's kept cache when every row's prompt extends what
        its row of that cache holds; otherwise (an episode starts a sequence, or diverged
        from the record) the call starts a new cache under new keys. A function of the
        rows' prompts alone, so `replay` rebuilds the same caches from the record."""
        if not self.engine.continues_turns:
            return None
        sid = self.sessions.get(group)
        extends = sid is not None and all(
            lv.session == sid
            and lv.held is not None
            and len(p) > len(lv.held)
            and p[: len(lv.held)] == lv.held
            for lv, p in zip(rows, prompts, strict=True)
        )
        if sid is None or not extends:
            if sid is not None:
                # Its rows' cache is not continued by any later call.
                self.engine.end_episodes([k for k in self.keys_used if k[1] == sid])
            sid = self.sessions[group] = self.caches
            self.caches += 1
        keys = [(lv.e.slot, sid) for lv in rows]
        for lv, p in zip(rows, prompts, strict=True):
            lv.session, lv.held = sid, list(p)
        self.keys_used.update(keys)
        return keys

    def replay(self) -> None:
        """After a restart, rebuild the engine's kept caches: each committed call index's
        engine calls again, with the rows they had (the episodes that made that call) and
        their prompts then, prefilled and not sampled."""
        for c in range(self.inp.resumed_turns):
            for g in range(len(self.inp.calls)):
                rows = [
                    lv
                    for lv in self.live
                    if lv.group == g and len(lv.record) > c and not lv.e.greedy
                ]
                if not rows:
                    continue
                prompts = [lv.record[c].prompt for lv in rows]
                keys = self.keys_for(g, rows, prompts)
                if keys is None:
                    return
                known = [lv.record[c].known() for lv in rows]
                self.engine.generate_rows(
                    prompts, [0] * len(rows), [0] * len(rows), keys=keys, routes=known
                )

    def generate(self, pending: list[_Live], turn: int) -> list[Answer]:
        """Call index `turn` of the pending episodes: one engine call per call group (and
        one more for its greedy episodes, if any)."""
        cfg = self.inp.cfg
        by_group: dict[int, list[_Live]] = {}
        for lv in pending:
            by_group.setdefault(lv.group, []).append(lv)
        got: dict[int, Answer] = {}
        calls = 0
        for g in sorted(by_group):
            rows = by_group[g]
            limits = []
            for lv in rows:
                assert lv.pending is not None and lv.pending_ids is not None
                used = 0 if lv.pending_starts else len(lv.pending_ids) - len(lv.e.prompt_ids)
                asked = lv.pending.call.max_tokens or cfg.max_new_tokens
                limits.append(
                    max(0, min(cfg.max_new_tokens, asked, self.acfg.max_total_tokens - used))
                )
            outs: dict[int, Any] = {}
            sampled = [i for i, lv in enumerate(rows) if not lv.e.greedy]
            greedy = [i for i, lv in enumerate(rows) if lv.e.greedy]
            if sampled:
                prompts = [list(rows[i].pending_ids or []) for i in sampled]
                got_rows = self.engine.generate_rows(
                    prompts,
                    [self._seed(rows[i]) for i in sampled],
                    [limits[i] for i in sampled],
                    keys=self.keys_for(g, [rows[i] for i in sampled], prompts),
                    # A call that starts a sequence is prefilled whole, routed afresh.
                    routes=[None if rows[i].pending_starts else rows[i].e.routes for i in sampled],
                )
                outs.update(zip(sampled, got_rows, strict=True))
                calls += 1
            if greedy:
                got_rows = self.engine.greedy_rows(
                    [rows[i].pending_ids for i in greedy], [limits[i] for i in greedy]
                )
                outs.update(zip(greedy, got_rows, strict=True))
                calls += 1
            fault("agent_mid_call")
            for lv, out in zip(rows, (outs[i] for i in range(len(rows))), strict=True):
                assert lv.pending is not None
                tokens, logprobs, reason = list(out.tokens), list(out.logprobs), out.finish_reason
                # The request's stop strings: the tokens after the one that completes one
                # were never needed (each token depends on those before it alone), so
                # ending there is having stopped there.
                stop = lv.pending.call.stop
                k = stop_length(self.decode, tokens, stop) if stop else 0
                if k and last_token_stops(self.decode, tokens[:k], stop):
                    tokens, logprobs, reason = tokens[:k], logprobs[:k], "stop"
                got[lv.e.slot] = self._take(
                    lv, lv.pending.call, tokens, logprobs, reason, out.routes
                )
        self.engine_calls.append(calls)
        return [got[lv.e.slot] for lv in pending]

    def _seed(self, lv: _Live) -> int:
        e = lv.e
        return derive_seed(
            self.inp.run_seed,
            self.inp.step,
            self.inp.stage,
            f"{e.prompt.prompt_id}/{e.sample_idx}/{lv.calls}",
        )

    def _take(
        self,
        lv: _Live,
        call: ChatCall | TokenCall,
        tokens: list[int],
        logprobs: list[float],
        reason: str,
        routes: torch.Tensor | None = None,
    ) -> Answer:
        """Append call `lv.calls`'s sampled tokens (after the new prompt tokens) to the
        episode, and the answer they make. `routes`: the call's (R3), over its prompt and
        the tokens the engine sampled but the last."""
        e = lv.e
        ids = lv.pending_ids
        assert ids is not None
        _append_call(e, ids, lv.pending_starts, lv.calls > 0, tokens, logprobs, routes)
        e.finish_reason = reason
        stopped = bool(tokens) and tokens[-1] in self.eos
        action = self.tokenizer.decode(tokens[:-1] if stopped else tokens, skip_special_tokens=True)
        if isinstance(call, ChatCall):
            e.text = lv.pending_text  # rendered by `_render`
        # The sampled text, stop string included, is the episode's (its template text);
        # the agent is answered without the stop string, as OpenAI's API answers.
        e.last_action = action
        shown = action
        if call.stop and tokens and last_token_stops(self.decode, tokens, call.stop):
            stopped = True
            shown = action[: min(i for s in call.stop if (i := action.find(s)) >= 0)]
        # A malformed call comes back as no calls (and why), so the answer is its text.
        calls, _ = self.parse(shown) if isinstance(call, ChatCall) else ([], None)
        tool_calls = [
            (f"call_{lv.calls}_{j}", c.name, json.dumps(c.arguments, ensure_ascii=False))
            for j, c in enumerate(calls)
        ]
        content = without_calls(shown, self.acfg.tool_parser) if tool_calls else shown
        finish = "tool_calls" if tool_calls else ("stop" if stopped else "length")
        answer = Answer(
            prompt_token_ids=list(ids),
            token_ids=list(tokens),
            logprobs=list(logprobs),
            token_texts=[self.tokenizer.decode([t]) for t in tokens] if call.logprobs else [],
            text=shown,
            content=content or (None if tool_calls else ""),
            tool_calls=tool_calls,
            finish_reason=finish,
        )
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in tool_calls
            ]
        if isinstance(call, ChatCall):
            lv.convo = [*lv.convo, _norm(message)]
            lv.render = [*lv.render, {"role": "assistant", "content": action}]
            e.messages = [*call.messages, message]
        e.turn_rewards.append(0.0)
        e.turn_infos.append(
            json.dumps(
                {
                    "kind": "chat" if isinstance(call, ChatCall) else "tokens",
                    # Names, as environments report them (`episode/tool_calls_mean`).
                    "tool_calls": [name for _, name, _ in tool_calls],
                },
                sort_keys=True,
            )
        )
        return answer

    def answered(self, lv: _Live, a: Answer, pc: PendingCall | None = None) -> None:
        """Send the answer and start the agent's clock again."""
        pc = pc or lv.pending
        assert pc is not None
        lv.calls += 1
        lv.pending, lv.pending_ids, lv.pending_starts = None, None, False
        lv.deadline = time.monotonic() + self.acfg.timeout_s
        pc.answer(a)


def _append_call(
    e: Episode,
    ids: list[int],
    starts: bool,
    earlier: bool,
    tokens: list[int],
    logprobs: list[float],
    routes: torch.Tensor | None,
) -> None:
    """Append a call's prompt `ids` (what they add to the episode's tokens; a new sequence
    when the call `starts` one, closing the current one if there were `earlier` calls) and
    its sampled tokens."""
    if starts:
        if earlier:
            _close_sequence(e)
        e.prompt_ids = list(ids)
    else:
        new = ids[len(e.prompt_ids) + len(e.response) :]
        e.response += new
        e.logprobs += [0.0] * len(new)
        e.loss_mask += [0] * len(new)
    e.turn_offsets.append(len(e.response))
    e.response += tokens
    e.logprobs += logprobs
    e.loss_mask += [1] * len(tokens)
    # Up to the last token kept: a stop string cut the tokens after it off, and the next
    # call feeds other tokens there.
    fed = len(ids) + len(tokens) - 1 if tokens else len(ids)
    e.routes = None if routes is None else routes[:fed]


class _Refused(Exception):
    """A call the endpoint answers with HTTP 400 (the message says why)."""


@dataclass(frozen=True, slots=True)
class _Recorded:
    """A committed call: what its prompt was and what it was answered with."""

    starts: bool
    """It started a sequence of the episode (its first call, or a branch)."""
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    reason: str
    routes: torch.Tensor | None = None
    """Its sequence's routes through this call (R3; None: none recorded)."""

    def known(self) -> torch.Tensor | None:
        """The routes its prompt's prefill forces when replayed."""
        return None if self.routes is None else self.routes[: len(self.prompt)]


def _row_routes(
    rows: Sequence[Mapping[str, Any]], shape: RouteShape | None
) -> list[torch.Tensor | None]:
    """Each committed sequence's routes (None each without `shape`)."""
    if shape is None:
        return [None] * len(rows)
    return RouteColumn(column=ROUTES, shape=shape).of(rows)


def _recorded(
    rows: Sequence[Mapping[str, Any]], eos: set[int], routes: Sequence[torch.Tensor | None]
) -> list[_Recorded]:
    """An episode's committed calls, in call order, from its rows (its sequences)."""
    out = []
    for row, seq_routes in zip(rows, routes, strict=True):
        offsets = list(row["turn_offsets"])
        response = list(row["response_token_ids"])
        mask = list(row["loss_mask"])
        logprobs = [float(x) for x in row["logprobs"]]
        for t, start in enumerate(offsets):
            end = start
            while end < len(mask) and mask[end] == 1:
                end += 1
            tokens = response[start:end]
            reason = (
                str(row["finish_reason"])
                if end == len(response)
                else ("stop" if tokens and tokens[-1] in eos else "length")
            )
            prompt = list(row["prompt_token_ids"]) + response[:start]
            fed = len(prompt) + len(tokens) - 1 if tokens else len(prompt)
            mine = None if seq_routes is None else seq_routes[:fed]
            out.append(_Recorded(t == 0, prompt, tokens, logprobs[start:end], reason, mine))
    return out


def _close_sequence(e: Episode) -> None:
    """The episode's current sequence becomes one of its earlier ones (`branches`); the
    next call's tokens start a new one."""
    e.branches.append(replace(e, branches=[]))
    e.routes = None
    e.response, e.logprobs, e.loss_mask = [], [], []
    e.turn_offsets, e.turn_rewards, e.turn_infos = [], [], []
    e.finish_reason, e.last_action = "length", ""


def _restore_ended(
    e: Episode, rows: Sequence[Mapping[str, Any]], routes: Sequence[torch.Tensor | None]
) -> None:
    """An episode that had returned before the restart, from its rows."""
    for row, seq_routes in zip(rows[:-1], routes[:-1], strict=True):
        _restore_sequence(e, row)
        e.routes = seq_routes
        _close_sequence(e)
    _restore_sequence(e, rows[-1])
    e.routes = routes[-1]
    e.status = rows[-1]["episode_status"]


def _restore_sequence(e: Episode, row: Mapping[str, Any]) -> None:
    e.prompt_ids = list(row["prompt_token_ids"])
    e.messages = json.loads(row["messages"])
    e.response = list(row["response_token_ids"])
    e.logprobs = [float(x) for x in row["logprobs"]]
    e.loss_mask = list(row["loss_mask"])
    e.turn_offsets = list(row["turn_offsets"])
    e.turn_rewards = list(row["turn_rewards"])
    e.turn_infos = list(row["turn_infos"])
    e.finish_reason = row["finish_reason"]
    e.last_action = row["response"]


def _text(content: Any) -> str:
    """A message's content as text (text parts joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))


def _norm(m: Mapping[str, Any]) -> dict[str, Any]:
    """What must be equal for a later call to extend an earlier one: role, content as text,
    tool calls by id, name and arguments, a tool message's call id and name."""
    out: dict[str, Any] = {"role": m.get("role"), "content": _text(m.get("content"))}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            (c.get("id"), c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _for_template(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the chat template gets it: text content (parts joined)."""
    out = {k: v for k, v in m.items() if k != "content" and v is not None}
    out["content"] = _text(m.get("content"))
    return out
