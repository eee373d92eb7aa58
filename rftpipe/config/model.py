"""The `model` section: the policy's weights and dtype, the KL term's reference model, and
LoRA adapters on the policy (`model.lora`)."""

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
