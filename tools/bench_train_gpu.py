"""GPU train-stage throughput: bf16 FSDP2 steps of random-init models, tokens/s and MFU.

    python -m tools.bench_train_gpu [--models smollm2-135m qwen2-1.5b] [--steps 6]

Runs the real train stage (`rftpipe.stages.train.run`) through the FSDP2 engine on one GPU
(NCCL, world size 1) with bf16 compute and fp32 master weights, gradient reduction and
AdamW state. GPU machines here have no hub access and a small upload limit, so models are
random-init from their published shapes; a random model's loss is meaningless, but its
FLOPs and memory are the real ones. Inputs are synthetic GRPO groups (one prompt, n
responses) with advantages of both signs and behaviour logprobs near the model's own.

FLOPs per step count the matmuls of forward + backward (3x forward): 2 x (decoder matmul
parameters) per token, causal attention (QK^T and AV over the tokens before each one), and
the LM head on the positions the loss reads (`logits_to_keep`). MFU divides by the dense
bf16 peak of the GPU (H100 SXM: 989 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import pyarrow as pa
import torch

from rftpipe.config.schema import KLConfig, TrainConfig
from rftpipe.dist import init_from_env
from rftpipe.engines.train import FSDP2Engine
from rftpipe.stages import train as train_stage

SHAPES: dict[str, dict] = {
    # SmolLM2-135M-Instruct's own config (the default policy).
    "smollm2-135m": dict(
        model_type="llama",
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
    # Qwen2-1.5B's published shape.
    "qwen2-1.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build_model(name: str, device: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def synthetic_rows(
    groups: int, n: int, prompt_len: int, response_len: int, vocab: int
) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for pid in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        for k in range(n):
            resp = torch.randint(3, vocab, (response_len,), generator=g).tolist()
            # A random model's logprobs sit near -log(vocab); behaviour logprobs close to
            # them keep the PPO ratio unclipped, as in a real first epoch.
            old = (-math.log(vocab) + 0.05 * torch.randn(response_len, generator=g)).tolist()
            adv = 1.0 if k % 2 else -1.0
            rows.append(
                {
                    "prompt_id": pid,
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "response_token_ids": resp,
                    "logprobs": old,
                    "advantages": [adv] * response_len,
                    "ref_logprobs": old,
                    "response_length": response_len,
                }
            )
    return rows


def step_flops(model: torch.nn.Module, rows: list[dict]) -> float:
    cfg = model.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    decoder = model.get_decoder()
    matmul = sum(
        p.numel() for n, p in decoder.layers.named_parameters() if p.ndim == 2 and "norm" not in n
    )
    fwd = 0.0
    for r in rows:
        s = len(r["prompt_token_ids"]) + len(r["response_token_ids"])
        fwd += 2 * matmul * s
        # QK^T and AV: each query attends to the keys up to itself (causal).
        fwd += layers * 2 * 2 * heads * head_dim * s * (s + 1) / 2
        fwd += 2 * hidden * cfg.vocab_size * (len(r["response_token_ids"]) + 1)
    return 3 * fwd


def bench_one(name: str, a: argparse.Namespace) -> dict:
    dist = init_from_env(require_group=True)
    model = build_model(name, a.device)
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = TrainConfig(
        backend="fsdp2",
        param_dtype="bfloat16",
        lr=1e-6,
        micro_batch_size=a.micro_batch,
    )
    engine = FSDP2Engine(model, cfg, dist, total_updates=a.steps)
    rows = synthetic_rows(a.groups, a.n, a.prompt_len, a.response_len, model.config.vocab_size)
    table = pa.Table.from_pylist(rows)
    samples = [(r["prompt_id"], r["sample_idx"]) for r in rows]
    flops = step_flops(model, rows)
    tokens = sum(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for step in range(1, a.steps + 1):
        inp = train_stage.TrainInputs(
            step=step,
            run_seed=0,
            table=table,
            global_samples=samples,
            kl_coef=0.0,
            temperature=1.0,
        )
        sync()
        t0 = time.perf_counter()
        metrics = train_stage.run(cfg, KLConfig(mode="none"), engine, dist, inp)
        sync()
        times.append(time.perf_counter() - t0)
    steady = times[a.warmup :]
    med = statistics.median(steady)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), float("nan"))
    out = {
        "model": name,
        "params": n_params,
        "gpu": gpu,
        "torch": torch.__version__,
        "rows": len(rows),
        "prompt_len": a.prompt_len,
        "response_len": a.response_len,
        "micro_batch": a.micro_batch,
        "tokens_per_step": tokens,
        "step_s": times,
        "median_step_s": med,
        "tokens_per_s": tokens / med,
        "tflops": flops / med / 1e12,
        "mfu": flops / med / 1e12 / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "grad_norm": metrics["train/grad_norm"],
        "pg_loss": metrics["train/pg_loss"],
    }
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            train_stage.run(cfg, KLConfig(mode="none"), engine, dist, inp)
            sync()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        a.profile.write_text(prof.key_averages().table(sort_by=key, row_limit=25))
    del engine, model
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--groups", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke check")
    p.add_argument("--profile", type=Path, default=None, help="one extra step's top ops here")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_train_gpu: no CUDA device (--device cpu runs a smoke check)")
        return 2
    results = [bench_one(name, a) for name in a.models]
    for r in results:
        print(
            f"{r['model']:>13}  {r['params'] / 1e6:7.1f}M params  {r['gpu']}  "
            f"{r['rows']} rows x {r['prompt_len']}+{r['response_len']} tok, micro {r['micro_batch']}: "
            f"median step {r['median_step_s']:.3f} s  {r['tokens_per_s']:,.0f} tok/s  "
            f"{r['tflops']:.0f} TFLOP/s  MFU {100 * r['mfu']:.1f} %  "
            f"peak {r['peak_mem_gib']:.1f} GiB"
        )
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
