"""The typed config tree of a run: its root ``RunConfig``, the checks across its sections,
and what a resume may change.

Every section owns one small frozen dataclass, in a module of its own: ``model``, ``data``,
``rollout`` (with ``env`` and ``agent``), ``reward``, ``advantage``, ``kl``, ``critic``,
``train``, ``checkpoint``, ``eval``, ``logging`` and ``launch``. The root nests them, and
this module re-exports their names, so that the rest of the code imports any of them from
here. A check on one section's fields is in that section's ``__post_init__``, a check
across sections in ``RunConfig``'s; all run once at load time
(``rftpipe.config.loader.load_config``). Nothing here imports torch, so the launch layer
stays instant on a login node.

An algorithm variant (`advantage.estimator`, `train.policy_loss`, `kl.estimator`) is held as
the instance of its own settings class, declared with its registry entry in
``rftpipe.algos.variants``; cross-component checks read the entry's traits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rftpipe.algos.variants import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from rftpipe.config.advantage import AdvantageConfig
from rftpipe.config.agent import AgentConfig
from rftpipe.config.checkpoint import CheckpointConfig
from rftpipe.config.critic import CriticConfig, CriticModelConfig
from rftpipe.config.data import (
    DataConfig,
    DatasetSourceConfig,
    FileDataConfig,
    ImagesConfig,
    ReasoningGymConfig,
)
from rftpipe.config.env import EnvConfig, ToolParserName
from rftpipe.config.eval import EvalConfig
from rftpipe.config.kl import KLConfig
from rftpipe.config.launch import LaunchConfig
from rftpipe.config.logging import LoggingConfig
from rftpipe.config.model import LoraConfig, ModelConfig, UpcycleConfig
from rftpipe.config.reward import (
    RemoteRewardConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
    RewardSignature,
)
from rftpipe.config.rollout import (
    DynamicSamplingConfig,
    InferenceConfig,
    RolloutConfig,
    episode_limits,
    response_budget,
)
from rftpipe.config.train import LrScheduleName, PTXConfig, TrainConfig, old_logprobs_source
from rftpipe.errors import UserError

__all__ = [
    "RESUME_SAFE_KEYS",
    "SCHEMA_VERSION",
    "AdvantageConfig",
    "AgentConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CriticModelConfig",
    "DataConfig",
    "DatasetSourceConfig",
    "DynamicSamplingConfig",
    "EnvConfig",
    "EvalConfig",
    "FileDataConfig",
    "ImagesConfig",
    "InferenceConfig",
    "KLConfig",
    "LaunchConfig",
    "LoggingConfig",
    "LoraConfig",
    "LrScheduleName",
    "ModelConfig",
    "PTXConfig",
    "ReasoningGymConfig",
    "RemoteRewardConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardModelConfig",
    "RewardSignature",
    "RolloutConfig",
    "RunConfig",
    "ToolParserName",
    "TrainConfig",
    "UpcycleConfig",
    "episode_limits",
    "old_logprobs_source",
    "refuse_stretched_lr_schedule",
    "response_budget",
]

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
    # Whether a checkpoint that will not fit stops the run or is skipped: when checkpoints
    # are taken, never what a step computes (tests/test_full_disk.py).
    "checkpoint.on_no_space",
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


def _episodes_give(rollout: RolloutConfig) -> str:
    """How an error names what gives a run's reward components."""
    if rollout.env is not None:
        return "and rollout.env give"
    return "and rollout.agent give" if rollout.agent is not None else "gives"


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
        # In this order: a config with several faults is always refused for the same one.
        columns = [spec.column for spec in self.reward.specs()]
        self._check_rewards(columns)
        self._check_batch()
        self._check_dynamic_sampling(columns)
        self._check_env()
        estimator = ADVANTAGE_ESTIMATORS.of(self.advantage.estimator)
        self._check_agent(estimator.traits.needs_baseline_rollout)
        self._check_disaggregated()
        self._check_models()
        self._check_critic()
        self._check_rollout_correction()
        self._check_router_replay()

    def _check_rewards(self, columns: list[str]) -> None:
        """The run has a reward to train on (the `columns` of `reward.functions`, or an
        episode's own), and `eval.metric` names one of its components."""
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

    def _check_batch(self) -> None:
        """A step's samples suit the advantage estimator (groups it can compare), the
        overlong reward (its buffer fits in a response) and the train stage (its
        mini-batches divide them)."""
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

    def _check_models(self) -> None:
        """The policy's adapters and reference model are ones the rest of the run uses."""
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

    def _check_critic(self) -> None:
        """A critic exactly when the advantage estimator reads its values, and one that the
        train stage can run."""
        estimator = ADVANTAGE_ESTIMATORS.of(self.advantage.estimator)
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

    def _check_rollout_correction(self) -> None:
        """A correction that weighs by the ratio of actor to rollout logprobs gets old
        logprobs from the actor (from the rollout, the ratio is 1)."""
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

    def _check_router_replay(self) -> None:
        """R2 replays the old-logprob forward's selection, so that forward must run; what
        the rollout cannot record yet is refused here (whether the policy is MoE at all is
        known once it loads: `rftpipe.run.runtime`)."""
        mode = self.train.router_replay
        if mode == "r2" and old_logprobs_source(self.train, self.rollout) != "actor":
            raise ValueError(
                "train.router_replay=r2 replays the selection of the actor's old-logprob "
                f"forward, which runs only with train.old_logprobs=actor (it is "
                f"{self.train.old_logprobs} with rollout.engine={self.rollout.engine})"
            )
        if mode == "r3" and self.rollout.engine != "hf":
            raise ValueError(
                f"train.router_replay=r3 with rollout.engine={self.rollout.engine}: route "
                "capture (vLLM's enable_return_routed_experts, SGLang's return_routed_experts) "
                "needs the engine's GPU model runner, which this CPU build lacks; use r2 (with "
                "train.old_logprobs=actor)"
            )
        if self.train.moe_aux_loss_coef and self.train.sp_size > 1:
            raise ValueError(
                "train.moe_aux_loss_coef with train.sp_size>1: each rank would balance the "
                "experts over its own slice of the sequences, not over the rows; set "
                "train.sp_size=1 or train.moe_aux_loss_coef=0"
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


def skip_blockers(cfg: RunConfig) -> dict[str, str]:
    """What keeps `train.skip_zero_advantage=auto` from skipping all-alike groups' rows:
    {metric name: why}, empty where skipping leaves the update as it is. Config alone, so
    the same on every rank (and in `jobs.status`)."""
    t = cfg.train
    estimator = ADVANTAGE_ESTIMATORS.of(cfg.advantage.estimator)
    loss = POLICY_LOSSES.of(t.policy_loss)
    checks = {
        "estimator": (
            not estimator.traits.alike_groups_zero,
            f"advantage.estimator={estimator.name} gives an all-alike group nonzero advantages",
        ),
        "kl_loss": (cfg.kl.mode == "loss", "kl.mode=loss: the KL term reads every row"),
        "kl_reward": (
            cfg.kl.mode == "reward",
            "kl.mode=reward: the scores hold the KL penalty, not the rewards alone",
        ),
        "entropy_coef": (bool(t.entropy_coef), "train.entropy_coef: the bonus reads every row"),
        "entropy_mask_top": (
            t.entropy_mask_top < 1.0,
            "train.entropy_mask_top < 1 ranks a micro-batch's tokens, zero-advantage ones too",
        ),
        "moe_aux_loss": (
            bool(t.moe_aux_loss_coef),
            "train.moe_aux_loss_coef: the load-balancing loss counts every row's tokens",
        ),
        "policy_loss": (
            loss.traits.reads_zero_advantage_rows,
            f"train.policy_loss={loss.name} reads zero-advantage tokens",
        ),
    }
    return {name: why for name, (blocks, why) in checks.items() if blocks}


def skips_alike_groups(cfg: RunConfig) -> bool:
    """Whether the policy's update skips the rows of all-alike groups
    (`train.skip_zero_advantage=auto` and nothing in `skip_blockers`)."""
    return cfg.train.skip_zero_advantage == "auto" and not skip_blockers(cfg)
