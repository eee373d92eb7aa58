"""`rollout.agent`: an agent program, run unchanged, whose calls to the policy through an
OpenAI-compatible endpoint are the turns of an episode."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rftpipe.config.env import ToolParserName

#: What `rollout.agent.path` may look like: an async function by import path.
_AGENT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """An agent program the policy is trained in, unchanged (`rftpipe.agents`): each episode
    runs `async def fn(task, client, model, **kwargs)` in a process of its own, with an
    `openai.AsyncOpenAI` client whose key binds its calls to that episode, against the
    OpenAI-compatible endpoint the rollout stage serves; every model call is a turn of the
    episode, and what `fn` returns is its reward. docs/agents.md."""

    path: str
    """The agent: `pkg.mod:fn`, an `async def fn(task: dict, client, model: str, **kwargs)`
    returning the episode's reward (a number) or `rftpipe.agents.AgentResult` (or a dict
    with `reward` and `info`). `task` holds the prompt's `prompt_id`, `messages`, `answer`
    and `metadata`."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the agent function (JSON values)."""

    python: str | None = None
    """The interpreter agent processes run under (unset: the run's own). Another one keeps
    an agent's dependencies apart from the trainer's: it gets the run's source directories
    on its path but not the run's installed packages, and needs `openai` installed."""

    timeout_s: float = 60.0
    """Longest an agent may take between an answer and its next call (or its return), and
    to make its first call: past it the agent's process group is killed and the episode
    fails as `on_error` says. Time spent waiting for the model does not count, nor does
    its process's start (the agents' interpreter importing its module: up to 300 s)."""

    max_calls: int = 4
    """Most model calls in one episode; the call past it is refused (HTTP 400) and the
    episode ends as `max_turns` with the reward the agent returns."""

    max_total_tokens: int = 1024
    """Most tokens after the first call's prompt in an episode's sequence (the model's and
    the agent's messages' together); a call that would pass it is cut or refused and the
    episode ends as `truncated`."""

    tool_parser: ToolParserName = "hermes"
    """How tool calls are read from a response into the answer's `tool_calls`."""

    on_error: Literal["fail", "end_episode"] = "fail"
    """An agent that raises, returns something other than a reward, dies or outlives
    `timeout_s`: `fail` stops the run (exit 2, naming step, prompt, sample and call),
    `end_episode` ends that episode as `error` with reward 0 and records the error."""

    on_divergence: Literal["fail", "discard"] = "fail"
    """A resumed episode's agent whose call differs from the committed record (a
    nondeterministic agent): `fail` stops the run with one line naming the episode and
    call; `discard` drops the record from that call on and generates afresh."""

    branches: Literal["split", "refuse"] = "split"
    """A call that does not extend its episode's tokens (the agent rewrote or summarised
    its history, or the chat template renders earlier messages otherwise once more follow):
    `split` starts the episode's next sequence (another row, with the episode's reward and
    advantage: a sequence-level `advantage.estimator` and no `kl.mode=reward`, checked at
    load); `refuse` answers it with HTTP 400 (a template that rewrites earlier text then
    stops the run)."""

    keep_kv_cache: bool = True
    """Keep each running episode's KV cache from one call to the next (the HF loop), so a
    call that extends its episode prefills only the tokens added since (the last answer
    and the agent's new messages), not the whole conversation; a call group in which some
    episode starts a sequence (or diverged from the record) prefills whole and keeps that.
    The caches hold every running episode of the rank at once; false prefills the whole
    prompt at every call. Either way a resumed run is bitwise the uninterrupted one; the
    two differ in float rounding, so a resume refuses a change of it."""

    model: str = "policy"
    """The model name the endpoint serves (another is a 404) and the agent is given."""

    host: str = "127.0.0.1"
    """Where the endpoint listens (a free port is chosen when it starts)."""

    max_body_bytes: int = 1 << 20
    """Largest request body the endpoint reads (larger: HTTP 413)."""

    max_messages: int = 256
    """Most messages in one call (more: HTTP 400)."""

    def __post_init__(self) -> None:
        if not _AGENT_PATH.match(self.path):
            raise ValueError(f"path must be 'pkg.mod:fn', got {self.path!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {self.max_calls}")
        if self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {self.max_messages}")
        if not self.model:
            raise ValueError("model must not be empty")
