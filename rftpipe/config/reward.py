"""The `reward` section: the reward components (built-ins, import-path functions in their
calling conventions, reward models, a reward server) and how scoring runs and fails."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

RewardSignature = Literal["rftpipe", "verl", "trl"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardModelConfig:
    """A sequence-classification reward model: the `model` of a `reward.functions` entry
    whose path is `reward_model`. Loaded once per rank at start-up, it scores a shard's
    rows in batches under no_grad in eval mode; the score of a row is
    `scale * logit + shift`, the logit its single label's at the last real token."""

    path: str
    """Local HF directory of an `AutoModelForSequenceClassification` with one label
    (`num_labels: 1`) and its tokenizer, or `builtin:tiny-reward` (a seeded random-init
    one sharing `builtin:tiny`'s tokenizer, for tests)."""

    batch_size: int = 8
    """Rows per forward; rows are right-padded, so it changes no score (to float rounding)."""

    max_length: int = 1024
    """Tokens of the templated prompt + response the model sees at most; longer texts are
    truncated on `truncation_side`."""

    truncation_side: Literal["left", "right"] = "left"
    """Which end a too-long text loses. `left` (the default) cuts the start of the prompt
    and keeps the response's end, the token whose logit is the score; `right` keeps the
    prompt and cuts the response's end."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute dtype: float32 (CPU and GPU), or bfloat16 to halve the memory
    on a GPU (scores then carry bf16 rounding)."""

    scale: float = 1.0
    """Fixed normalisation: the committed score is `scale * logit + shift`."""

    shift: float = 0.0
    """Added after `scale` (e.g. minus the model's mean logit on a reference set)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a local reward model directory")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if not (math.isfinite(self.scale) and math.isfinite(self.shift)):
            raise ValueError(f"scale and shift must be finite, got {self.scale}, {self.shift}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardFunctionConfig:
    """A user reward function with its calling convention (a bare string in
    `reward.functions` is this with every other field at its default)."""

    path: str
    """`module:function` import path, or a built-in name. The worker process imports it by
    this path, so it must be a module-level function (no closures or lambdas)."""

    signature: RewardSignature = "rftpipe"
    """How it is called. `rftpipe`: fn(sample: rftpipe.rewards.types.RewardSample) per row.
    `verl`: compute_score(data_source, solution_str, ground_truth, extra_info) per row.
    `trl`: fn(prompts, completions, **columns) once per group (the n samples of one
    prompt), returning one value per completion. A value is a number, or a dict with a
    numeric `score` whose other entries become `reward_<name>_<key>` columns."""

    name: str = ""
    """Column name `reward_<name>` (empty: the function's own name); set it when two
    functions share one, e.g. two verl `compute_score`s."""

    timeout_s: float | None = None
    """Seconds one call may run before its worker process is killed (None: reward.timeout_s)."""

    data_sources: tuple[str, ...] = ()
    """Data sources (a row's `data_source`) this function scores (empty: all). A row from
    another source is not sent to it: its `reward_<name>` is null and adds nothing to
    `reward`. A run whose data holds a source that no function scores is refused."""

    model: RewardModelConfig | None = None
    """The reward model of a `reward_model` entry (required there, refused elsewhere)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a built-in reward or module:function")
        if (self.path == "reward_model") != (self.model is not None):
            raise ValueError(
                "path reward_model needs a `model` mapping (path, batch_size, ...)"
                if self.model is None
                else f"`model` is set but path is {self.path!r}, not reward_model"
            )
        if self.model is not None and (self.signature != "rftpipe" or self.timeout_s is not None):
            raise ValueError("a reward_model entry has no signature or timeout_s to set")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.name and not re.fullmatch(r"[A-Za-z0-9_]+", self.name):
            raise ValueError(f"name must be letters, digits and _, got {self.name!r}")

    @property
    def column(self) -> str:
        """`reward_<name>`; import paths use their function name."""
        return "reward_" + (self.name or self.path.rsplit(":", 1)[-1].replace(".", "_"))


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteRewardConfig:
    """A reward server, used as the component `remote` of `reward.functions`.

    Each row is one POST of JSON {step, prompt_id, sample_idx, prompt, response, answer,
    data_source, metadata, finish_reason, images}; the reply is a number or a dict with
    `score`.
    """

    url: str = ""
    """http(s) endpoint scoring one row per request (empty: no remote reward)."""

    token_env: str = "RFTPIPE_REWARD_TOKEN"
    """Environment variable holding the bearer token (`Authorization: Bearer ...`; unset or
    empty: no header). Only the variable's name is ever written to the run directory."""

    concurrency: int = 8
    """Requests in flight at once (per rank)."""

    timeout_s: float = 30.0
    """Seconds one request may take (connect and each read) before it counts as failed."""

    attempts: int = 5
    """Tries per row on 5xx, timeouts and connection errors; a 4xx is a bad request and
    fails the run at once, without a retry."""

    backoff_s: float = 0.5
    """Exponential backoff with full jitter: the wait before retry k is uniform in
    [0, min(backoff_max_s, backoff_s * 2**k)] seconds."""

    backoff_max_s: float = 30.0
    """Cap of one backoff wait."""

    circuit_after: int = 20
    """Consecutive failed requests (over all rows, any success resets the count) after
    which the circuit opens: the run stops with an error instead of retrying a server
    that is down."""

    image_payload: Literal["path", "base64"] = "path"
    """How a row's images travel in its request's `images` list (in the order its prompt
    showed them; empty for a text row): `path` sends each as {sha256, path}, the file's
    absolute path under the run directory, for a server that shares the file system;
    `base64` sends {sha256, base64}, the file's bytes, for one that does not (each
    request then carries its images, about 4/3 of their size)."""

    def __post_init__(self) -> None:
        if self.url and not re.match(r"https?://", self.url):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if re.match(r"https?://[^/]*@", self.url):
            # The config is written to the run directory: secrets belong in token_env.
            raise ValueError("url must not carry credentials (user:password@); use token_env")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.circuit_after < 1:
            raise ValueError(f"circuit_after must be >= 1, got {self.circuit_after}")
        for key in ("timeout_s", "backoff_s", "backoff_max_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {v}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    functions: tuple[str | RewardFunctionConfig, ...] = ("accuracy", "format")
    """Reward components: built-in names (accuracy, format, dense_even_tokens, math_verify,
    overlong, remote), `module:function` import paths, or mappings (RewardFunctionConfig:
    path, signature, name, timeout_s, data_sources; `{path: reward_model, name: ...,
    model: {...}}` for a reward model, RewardModelConfig). Each is a column `reward_<name>`."""

    weights: tuple[float, ...] = ()
    """Weight of each component in `reward` (empty: all 1.0)."""

    extractor: Literal["full", "last_number", "answer_tag"] = "full"
    """How `accuracy` extracts the answer from a response before the dataset's scorer sees it."""

    require_stop: bool = True
    """`accuracy` scores only responses that ended with EOS: a truncated one may stop mid-calculation."""

    timeout_s: float = 60.0
    """Seconds one call of an import-path function may run; then its worker process is
    killed (SIGKILL) and replaced, and the row's `reward_status` is `timeout`."""

    workers: int = 2
    """Worker processes (per rank) that run import-path functions, each call in one of them."""

    on_error: Literal["fail", "zero"] = "fail"
    """A row whose function raised or timed out, or whose remote request failed for good:
    `fail` stops the run (exit 2) naming the row and function; `zero` scores that
    component 0, keeps its `reward_status` (error or timeout) and counts it in
    rollout/reward_errors and rollout/reward_timeouts."""

    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """The reward server of the `remote` component."""

    overlong_buffer: int = 0
    """The `overlong` component's buffer L_cache in tokens (DAPO's soft overlong
    punishment): responses longer than rollout.max_new_tokens - overlong_buffer score
    linearly down to -overlong_penalty at the budget. Must be >= 1 when `overlong` is used."""

    overlong_penalty: float = 1.0
    """The `overlong` component's score at the full budget, negated (DAPO: 1)."""

    def __post_init__(self) -> None:
        if self.weights and len(self.weights) != len(self.functions):
            raise ValueError(
                f"weights has {len(self.weights)} entries but functions has {len(self.functions)}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        uses_remote = any(f.path == "remote" for f in self.specs())
        if uses_remote != bool(self.remote.url):
            raise ValueError(
                "functions names 'remote' but remote.url is empty"
                if uses_remote
                else "remote.url is set but functions does not name 'remote'"
            )
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ValueError(
                f"overlong_penalty must be a finite number >= 0, got {self.overlong_penalty}"
            )
        if any(f.path == "overlong" for f in self.specs()) and self.overlong_buffer < 1:
            raise ValueError(
                f"functions names 'overlong' but overlong_buffer is {self.overlong_buffer}; "
                "set it to the soft-punishment length (>= 1)"
            )
        columns = [f.column for f in self.specs()]
        if len(set(columns)) != len(columns):
            raise ValueError(f"two functions share a column name ({columns}); give one a `name`")

    def specs(self) -> tuple[RewardFunctionConfig, ...]:
        """`functions` with bare strings expanded to RewardFunctionConfig."""
        return tuple(
            RewardFunctionConfig(path=f) if isinstance(f, str) else f for f in self.functions
        )
