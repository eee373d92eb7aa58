"""Train-stage MFU per backend: tokens/s, TFLOP/s and MFU of the real train stage.

    python -m tools.bench mfu --shape 0.5b --backends single fsdp2 zero2 zero3 --out mfu.json
    torchrun --nproc-per-node 2 -m tools.bench mfu --shape 0.5b --backends fsdp2 zero3
    python -m tools.bench mfu --shape tiny --prompts 2 --samples 4 --prompt-len 16 \\
        --response-len 16 --steps 3 --warmup 1        # a CPU smoke check

Each backend's engine is built as the pipeline builds it (`runtime.place_for_engine`, then
`TRAIN_ENGINES`), and each step is one call of the train stage (`rftpipe.stages.train.run`,
one mini-batch: forward/backward of every micro-batch, then the optimizer step) on the same
synthetic GRPO batch: `--prompts` groups of `--samples` responses, advantages of both
signs and behaviour logprobs near a random model's own. Its throughput is what the stage
itself reports (`perf/train_tokens_per_s`, `perf/train_tflops`; FLOPs from
`rftpipe.observe.perf.train_flops`), the median over the steps after `--warmup`. MFU divides by the
device's dense peak (`rftpipe.observe.perf.PEAK_TFLOPS`, or `--peak-tflops`); none on the CPU.

Models are random-init from published shapes (GPU machines here have no hub access): a
random model's loss means nothing, but its FLOPs and memory are the real ones.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from rftpipe.config.schema import KLConfig, LoraConfig, TrainConfig
from rftpipe.dist import Dist, init_from_env
from rftpipe.engines import models
from rftpipe.engines.lora import apply_lora
from rftpipe.engines.train import TRAIN_ENGINES
from rftpipe.observe import perf
from rftpipe.run.runtime import place_for_engine
from rftpipe.stages import batching
from rftpipe.stages import train as train_stage
from tools.bench import Benchmark
from tools.bench.harness import parser, write_json

SHAPES: dict[str, dict] = {
    # builtin:tiny's shape (rftpipe.engines.models.prepare_tiny): a smoke check, on the CPU too.
    "tiny": dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M(-Instruct)'s own config: the default policy.
    "135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-0.5B's shape as a Llama (Qwen2's q/k/v biases left out: 0.1 % of its FLOPs).
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}

#: Backend names on the command line: (train.backend, train.zero_stage).
BACKENDS: dict[str, tuple[str, int]] = {
    "single": ("single", 2),
    "fsdp2": ("fsdp2", 2),
    "zero2": ("deepspeed", 2),
    "zero3": ("deepspeed", 3),
}


def build_model(shape: str) -> torch.nn.Module:
    """A seeded random-init Llama of `shape`, fp32 on the CPU (as `load_causal_lm` loads)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def synthetic_rows(a: argparse.Namespace, vocab: int) -> list[dict]:
    """`a.prompts` groups of `a.samples` rows, as the advantage stage commits them."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for pid in range(a.prompts):
        prompt = torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist()
        for k in range(a.samples):
            resp = torch.randint(3, vocab, (a.response_len,), generator=g).tolist()
            # Near a random model's own logprobs (about -log V): the PPO ratio stays
            # unclipped, as in a real first epoch, so every token carries a gradient.
            old = (-math.log(vocab) + 0.05 * torch.randn(a.response_len, generator=g)).tolist()
            rows.append(
                {
                    "prompt_id": pid,
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "response_token_ids": resp,
                    "logprobs": old,
                    "advantages": [1.0 if k % 2 else -1.0] * a.response_len,
                    "ref_logprobs": old,
                    "response_length": a.response_len,
                }
            )
    return rows


def measure(name: str, a: argparse.Namespace, dist: Dist) -> dict:
    """Median throughput of `a.steps` train-stage calls of backend `name` (after warm-up)."""
    skipped = skip_reason(name, dist)
    if skipped:
        return {"backend": name, "skipped": skipped}
    cfg, model, engine, shape, trainable = build_engine(name, a, dist)
    rows = synthetic_rows(a, shape.vocab)
    try:
        steps = run_steps(a, cfg, engine, dist, rows)
    except torch.OutOfMemoryError as exc:
        return {"backend": name, "skipped": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        del engine, model
        gc.collect()
        if dist.device.type == "cuda":
            torch.cuda.empty_cache()
    return record(name, a, dist, shape, trainable, len(rows), steps)


def skip_reason(name: str, dist: Dist) -> str | None:
    """Why backend `name` cannot run here, if it cannot."""
    backend = BACKENDS[name][0]
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    if backend == "single" and dist.world > 1:
        return "single runs on one rank"
    return None


def build_engine(name: str, a: argparse.Namespace, dist: Dist) -> tuple:
    """(train config, model, engine, the model's shape, this rank's trainable parameters)
    of backend `name`, built as the pipeline builds them."""
    backend, zero_stage = BACKENDS[name]
    cfg = TrainConfig(
        backend=backend,
        zero_stage=zero_stage,
        param_dtype=a.dtype,
        gradient_checkpointing=a.gradient_checkpointing,
        cpu_offload=a.cpu_offload,
        max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
        lr=1e-6,
        micro_batch_size=a.micro_batch,
    )
    if a.model:
        # Real weights (a `model.path` value), loaded as the pipeline loads them.
        model = models.load_causal_lm(models.resolve_model_path(a.model), "float32")
    else:
        model = build_model(a.shape)
    if a.lora:
        model = apply_lora(model, LoraConfig(r=a.lora, alpha=2 * a.lora), run_seed=0, role="actor")
    model = place_for_engine(model, backend, dist)
    shape = perf.model_shape(model)
    engine = TRAIN_ENGINES[backend](model, cfg, dist, role="actor", total_updates=a.steps)
    # Of this rank's module (a shard of it under ZeRO-3).
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return cfg, model, engine, shape, trainable


def run_steps(
    a: argparse.Namespace, cfg: TrainConfig, engine: Any, dist: Dist, rows: list[dict]
) -> list[dict]:
    """`a.steps` train-stage calls on `rows` (this rank's share of whole groups, as the
    rollout stage deals them): each call's metrics and its `step_s`."""
    mine = [r for r in rows if r["prompt_id"] % dist.world == dist.rank]
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dist.device)
    steps = []
    for s in range(1, a.steps + 1):
        t0 = perf.clock(dist.device)
        steps.append(_step(engine, cfg, dist, rows, mine, s))
        steps[-1]["step_s"] = perf.clock(dist.device) - t0
    return steps


def record(
    name: str,
    a: argparse.Namespace,
    dist: Dist,
    shape: Any,
    trainable: int,
    rows: int,
    steps: list[dict],
) -> dict:
    """The JSON record of backend `name`: its settings, and its medians over the steps
    after `--warmup`."""
    cuda = dist.device.type == "cuda"
    steady = steps[a.warmup :] or steps
    tflops = statistics.median(m["perf/train_tflops"] for m in steady)
    dtype = perf.compute_dtype(a.dtype, "float32")
    peak = perf.peak_tflops(dist.device, dtype, a.peak_tflops)
    return {
        "backend": name,
        "shape": a.model or a.shape,
        "lora_r": a.lora,
        "trainable_params": trainable,
        "device": torch.cuda.get_device_name(dist.device) if cuda else "cpu",
        "world": dist.world,
        "dtype": a.dtype,
        "gradient_checkpointing": a.gradient_checkpointing,
        "cpu_offload": a.cpu_offload,
        "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
        "non_embedding_params": shape.non_embedding_params,
        "rows": rows,
        "prompt_len": a.prompt_len,
        "response_len": a.response_len,
        "micro_batch": a.micro_batch,
        "tokens_per_step": rows * (a.prompt_len + a.response_len),
        "tokens_per_s": statistics.median(m["perf/train_tokens_per_s"] for m in steady),
        "tokens_per_s_steps": [m["perf/train_tokens_per_s"] for m in steps],
        "tflops": tflops,
        "peak_tflops": peak,
        "mfu": perf.mfu(tflops, peak, dist.world).get("perf/mfu"),
        "peak_mem_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30 if cuda else None,
        "step_s": statistics.median(m["step_s"] for m in steady),
        # The process's high-water host memory, largest over ranks (one backend per process
        # for a figure of its own: it never goes down).
        "peak_rss_gib": float(
            dist.all_reduce_max(torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))[
                0
            ]
        )
        / 2**20,
        "grad_norm": steady[-1]["train/grad_norm"],
    }


def _step(engine, cfg: TrainConfig, dist: Dist, rows: list[dict], mine: list[dict], step: int):
    inp = batching.TrainInputs(
        step=step,
        run_seed=0,
        table=pa.Table.from_pylist(mine),
        global_samples=[(r["prompt_id"], r["sample_idx"]) for r in rows],
        kl_coef=0.0,
        temperature=1.0,
    )
    return train_stage.run(cfg, KLConfig(mode="none"), engine, dist, inp)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("mfu", __doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=["single", "fsdp2"])
    p.add_argument("--prompts", type=int, default=8, help="groups per step")
    p.add_argument("--samples", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", choices=["none", "optimizer", "all"], default="none")
    p.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=0,
        help="token budget (0: --micro-batch rows)",
    )
    p.add_argument(
        "--model", default="", help="a model.path value (real weights) instead of --shape"
    )
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer (0: full)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's peak")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    dist = init_from_env(require_group=any(BACKENDS[b][0] != "single" for b in a.backends))
    results = [measure(b, a, dist) for b in a.backends]
    if torch.distributed.is_initialized():
        # Left to interpreter exit, half of the tiny bf16 ZeRO-3 runs aborted at teardown
        # ("terminate called without an active exception"); the worker ends the same way.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if not dist.is_main:
        return 0
    for r in results:
        if "skipped" in r:
            print(f"{r['backend']:>7}  skipped: {r['skipped']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
        mem = "" if r["peak_mem_gib"] is None else f"  peak {r['peak_mem_gib']:.1f} GiB"
        print(
            f"{r['backend']:>7}  {r['shape']} on {r['world']} x {r['device']} ({r['dtype']}): "
            f"{r['tokens_per_s']:,.0f} tok/s  {r['tflops']:.3g} TFLOP/s  MFU {mfu}{mem}"
        )
    if a.out:
        write_json(a.out, results)
    return 0


BENCHMARK = Benchmark(
    name="mfu",
    runs="the real train stage (stages.train.run) per backend (single, fsdp2, zero2, zero3) "
    "on a synthetic GRPO batch, a random-init model of a published shape or real weights",
    measures="tokens/s, TFLOP/s and MFU (median over the steps after warm-up), step seconds, "
    "peak GPU memory and peak host memory",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
