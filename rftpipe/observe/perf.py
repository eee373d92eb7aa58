"""Train-stage throughput: model FLOPs, tokens per second and MFU.

The FLOPs are *model* FLOPs (PaLM, appendix B): what one forward and backward of the rows
needs, independent of how the engine computes it. Activation recomputation (gradient
checkpointing) is not counted, and neither is prefix sharing: the single backend computes
a group's shared prompt once, so its achieved FLOP/s count work it skipped.

    from rftpipe.observe import perf
    shape = perf.model_shape(model)
    flops = perf.train_flops(shape, seq_lens=[300, 280], response_tokens=60)
    peak = perf.peak_tflops(torch.device("cuda", 0), "bfloat16")  # 989.5 on an H100 SXM
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import torch

from rftpipe.engines.models import as_causal_lm
from rftpipe.engines.moe import expert_parameters
from rftpipe.engines.vision import hf_model

#: Dense peak TFLOP/s of one GPU by compute type: half of NVIDIA's datasheet figure "with
#: sparsity" for the tensor-core types, the plain figure for fp32 without TF32. Keyed by a
#: substring of `torch.cuda.get_device_name()`; the first match wins, so the H100 PCIe and
#: NVL come before the SXM ("NVIDIA H100 80GB HBM3"), and "H200" also matches the GH200.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.5, "tf32": 378.0, "float32": 51.0}),
    ("H100 NVL", {"bfloat16": 835.5, "tf32": 417.5, "float32": 60.0}),
    ("H100", {"bfloat16": 989.5, "tf32": 494.5, "float32": 67.0}),
    ("H200", {"bfloat16": 989.5, "tf32": 494.5, "float32": 67.0}),
    ("A100", {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.0, "tf32": 183.0, "float32": 91.6}),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the FLOPs of a decoder-only transformer depend on."""

    non_embedding_params: int
    """Parameters outside the input embedding and the LM head (tied or not) that a token
    meets: of an MoE model's routed experts, the k of E it is routed to (k/E of theirs)."""
    layers: int
    attention_width: int
    """Query heads x head dim: the width of QK^T and AV."""
    hidden: int
    vocab: int


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside an engine wrapper (DeepSpeed's `.module`)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.get_submodule("module")
    return model


def _numel(p: torch.Tensor) -> int:
    # ZeRO-3 leaves an empty local tensor and records the full size as ds_numel; a DTensor
    # (FSDP2) reports its global size itself.
    return int(getattr(p, "ds_numel", p.numel()))


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The shape of a transformers causal LM, whole, sharded (FSDP2) or partitioned (ZeRO)."""
    model = _hf_model(model)
    lm = as_causal_lm(model)
    # A vision-language model: the text model's shape. Its vision tower runs on image
    # patches, not on the sequence's tokens, so it is left out (MFU then undercounts); a
    # peft model's tower is its base model's.
    cfg = lm.config.get_text_config()
    tower = getattr(getattr(hf_model(model), "model", None), "visual", None)
    skipped = {
        id(p)
        for m in (lm.get_input_embeddings(), lm.get_output_embeddings(), tower)
        if m is not None
        for p in m.parameters()
    }
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    # An MoE model: a token meets k of E routed experts, so only that share of theirs counts.
    experts, active = expert_parameters(model)
    routed = {id(p) for p in experts}
    dense = sum(_numel(p) for p in model.parameters() if id(p) not in skipped | routed)
    return ModelShape(
        non_embedding_params=round(dense + active * sum(_numel(p) for p in experts)),
        layers=cfg.num_hidden_layers,
        attention_width=heads * head_dim,
        hidden=cfg.hidden_size,
        vocab=cfg.vocab_size,
    )


def train_flops(shape: ModelShape, seq_lens: Sequence[int], response_tokens: int) -> float:
    """FLOPs of one forward+backward of rows of `seq_lens` (prompt + response) tokens.

        F = 6 N T  +  6 L d_attn sum_i s_i (s_i + 1)  +  6 h V R

    - 6 N T: each of the T = sum_i s_i tokens meets every non-embedding parameter in one
      multiply-add (2 FLOPs) forward and two backward (input and weight gradients).
    - attention: a query at position j attends to the j keys up to itself (causal), in QK^T
      and in AV, each 2 d_attn FLOPs per pair: 2 d_attn s (s + 1) per row and layer
      forward, times 3 with the backward.
    - LM head: h x V logits only at the R positions that predict response tokens (the
      engines skip the others), times 3 with the backward.

    N: `non_embedding_params`, L: layers, d_attn: `attention_width`, h: hidden, V: vocab.
    """
    tokens = sum(seq_lens)
    attention = sum(s * (s + 1) for s in seq_lens)
    return (
        6.0 * shape.non_embedding_params * tokens
        + 6.0 * shape.layers * shape.attention_width * attention
        + 6.0 * shape.hidden * shape.vocab * response_tokens
    )


def train_work(model: torch.nn.Module, table: pa.Table, epochs: int) -> torch.Tensor:
    """(tokens, FLOPs) this rank's rows take through `epochs` forward+backward passes, as a
    float64 (2,) tensor ready to be summed over ranks. Tokens are prompt plus response."""
    prompt = pc.list_value_length(table.column("prompt_token_ids")).to_numpy(zero_copy_only=False)
    resp = pc.list_value_length(table.column("response_token_ids")).to_numpy(zero_copy_only=False)
    seq = [int(s) for s in prompt + resp]
    flops = train_flops(model_shape(model), seq, int(resp.sum()))
    return torch.tensor([epochs * sum(seq), epochs * flops], dtype=torch.float64)


def throughput(work: torch.Tensor, seconds: float) -> dict[str, float]:
    """perf/train_tokens_per_s and perf/train_tflops of all ranks' summed `train_work`."""
    seconds = max(seconds, 1e-9)
    return {
        "perf/train_tokens_per_s": float(work[0]) / seconds,
        "perf/train_tflops": float(work[1]) / seconds / 1e12,
    }


def mfu(tflops: float, peak: float | None, world: int) -> dict[str, float]:
    """perf/mfu: achieved TFLOP/s of all ranks over their summed peak; {} without a peak."""
    return {} if not peak else {"perf/mfu": tflops / (peak * world)}


def compute_dtype(param_dtype: str, model_dtype: str) -> str:
    """The matmul input dtype: bf16 if either the weights or the compute policy is bf16."""
    return "bfloat16" if "bfloat16" in (param_dtype, model_dtype) else "float32"


def peak_tflops(device: torch.device, dtype: str, override: float = 0.0) -> float | None:
    """Dense peak TFLOP/s of `device` for matmuls in `dtype` (`compute_dtype`).

    `override` (> 0) wins; otherwise a known GPU's `PEAK_TFLOPS` entry, where fp32 means
    TF32 tensor cores only if torch is allowed to use them
    (`torch.set_float32_matmul_precision`). None on the CPU or an unknown GPU.
    """
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    return next((peaks[dtype] for key, peaks in PEAK_TFLOPS if key in name), None)


def clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device's queued work is done (CUDA runs async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
