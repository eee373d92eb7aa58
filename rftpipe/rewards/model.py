"""The `reward_model` component: a sequence-classification model scores each row.

Loaded once per rank at start-up (`rftpipe.rewards`), it turns each row into the
chat template of [user: prompt, assistant: response] under the reward model's own
tokenizer, truncates it to `max_length` tokens on `truncation_side`, and runs batches of
`batch_size` right-padded rows through the model under no_grad in eval mode. A row's score
is `scale * logit + shift`, its one label's logit at its last real token. Right padding
keeps every real token at the position it has alone, so the batch a row shares changes
nothing but float rounding. The score stage commits the scores as `reward_<name>`, so a
resumed run never scores a committed row again.

A vision-language `model.path` (a config with a vision tower: the Qwen2-VL / Qwen2.5-VL
family, which transformers 5.19 has no sequence-classification class for) is a judge
instead (`VisionJudge`): it reads the row's images, prompt and response, then a question
(`JUDGE_QUESTION`), and a row's score is `scale * (log p(yes) - log p(no)) + shift`, the
log-odds of the verdict's first token where the assistant's answer starts. It needs no
trained head, so any instruction-tuned VLM judges as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rftpipe.config.schema import RewardFunctionConfig, RewardModelConfig
from rftpipe.data.images import PLACEHOLDER, VisionPrompt, vision_prompt
from rftpipe.engines import models
from rftpipe.engines.vision import (
    QWEN_VL_TYPES,
    VisionEncoder,
    collate,
    is_vision_model,
    rope_position_ids,
)
from rftpipe.errors import UserError
from rftpipe.rewards.types import Outcome, RewardComponent, RewardSample

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


def build(spec: RewardFunctionConfig, device: torch.device | str) -> RewardComponent:
    """The component of a `reward_model` entry: a `VisionJudge` for a vision-language
    `model.path`, else a `RewardModel` (a sequence classifier)."""
    if spec.model is None:
        raise ValueError(f"reward.functions: {spec.path} has no `model`")
    if is_vision_model(resolve_path(spec.model.path)):
        return VisionJudge.build(spec, device)
    return RewardModel.build(spec, device)


@dataclass(slots=True)
class RewardModel:
    """A loaded reward model, scoring rows in batches (see the module docstring)."""

    spec: RewardFunctionConfig
    cfg: RewardModelConfig
    """`spec.model`, never None here."""
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    warned_images: bool = False
    """Whether it said once that it does not see the rows' images."""

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
        if not self.warned_images and any(s.images for s in samples):
            self.warned_images = True
            log.warning(
                "reward.functions: %s is a text-only reward model: it scores the rows' text "
                "and does not see their images",
                self.cfg.path,
            )
        # A model forward has no per-row failure: an exception here is a bug or an
        # out-of-memory, which must stop the run rather than score rows 0.
        scale, shift = self.cfg.scale, self.cfg.shift
        return [Outcome("ok", scale * x + shift) for x in self.logits(samples)]


JUDGE_QUESTION = "Is the assistant's answer correct? Answer Yes or No."
"""The judge's question, asked as the user's turn after the row's response."""
VERDICT = ("Yes", "No")
"""The verdict words whose first tokens' log-odds is a judge's score."""


def judge_prompt(s: RewardSample, question: str = JUDGE_QUESTION) -> VisionPrompt:
    """The conversation a `VisionJudge` reads for row `s`: its prompt with its images,
    its response as the assistant's, then `question` as the user's.

    The images go where the prompt's ``<image>`` placeholders are, or, if it has none,
    before its text; a multi-turn row's conversation (`s.messages`) places them by its
    own image parts. Exit 2 naming the row when the images do not fit the prompt."""
    images = s.image_bytes("reward.functions")
    turn = {"role": "user", "content": question}
    if s.messages is not None:
        return vision_prompt([*s.messages, turn], images, row=s.where, prompt_col="messages")
    text = s.prompt if PLACEHOLDER in s.prompt else PLACEHOLDER * len(images) + s.prompt
    vp = vision_prompt(text, images, row=s.where)
    answer = {"role": "assistant", "content": s.response}
    return VisionPrompt(messages=(*vp.messages, answer, turn), images=vp.images)


@dataclass(slots=True)
class VisionJudge:
    """A vision-language model judging rows by its verdict's log-odds (see the module
    docstring): rows are left-padded in batches of `batch_size`, with the model's own 3-D
    M-RoPE positions, so a row's score does not depend on its batch (to float rounding).
    A row longer than `max_length` tokens (image tokens included) is not truncated,
    which could cut an image apart: it fails (status error) for `reward.on_error`."""

    spec: RewardFunctionConfig
    cfg: RewardModelConfig
    model: torch.nn.Module
    encoder: VisionEncoder
    device: torch.device
    verdict_ids: tuple[int, int]
    """The first token ids of the verdict words (yes, no)."""
    question: str = JUDGE_QUESTION

    @classmethod
    def build(
        cls,
        spec: RewardFunctionConfig,
        device: torch.device | str,
        question: str = JUDGE_QUESTION,
        verdict: tuple[str, str] = VERDICT,
    ) -> VisionJudge:
        from transformers import AutoModelForImageTextToText

        if spec.model is None:
            raise ValueError(f"reward.functions: {spec.path} has no `model`")
        cfg = spec.model
        path = resolve_path(cfg.path)
        kind = json.loads((path / "config.json").read_text()).get("model_type")
        if kind not in QWEN_VL_TYPES:
            # Another family has another processor and token layout (see VisionEncoder).
            raise UserError(
                f"reward.functions: model.path '{cfg.path}' is a {kind!r} vision-language "
                f"model; judges read {sorted(QWEN_VL_TYPES)} models only so far"
            )
        encoder = VisionEncoder.load(path)
        tok = encoder.tokenizer
        yes, no = (tok(w, add_special_tokens=False)["input_ids"][0] for w in verdict)
        if yes == no:
            raise UserError(
                f"reward.functions: model.path '{cfg.path}': the verdict words {verdict} "
                "start with the same token"
            )
        device = torch.device(device)
        model: torch.nn.Module = AutoModelForImageTextToText.from_pretrained(
            path, dtype=getattr(torch, cfg.dtype)
        )
        model.to(device).eval()
        log.info("vision judge %s loaded on %s (%s)", cfg.path, device, cfg.dtype)
        return cls(spec, cfg, model, encoder, device, (yes, no), question)

    def log_odds(self, prompts: Sequence[VisionPrompt]) -> list[float]:
        """(B,) log p(yes) - log p(no) of the prompts, in order, `batch_size` per forward."""
        encoded = [self.encoder.encode(p) for p in prompts]
        pad = self.encoder.tokenizer.pad_token_id
        yes, no = self.verdict_ids
        out: list[float] = []
        for i in range(0, len(encoded), self.cfg.batch_size):
            batch = collate(encoded[i : i + self.cfg.batch_size], pad, left=True)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            # Explicit positions: with left padding, each row's start at its first real
            # token, as it has alone.
            batch["position_ids"] = rope_position_ids(self.model, batch)
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].to(getattr(torch, self.cfg.dtype))
            with torch.no_grad():
                # Left padding: every row's last token is the last column.
                logits = self.model(**batch, logits_to_keep=1).logits[:, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.extend((lp[:, yes] - lp[:, no]).tolist())
        return out

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        prompts = [judge_prompt(s, self.question) for s in samples]
        lengths = [
            self.encoder.count_tokens(p, s.where) for p, s in zip(prompts, samples, strict=True)
        ]
        limit = self.cfg.max_length
        out: list[Outcome | None] = [
            Outcome("error", error=f"ValueError: {n} tokens (images included) > max_length {limit}")
            for n in lengths
        ]
        fits = [i for i, n in enumerate(lengths) if n <= limit]
        scale, shift = self.cfg.scale, self.cfg.shift
        for i, x in zip(fits, self.log_odds([prompts[i] for i in fits]), strict=True):
            out[i] = Outcome("ok", scale * x + shift)
        return out
