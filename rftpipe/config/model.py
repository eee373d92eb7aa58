"""The `model` section: the policy's weights and dtype, the KL term's reference model, LoRA
adapters on the policy (`model.lora`), and sparse upcycling of a dense policy into a
mixture of experts (`model.upcycle`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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


MAX_EXPERTS = 256
"""The most experts `model.upcycle` makes a layer (Mixtral's router is a dense (E, H)
matrix, and every expert is a full copy of the dense MLP)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UpcycleConfig:
    """Sparse upcycling: the dense Llama-architecture policy becomes a Mixtral-architecture
    mixture of experts whose experts are all copies of each layer's dense MLP, under a new
    router (rftpipe.engines.upcycle)."""

    experts: int
    """Experts per layer (E), each an exact copy of the layer's dense MLP; 2 to 256."""

    top_k: int
    """Experts each token is routed to (k), 1 to `experts`; its weights are the top-k
    softmax router probabilities renormalised to sum to 1."""

    router_seed: int = 0
    """Seed of the router weights, which an integer hash of (seed, layer, expert, column)
    draws uniform in +-0.02*sqrt(3) (standard deviation 0.02), bitwise the same on every
    machine; 0 to 2**63-1."""

    def __post_init__(self) -> None:
        if not 2 <= self.experts <= MAX_EXPERTS:
            raise ValueError(f"experts must be in 2..{MAX_EXPERTS}, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..experts ({self.experts}), got {self.top_k}")
        if not 0 <= self.router_seed < 2**63:
            raise ValueError(f"router_seed must be in 0..2**63-1, got {self.router_seed}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    path: str = "builtin:smollm2-135m-instruct"
    """Policy weights: a local HF directory, or `builtin:smollm2-135m-instruct`; for tests,
    the random-init `builtin:tiny` (text), `builtin:tiny-vl` (Qwen2-VL),
    `builtin:tiny-vl25` (Qwen2.5-VL), `builtin:tiny-qwen3-moe` (a Qwen3-MoE with one dense
    layer among two MoE ones) or `builtin:tiny-moe` (`builtin:tiny` upcycled to a Mixtral of
    4 experts, top 2)."""

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

    upcycle: UpcycleConfig | None = None
    """Sparse upcycling of a dense Llama-architecture `path` into a Mixtral-architecture
    mixture of experts before training (null: the model as it is): each layer's MLP becomes
    `experts` copies of itself under a new top-k router. At step 0 the model's outputs equal
    the dense model's within float error (the renormalised top-k weights sum to 1 over
    identical experts). The converted directory is built once and kept in the models cache
    (`$RFTPIPE_CACHE/models`, named by the dense model's fingerprint and these settings)."""

    def __post_init__(self) -> None:
        if self.reference == "":
            raise ValueError("reference must name a model, or be null for the initial policy")
