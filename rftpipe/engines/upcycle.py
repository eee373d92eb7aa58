"""Sparse upcycling: a dense Llama-architecture causal LM becomes a Mixtral-architecture
mixture of experts (Komatsuzaki et al., 2022, "Sparse Upcycling").

Every expert of a layer is an exact copy of that layer's dense MLP (gate, up and down
projections), and attention, norms, embeddings and the LM head are copied unchanged. A
token's MoE output is then sum_i w_i * MLP(x) with top-k weights w renormalised to sum to 1,
which is the dense MLP's output within float error whatever the router says: the upcycled
model starts where the dense one is, and training lets the experts drift apart.

The router weights come from an integer hash, not from torch's RNG or any float kernel,
so a conversion writes bitwise the same router on every machine (`router_weight`).

The output directory is in the checkpoint format of the Hugging Face Hub's Mixtral
(`block_sparse_moe.experts.{e}.w1/w2/w3`, which transformers fuses on load and vLLM
reads), one safetensors shard per decoder layer plus one for the rest, so converting holds
one layer's experts in memory at a time. `rftpipe.engines.models.prepare_upcycled` caches
it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rftpipe.config.model import MAX_EXPERTS
from rftpipe.errors import UserError

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, MixtralConfig, MixtralForCausalLM

log = logging.getLogger(__name__)

ROUTER_BOUND = float(np.float32(0.02 * 3**0.5))
"""Router weights are uniform in [-ROUTER_BOUND, ROUTER_BOUND): standard deviation 0.02,
the usual initializer range. A float32 value, so that `router_weight`'s one product is
exact in float64 and its only rounding is the cast to float32."""

_MLP = {
    "mlp.gate_proj.weight": "w1",
    "mlp.down_proj.weight": "w2",
    "mlp.up_proj.weight": "w3",
}
"""A dense layer's MLP weights and the Mixtral expert weight each becomes."""

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_SIDE_SUFFIXES = {".json", ".jinja", ".txt", ".model", ".tiktoken"}
"""Files copied beside the weights: tokenizer, chat template, generation config."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def check_settings(experts: int, top_k: int, router_seed: int) -> None:
    """Refuse settings that `UpcycleConfig` would (for callers that bypass the config)."""
    if not 2 <= experts <= MAX_EXPERTS:
        raise UserError(f"model.upcycle.experts: must be in 2..{MAX_EXPERTS}, got {experts}")
    if not 1 <= top_k <= experts:
        raise UserError(f"model.upcycle.top_k: must be in 1..experts ({experts}), got {top_k}")
    if not 0 <= router_seed < 2**63:
        raise UserError(f"model.upcycle.router_seed: must be in 0..2**63-1, got {router_seed}")


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """Steele et al.'s SplitMix64 step on uint64s (wrapping arithmetic, as intended)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def router_weight(seed: int, layer: int, experts: int, hidden: int) -> np.ndarray:
    """Layer `layer`'s router weight, (experts, hidden) float32, bitwise the same everywhere.

    Entry (e, c) is a function of the integers (seed, layer, e, c) alone: SplitMix64 folds
    them in one at a time (uint64 wraparound arithmetic), the hash's top 24 bits pick one of
    2**24 evenly spaced points of [-1, 1) (exact in float64), and one float64 product with
    the float32 `ROUTER_BOUND` (exact: 25 by 24 significant bits) is rounded once to
    float32. No float kernel, no torch RNG, no CPU feature enters, so every machine writes
    the same bytes."""
    h = np.full((experts, hidden), seed, dtype=np.uint64)
    parts = (
        np.uint64(layer),
        np.arange(experts, dtype=np.uint64)[:, None],
        np.arange(hidden, dtype=np.uint64)[None, :],
    )
    for part in parts:
        h = _splitmix64(h ^ part)
    unit = (h >> np.uint64(40)).astype(np.float64) / 2**23 - 1.0
    return (unit * ROUTER_BOUND).astype(np.float32)


def check_source(dense_dir: Path) -> LlamaConfig:
    """The dense model's config; refuse anything but a dense Llama-architecture causal LM
    (Mixtral's layers are Llama's but for the MLP, and have no biases)."""
    from transformers import LlamaConfig

    raw = json.loads((dense_dir / "config.json").read_text())
    kind = raw.get("model_type")
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if kind != "llama" or archs != ["LlamaForCausalLM"]:
        raise UserError(
            f"model.upcycle: '{dense_dir}' is a {'/'.join(archs)} (model_type {kind}), not a "
            "dense Llama-architecture causal LM (LlamaForCausalLM); only those are upcycled"
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UserError(
            f"model.upcycle: '{dense_dir}' has attention or MLP biases, which Mixtral's "
            "layers lack; only a Llama without biases is upcycled"
        )
    return LlamaConfig.from_pretrained(dense_dir)


def mixtral_config(dense: LlamaConfig, experts: int, top_k: int) -> MixtralConfig:
    """The MoE's config: every dense setting that changes the numerics, `experts` experts
    of which `top_k` per token, no router noise or sliding window."""
    from transformers import MixtralConfig

    return MixtralConfig(
        architectures=["MixtralForCausalLM"],
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads or dense.num_attention_heads,
        # Llama's config fills in hidden/heads when the checkpoint has none.
        head_dim=dense.head_dim,
        hidden_act=dense.hidden_act,
        max_position_embeddings=dense.max_position_embeddings,
        initializer_range=dense.initializer_range,
        rms_norm_eps=dense.rms_norm_eps,
        # Mixtral's default rope theta (1e6) differs from Llama's: pass the dense one's whole.
        rope_parameters=dict(dense.rope_parameters or {}),
        attention_dropout=dense.attention_dropout or 0.0,
        tie_word_embeddings=dense.tie_word_embeddings,
        bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
        sliding_window=None,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
        use_cache=dense.use_cache,
        dtype=dense.dtype,
    )


def _weight_files(dense_dir: Path) -> dict[str, Path]:
    """Each dense tensor's name and the safetensors file that holds it."""
    index = dense_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: dense_dir / file for name, file in weight_map.items()}
    single = dense_dir / "model.safetensors"
    if not single.exists():
        raise UserError(f"model.upcycle: '{dense_dir}' has no safetensors weights to upcycle")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _group_by_layer(names: list[str], layers: int) -> tuple[list[list[str]], list[str]]:
    """(each decoder layer's tensor names, the others), without rotary caches, which old
    checkpoints saved and Mixtral's module rebuilds."""
    per_layer: list[list[str]] = [[] for _ in range(layers)]
    rest: list[str] = []
    for name in sorted(names):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _LAYER_KEY.fullmatch(name)
        if m is None:
            rest.append(name)
        elif int(m.group(1)) < layers:
            per_layer[int(m.group(1))].append(name)
        else:
            raise UserError(f"model.upcycle: weight {name} is past the {layers} layers")
    return per_layer, rest


def _layer_tensors(
    layer: int, names: list[str], get: Any, experts: int, router_seed: int
) -> dict[str, torch.Tensor]:
    """Decoder layer `layer`'s MoE tensors: its attention and norms as they are, each MLP
    weight once per expert, and the router. `get(name)` reads one dense tensor."""
    import torch

    out: dict[str, torch.Tensor] = {}
    prefix = f"model.layers.{layer}."
    moe = f"{prefix}block_sparse_moe."
    mlp = {}
    for name in names:
        rest = name.removeprefix(prefix)
        if rest in _MLP:
            mlp[_MLP[rest]] = name
        elif rest.startswith("mlp."):
            raise UserError(f"model.upcycle: dense MLP weight {name} has no Mixtral counterpart")
        else:
            out[name] = get(name)
    if len(mlp) != len(_MLP):
        raise UserError(f"model.upcycle: layer {layer} lacks MLP weights (has {sorted(mlp)})")
    for w, name in mlp.items():
        for e in range(experts):
            # A copy per expert: safetensors refuses to save tensors that share memory,
            # and reads of one name view the same mapped bytes.
            out[f"{moe}experts.{e}.{w}.weight"] = get(name).clone()
    gate = out[f"{moe}experts.0.w1.weight"]
    router = router_weight(router_seed, layer, experts, gate.shape[1])
    out[f"{moe}gate.weight"] = torch.from_numpy(router).to(gate.dtype)
    return out


def _shards(
    per_layer: list[list[str]], rest: list[str], get: Any, experts: int, router_seed: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The output's shards one at a time (each decoder layer's, then the rest), so that
    only one layer's experts are in memory."""
    for layer, names in enumerate(per_layer):
        yield _layer_tensors(layer, names, get, experts, router_seed)
    yield {name: get(name) for name in rest}


@contextlib.contextmanager
def _upcycled_shards(
    dense_dir: Path, experts: int, top_k: int, router_seed: int
) -> Iterator[tuple[LlamaConfig, int, Iterator[dict[str, torch.Tensor]]]]:
    """(the dense config, the number of shards, the upcycled shards one at a time), the dense
    files open while the shards are read."""
    from safetensors import safe_open

    check_settings(experts, top_k, router_seed)
    dense = check_source(dense_dir)
    files = _weight_files(dense_dir)
    per_layer, rest = _group_by_layer(list(files), dense.num_hidden_layers)
    with contextlib.ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(f, framework="pt")) for f in set(files.values())
        }

        def get(name: str) -> torch.Tensor:
            return handles[files[name]].get_tensor(name)

        yield dense, len(per_layer) + 1, _shards(per_layer, rest, get, experts, router_seed)


def write_upcycled(
    dense_dir: Path, out_dir: Path, experts: int, top_k: int, router_seed: int
) -> None:
    """Write into the new directory `out_dir` the Mixtral upcycling of the dense Llama in
    `dense_dir` (`experts` copies of each MLP, `top_k` per token, the router of
    `router_seed`), its config, and the dense directory's tokenizer, chat template and
    generation config."""
    from safetensors.torch import save_file

    log.info("upcycling %s to %d experts (top %d) in %s", dense_dir, experts, top_k, out_dir)
    weight_map: dict[str, str] = {}
    total = 0
    with _upcycled_shards(dense_dir, experts, top_k, router_seed) as (dense, n, shards):
        out_dir.mkdir(parents=True)
        for i, tensors in enumerate(shards, start=1):
            shard = f"model-{i:05d}-of-{n:05d}.safetensors"
            save_file(tensors, out_dir / shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, shard))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    mixtral_config(dense, experts, top_k).save_pretrained(out_dir)
    _copy_side_files(dense_dir, out_dir)


def load_upcycled(
    dense_dir: Path, experts: int, top_k: int, router_seed: int
) -> MixtralForCausalLM:
    """The model `write_upcycled` writes, built in memory from the same tensors and loaded
    through the same weight conversion, with no copy on disk: a check of a large model's
    upcycling (SmolLM2's is 1.4 GB in float32) on a machine with little disk."""
    from transformers import MixtralForCausalLM

    with _upcycled_shards(dense_dir, experts, top_k, router_seed) as (dense, _, shards):
        state = {name: t for tensors in shards for name, t in tensors.items()}
    config = mixtral_config(dense, experts, top_k)
    model: MixtralForCausalLM = MixtralForCausalLM.from_pretrained(
        None, config=config, state_dict=state
    )
    return model


def _copy_side_files(dense_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer's files, the chat template and the generation config."""
    for src in sorted(dense_dir.iterdir()):
        skip = src.name == "config.json" or src.name.endswith(".index.json")
        if src.is_file() and src.suffix in _SIDE_SUFFIXES and not skip:
            shutil.copyfile(src, out_dir / src.name)
