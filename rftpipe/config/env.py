"""`rollout.env`: a multi-turn environment the policy talks to in each episode, and the
tool-call parsers (`ToolParserName`) that it and `rollout.agent` read responses with."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

ToolParserName = Literal["hermes", "plain"]
"""The tool-call parsers `rollout.env.tool_parser` takes (`rftpipe.envs.tools.PARSERS`)."""


#: What `rollout.env.path` may look like: a class by import path, a registered skyrl-gym
#: environment id or a skyrl-gym environment class by import path, or a TRL-style
#: environment class by import path.
_ENV_PATH = re.compile(r"^(skyrl:[^:\s]+|(skyrl:|trl:)?[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvConfig:
    """A multi-turn environment the policy talks to (`rftpipe.envs`): after each response
    the environment answers with messages (tool results, feedback) and a reward, until it
    is done or `max_turns` responses were generated."""

    path: str
    """The environment: `pkg.mod:Class` (a class with `reset(task, seed)` and `step(text)`),
    `skyrl:<env_id>` (an environment registered with skyrl-gym, e.g.
    `skyrl:gsm8k_multi_turn`), `skyrl:pkg.mod:Class` (one's own skyrl-gym environment
    class, e.g. a `BaseTextEnv` subclass, imported by path in the run and in every
    environment worker) or `trl:pkg.mod:Class` (a TRL-style environment class whose public
    methods are the tools). A dataset row's `env_class` column, when it has one, names
    the environment of that row's episodes instead (docs/environments.md)."""

    max_turns: int = 4
    """Most policy responses in one episode; the episode ends after that many even if the
    environment is not done."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor (for `skyrl:` ids, the
    environment's `env_config`)."""

    workers: int = 2
    """Worker processes holding the episodes' environments (each holds many); a turn's
    steps run in them concurrently, each under `timeout_s`. 0: in the rollout process,
    one step after another, with no timeout (a hung environment hangs the run)."""

    timeout_s: float = 60.0
    """Longest environment call (make, reset, step, close) in a worker: past it the worker
    is killed, its other environments are rebuilt in a new one by replaying their actions,
    and the call fails as `on_error` says."""

    max_total_tokens: int = 1024
    """Most response tokens of an episode, the model's and the environment's together (the
    prompt not counted); each turn samples at most `rollout.max_new_tokens` of what is
    left. A turn cut by it, or an observation that would not fit (it is then not
    appended), ends the episode as `truncated`."""

    tool_parser: ToolParserName = "hermes"
    """How tool calls are read from a response: `hermes` (`<tool_call>{json}</tool_call>`
    blocks, Hermes/Qwen chat models) or `plain` (lines `CALL name(arg=value, ...)`, for a
    model without tool support; `rftpipe.envs.tools.render_plain_tools` describes it)."""

    on_error: Literal["fail", "end_episode"] = "fail"
    """What an environment whose `reset` or `step` raises, returns something malformed or
    outlives `timeout_s` does: `fail` stops the run (exit 2, naming the environment and the
    sample), `end_episode` ends that episode with the reward it had so far (none after a
    failed reset: an empty response) and records the error."""

    keep_kv_cache: bool = True
    """`rollout.engine=hf`: keep each running episode's KV cache from one turn to the
    next, so a turn prefills only the tokens added since (the last action and the
    environment's answer), not the whole conversation. The kept caches hold every running
    episode of the rank at once (about its history's length each); false prefills the
    whole history at every turn and holds one engine call's rows at a time. Either way a
    resumed run is bitwise the uninterrupted one; the two differ in float rounding, so a
    resume refuses a change of it. vLLM's prefix cache does this by itself."""

    def __post_init__(self) -> None:
        if not _ENV_PATH.match(self.path):
            raise ValueError(
                "path must be 'pkg.mod:Class', 'skyrl:<env_id>', 'skyrl:pkg.mod:Class' or "
                f"'trl:pkg.mod:Class', got {self.path!r}"
            )
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
