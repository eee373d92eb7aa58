"""The `reward_model` component: a sequence-classification model scores each row.

Loaded once per rank at start-up (`rftpipe.rewards`), it turns each row into the
chat template of [user: prompt, assistant: response] under the reward model's own
tokenizer, truncates it to `max_length` tokens on `truncation_side`, and runs batches of
`batch_size` right-padded rows through the model under no_grad in eval mode. A row's score
is `scale * logit + shift`, its one label's logit at its last real token. Right padding
keeps every real token at the position it has alone, so the batch a row shares changes
nothing but float rounding. The score stage commits the scores as `reward_<name>`, so a
resumed run never scores a committed row again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rftpipe.config.schema import RewardFunctionConfig, RewardModelConfig
from rftpipe.engines import models
from rftpipe.errors import UserError
from rftpipe.rewards.types import Outcome, RewardSample

log = logging.getLogger(__name__)


def resolve_path(spec: str) -> Path:
    """`model.path` of a reward model as a local directory (`builtin:tiny-reward` built)."""
    if spec == models.TINY_REWARD:
        return models.prepare_tiny_reward_model()
    if spec.startswith("builtin:"):
        return models.resolve_model_path(spec)  # a policy model: check_classifier refuses it
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(
            f"reward.functions: model.path '{spec}' is not a local HF model directory "
            "(no config.json)"
        )
    return path


def check_classifier(spec: str, path: Path) -> None:
    """Refuse a directory that is not a one-label sequence classifier (a causal LM would
    load with a freshly initialised head and score noise without a word)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    archs = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UserError(
            f"reward.functions: model.path '{spec}' is not a sequence-classification model "
            f"(architectures {archs})"
        )
    if config.num_labels != 1:
        raise UserError(
            f"reward.functions: model.path '{spec}' has {config.num_labels} labels; a reward "
            "model has one (num_labels: 1)"
        )


def load(cfg: RewardModelConfig, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The model in eval mode on `device` in `cfg.dtype`, and its tokenizer set up to
    right-pad and to truncate on `cfg.truncation_side`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_path(cfg.path)
    check_classifier(cfg.path, path)
    tok = AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise UserError(f"reward.functions: model.path '{cfg.path}' has no chat template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    tok.truncation_side = cfg.truncation_side
    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=getattr(torch, cfg.dtype)
    )
    # The model finds each row's last real token by its pad id: it must be the tokenizer's.
    model.config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok


def texts(tokenizer: Any, samples: Sequence[RewardSample]) -> list[str]:
    """Each row as the reward model reads it: the chat of its prompt and response."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.response}],
            tokenize=False,
        )
        for s in samples
    ]


@dataclass(slots=True)
class RewardModel:
    """A loaded reward model, scoring rows in batches (see the module docstring)."""

    spec: RewardFunctionConfig
    cfg: RewardModelConfig
    """`spec.model`, never None here."""
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device

    @classmethod
    def build(cls, spec: RewardFunctionConfig, device: torch.device | str) -> RewardModel:
        if spec.model is None:
            raise ValueError(f"reward.functions: {spec.path} has no `model`")
        device = torch.device(device)
        model, tok = load(spec.model, device)
        log.info("reward model %s loaded on %s (%s)", spec.model.path, device, spec.model.dtype)
        return cls(spec, spec.model, model, tok, device)

    def logits(self, samples: Sequence[RewardSample]) -> list[float]:
        """(B,) raw logits of the rows, in order, `batch_size` rows per forward."""
        size = self.cfg.batch_size
        out: list[float] = []
        all_texts = texts(self.tokenizer, samples)
        for i in range(0, len(all_texts), size):
            enc = self.tokenizer(
                all_texts[i : i + size],
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
                add_special_tokens=False,  # the chat template has its own
                return_tensors="pt",
            ).to(self.device)
            with torch.no_grad():
                logits = self.model(
                    input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
                ).logits  # (B, 1)
            out.extend(logits[:, 0].float().tolist())
        return out

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        # A model forward has no per-row failure: an exception here is a bug or an
        # out-of-memory, which must stop the run rather than score rows 0.
        scale, shift = self.cfg.scale, self.cfg.shift
        return [Outcome("ok", scale * x + shift) for x in self.logits(samples)]
