"""The `train` section: the training engine and its memory settings, the optimizer and its
schedule, the policy loss and the corrections on it, and the supervised PTX term
(`train.ptx`); with where PPO's old logprobs come from (`old_logprobs_source`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from rftpipe.algos.variants import (
    POLICY_LOSSES,
    AggregationName,
    NoCorrectionSettings,
    PolicyLossSettings,
    PPOClipSettings,
    RolloutCorrectionSettings,
)
from rftpipe.config.data import DatasetSourceConfig
from rftpipe.config.loader import MovedKey
from rftpipe.config.rollout import RolloutConfig

LrScheduleName = Literal["constant", "linear", "cosine"]
"""How the learning rate decays after warm-up (`rftpipe.engines.train.base.LR_DECAY`)."""


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

    router_replay: Literal["auto", "none", "r2", "r3"] = "auto"
    """Mixture-of-Experts policies: which expert selection every training-side forward of
    the policy uses (docs/moe.md). `r3` (Rollout Routing Replay): the experts each token
    was routed to during rollout, committed with the rollout's tokens (column `routes`);
    `r2`: the selection of the trainer's own old-logprob forward with the step's starting
    weights (needs old_logprobs=actor; committed with the advantages); `none`: each
    forward routes live. Under r2/r3 the routing weights are still recomputed from the
    live router logits, so the router keeps its gradient. `auto` (verl and slime make
    replay opt-in; here a committed rollout makes it exact and durable, so it is on): r3
    for an MoE policy whose rollout records routes (rollout.engine=hf, episodes too), else
    r2 where the old logprobs come from the actor, else none; none for a dense policy,
    which refuses r2/r3. A resume that changes it is refused, as for every key outside
    the resume-safe list."""

    moe_aux_loss_coef: float = 0.0
    """Mixture-of-Experts policies: coefficient of the load-balancing auxiliary loss
    (Switch/Mixtral form, mean over MoE layers) added to the policy loss. It counts the
    selection the forward used, the replayed one under r2/r3. 0: off (metric still
    logged). Refused with sp_size > 1 (each rank would balance its own slice)."""

    skip_zero_advantage: Literal["auto", "off"] = field(
        default="auto", metadata={"before_it_existed": "off"}
    )
    """Rows of a group whose scores are all equal (advantage exactly 0 under the group
    estimators: grpo, dr_grpo, rloo, opo, gpg, grpo_passk) skip the train stage's forward
    and backward. `auto`: skip where that leaves the update as it is, within float summation
    error: not with a term that reads such rows (a KL loss, entropy_coef, the kl_cov and
    clip_cov losses, entropy_mask_top < 1, moe_aux_loss_coef) nor with kl.mode=reward (its
    penalty is in the scores); the losses' normalisers still count the skipped rows and
    each mini-batch runs at least one micro-batch, so every parameter gets its gradient
    (zeros) and AdamW's step is what it was. Under skipping `train/entropy`, `train/kl`,
    `train/clip_frac`, `train/ratio_mean` and `train/tokens` are over the trained rows;
    `train/skipped_rows` and `train/skipped_tokens` count the others; where auto cannot
    skip, `train/skip_blocked/<what>` and `jobs.status` say why. The actor's old-logprob
    pass (old_logprobs=actor) leaves the same rows out (`advantage/old_logprob_skipped_*`;
    the `rollout/logprob_*` metrics are then over the computed rows) but under r2. `off`:
    train every row (what a run directory made before this key resumes with)."""

    expert_parallel: int = 1
    """Ranks that split each MoE layer's experts between them. Only 1 (every rank holds
    every expert, sharded by the backend like any weight) runs here; docs/moe.md says what
    expert parallelism would take."""

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
        if self.moe_aux_loss_coef < 0:
            raise ValueError(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.expert_parallel != 1:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} cannot run: rftpipe has no expert-"
                "parallel layers (every rank holds every expert, sharded by the backend); "
                "set 1 (docs/moe.md says what it would take)"
            )
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ema_decay and self.backend == "deepspeed":
            raise ValueError(
                "ema_decay is not available with backend=deepspeed (it keeps its parameters "
                "in flat partitions of its own); use backend=single or fsdp2"
            )


def old_logprobs_source(train: TrainConfig, rollout: RolloutConfig) -> Literal["rollout", "actor"]:
    """`train.old_logprobs` with `auto` resolved: `actor` for a serving engine (its kernels
    differ from the trainer's) and for stale rollouts (`rollout.staleness` >= 1: the
    proximal policy of decoupled PPO is the weights being trained, not the stale ones that
    sampled), else `rollout`."""
    if train.old_logprobs != "auto":
        return train.old_logprobs
    return "rollout" if rollout.engine == "hf" and rollout.staleness == 0 else "actor"
