"""Single-device train forward+backward (`grouped_logprobs`) against an earlier revision's.

    python -m tools.bench forward [--model smollm2|smollm2-shape|tiny] [--groups 4] [--n 8]
                                  [--prompt-tokens 60] [--tokens 16] [--runs 7]
                                  [--threads 2] [--device cpu|cuda] [--checkpointing]
                                  [--baseline REV_OR_FILE|same]
                                  [--chunk N] [--baseline-chunk N]

Times one forward (logprobs and entropy of every response token) plus the backward of
their sum on synthetic groups: `--groups` prompts of about `--prompt-tokens` tokens (each
a little longer than the one before, so groups differ in length), `--n` responses of
`--tokens` tokens each. The baseline is `rftpipe/engines/train/forward.py` as of git
revision REV (or, for a revision before that file existed, a copy of its train module at a
path), loaded beside the working tree's; the two alternate run by run, after one warm-up
each, so the machine's drift falls on both alike. Prints the
median seconds of each and their ratio (current / baseline), the largest logprob
difference between them, and on CUDA each one's peak memory. `smollm2-shape` is a
random-init model of SmolLM2-135M's shape (no weights needed); `--checkpointing` turns on
activation checkpointing for both. `--chunk`/`--baseline-chunk` set each side's
`train.logprob_chunk_size` (`--baseline same` compares two chunk sizes of the working tree).
On CPU each side's peak is the resident-set high-water mark over the call's start (reset
through /proc/self/clear_refs), its first call only, before the allocator holds pages.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from tools.bench import Benchmark
from tools.bench.harness import ROOT, alternate, parser, reset_rss_peak, rss_peak_since


def load_revision(rev: str) -> ModuleType:
    """`rftpipe.engines.train.forward` as of git revision `rev` (or from the file `rev`), as a
    module of its own."""
    path = Path(rev)
    if not path.is_file():
        source = subprocess.run(
            ["git", "show", f"{rev}:rftpipe/engines/train/forward.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = Path(tempfile.mkdtemp()) / "baseline_train.py"
        path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_rows(a: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for g in range(a.groups):
        prompt = torch.randint(10, vocab, (a.prompt_tokens + 4 * g,), generator=gen).tolist()
        for _ in range(a.n):
            prompts.append(prompt)
            responses.append(torch.randint(10, vocab, (a.tokens,), generator=gen).tolist())
    return prompts, responses


def time_once(fn, model, prompts, responses) -> tuple[float, torch.Tensor, int]:  # noqa: ANN001
    """Seconds of one forward+backward, its logprobs, and its peak bytes over its start
    (CUDA allocations, or on CPU the resident set)."""
    model.zero_grad(set_to_none=True)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        start = reset_rss_peak()
    t0 = time.perf_counter()
    lp, ent = fn(model, prompts, responses, 1.0, with_entropy=True, entropy_grad=False)
    lp.sum().backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = rss_peak_since(start)
    return time.perf_counter() - t0, lp.detach(), peak


def build_model(name: str):  # noqa: ANN201 (a transformers model)
    from rftpipe.engines.models import load_causal_lm, prepare_smollm2, prepare_tiny

    if name == "smollm2-shape":
        from tools.bench.mfu import build_model as random_llama

        return random_llama("135m")
    return load_causal_lm(prepare_smollm2() if name == "smollm2" else prepare_tiny(), "float32")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    torch.set_num_threads(a.threads)

    from rftpipe.engines.train import base
    from rftpipe.engines.train import forward as current

    baseline = current if a.baseline == "same" else load_revision(a.baseline)
    model = build_model(a.model).to(a.device)
    model.config.use_cache = False
    if a.checkpointing:
        base.enable_activation_checkpointing(model)
    model.train()
    prompts, responses = synthetic_rows(a, model.config.vocab_size)

    def with_chunk(fn: Callable, chunk: int) -> Callable[[], tuple[float, torch.Tensor, int]]:
        def run() -> tuple[float, torch.Tensor, int]:
            kw = {"chunk": chunk} if chunk else {}
            return time_once(lambda *x, **k: fn(*x, **k, **kw), model, prompts, responses)

        return run

    rounds = alternate(
        {
            "current": with_chunk(current.grouped_logprobs, a.chunk),
            "baseline": with_chunk(baseline.grouped_logprobs, a.baseline_chunk),
        },
        a.runs,
    )
    # The warm-up's logprobs and peak (its first call, before the allocator holds pages).
    out = {k: r[1] for k, r in rounds.warmup.items()}
    peak = {k: r[2] for k, r in rounds.warmup.items()}
    times = {k: [r[0] for r in runs] for k, runs in rounds.runs.items()}
    print_report(a, times, out, peak)
    return 0


def print_report(
    a: argparse.Namespace,
    times: dict[str, list[float]],
    out: dict[str, torch.Tensor],
    peak: dict[str, int],
) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    shape = f"{a.groups} groups x {a.n} samples, prompts ~{a.prompt_tokens}, responses {a.tokens}"
    where = f"{a.threads} threads" if a.device == "cpu" else torch.cuda.get_device_name()
    ckpt = ", checkpointing" if a.checkpointing else ""
    print(f"{a.model}, {shape}, {where}{ckpt}, median of {a.runs}")
    print(f"  chunk: current {a.chunk}, baseline {a.baseline_chunk} ({a.baseline})")
    for k in times:
        mem = f", peak +{peak[k] / 2**20:.0f} MiB"
        print(f"  {k:8s} {med[k]:.4f} s{mem}  ({', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"  ratio current/baseline: {med['current'] / med['baseline']:.3f}")
    print(
        f"  max |logprob difference|: {float((out['current'] - out['baseline']).abs().max()):.2e}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("forward", __doc__)
    p.add_argument("--model", choices=["smollm2", "smollm2-shape", "tiny"], default="smollm2")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--baseline", default="HEAD")
    p.add_argument("--chunk", type=int, default=0)
    p.add_argument("--baseline-chunk", type=int, default=0)
    return p.parse_args(argv)


BENCHMARK = Benchmark(
    name="forward",
    runs="the single backend's train forward+backward (grouped_logprobs) on synthetic "
    "groups, the working tree's against a git revision's (or two chunk sizes), alternating",
    measures="median seconds of each and their ratio, peak memory of each (CUDA allocator or "
    "CPU resident set), and the largest logprob difference between them",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
