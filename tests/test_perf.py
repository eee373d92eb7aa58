"""Model FLOPs, peak lookup and MFU (rftpipe/observe/perf.py), and `tools.bench mfu` on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from helpers import ROOT

from rftpipe.dist import Dist
from rftpipe.engines.models import load_causal_lm, prepare_tiny
from rftpipe.observe import perf


def test_a_vision_models_shape_leaves_its_tower_out_also_under_lora(tiny_vl: Path) -> None:
    """builtin:tiny-vl's shape counts its text model alone; with LoRA adapters (on the
    text model) it adds exactly the adapters' parameters, the tower still left out."""
    from rftpipe.config.schema import LoraConfig
    from rftpipe.engines import lora

    model = load_causal_lm(tiny_vl, "float32")
    shape = perf.model_shape(model)
    tower = sum(p.numel() for p in model.model.visual.parameters())
    embeddings = model.get_input_embeddings().weight.numel()  # tied with the head
    total = sum(p.numel() for p in model.parameters())
    assert shape.non_embedding_params == total - tower - embeddings
    peft = lora.apply_lora(model, LoraConfig(r=4), 0, "actor")
    adapters = sum(p.numel() for n, p in peft.named_parameters() if ".lora_" in n)
    assert adapters > 0
    assert perf.model_shape(peft).non_embedding_params == shape.non_embedding_params + adapters


def test_tiny_model_flops_by_hand() -> None:
    model = load_causal_lm(prepare_tiny(), "float32")
    shape = perf.model_shape(model)
    # builtin:tiny: hidden 64, MLP 128, 2 layers, 4 heads of 32 (attention 128 wide), 2 KV
    # heads, 259 tokens, tied.
    q = o = 64 * 128
    k = v = 64 * (2 * 32)
    mlp = 3 * 64 * 128
    norms = 2 * 64
    per_layer = q + k + v + o + mlp + norms
    assert per_layer == 49280
    non_embedding = 2 * per_layer + 64  # + the final norm; embeddings and tied head excluded
    assert shape == perf.ModelShape(
        non_embedding_params=non_embedding, layers=2, attention_width=128, hidden=64, vocab=259
    )
    # Two rows of 5 and 3 tokens (prompt + response), 4 response tokens in all.
    dense = 6 * non_embedding * (5 + 3)
    # Causal: a row of s tokens has s(s+1)/2 query-key pairs, 2 matmuls x 2 FLOPs x 64 wide
    # each, x 3 for forward + backward, in each of 2 layers.
    attention = 3 * 2 * (2 * 2 * 128) * (5 * 6 // 2 + 3 * 4 // 2)
    head = 3 * 2 * 64 * 259 * 4
    assert dense + attention + head == 5_196_288
    assert perf.train_flops(shape, [5, 3], response_tokens=4) == 5_196_288


def test_train_work_counts_prompt_and_response_tokens_per_epoch() -> None:
    model = load_causal_lm(prepare_tiny(), "float32")
    table = pa.table(
        {
            "prompt_token_ids": [[1, 2, 3], [1, 2, 3]],
            "response_token_ids": [[4, 5], [6]],
        }
    )
    work = perf.train_work(model, table, epochs=2)
    assert work.dtype == torch.float64
    assert work[0] == 2 * (5 + 4)
    assert work[1] == 2 * perf.train_flops(perf.model_shape(model), [5, 4], response_tokens=3)
    tp = perf.throughput(work, seconds=2.0)
    assert tp == {"perf/train_tokens_per_s": 9.0, "perf/train_tflops": float(work[1]) / 2e12}


def test_peak_lookup_override_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert perf.peak_tflops(cpu, "bfloat16") is None
    assert perf.peak_tflops(cpu, "bfloat16", override=100.0) == 100.0
    for name, bf16 in (
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H200", 989.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Some Future GPU", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d, n=name: n)
        assert perf.peak_tflops(gpu, "bfloat16") == bf16, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d: "NVIDIA H100 80GB HBM3")
    assert perf.peak_tflops(gpu, "float32") == 67.0  # fp32 matmuls without TF32 (default)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert perf.peak_tflops(gpu, "float32") == 494.5
    assert perf.compute_dtype("float32", "bfloat16") == "bfloat16"
    assert perf.compute_dtype("float32", "float32") == "float32"
    assert perf.mfu(494.75, 989.5, world=2) == {"perf/mfu": 0.25}
    assert perf.mfu(1.0, None, world=1) == {}


def test_dist_device_follows_local_rank() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert Dist().device.type == want
    if torch.cuda.is_available():
        want = torch.device("cuda", 1 % torch.cuda.device_count())
        assert Dist(rank=3, world=4, local_rank=1).device == want


@pytest.mark.slow
def test_mfu_tool_runs_the_train_stage_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "mfu.json"
    small = ["--prompts", "2", "--samples", "4", "--prompt-len", "12", "--response-len", "8"]
    cmd = [sys.executable, "-m", "tools.bench", "mfu", "--shape", "tiny", *small]
    cmd += ["--backends", "single", "fsdp2", "--steps", "3", "--warmup", "1"]
    cmd += ["--peak-tflops", "1.0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["backend"] for r in results] == ["single", "fsdp2"]
    for r in results:
        assert r["tokens_per_step"] == 8 * (12 + 8)
        assert len(r["tokens_per_s_steps"]) == 3 and r["tokens_per_s"] > 0
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 1.0)
        assert r["grad_norm"] > 0
