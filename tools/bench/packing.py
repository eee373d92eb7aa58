"""The sharded backends' train forward: padded rows against packed ones, through the root.

    python -m tools.bench packing [--model smollm2|tiny] [--groups 1] [--n 8]
                                  [--prompt-tokens 48] [--min-tokens 8] [--max-tokens 96]
                                  [--runs 5] [--threads 2] [--device cpu|cuda]
                                  [--variants padded,packed,unshared,forest]

Times one forward (logprobs and entropy of every response token) plus the backward of
their sum, each through the model's own forward as `fsdp2` and `deepspeed` run it, on
synthetic rows: `--groups` prompts of about `--prompt-tokens` tokens, `--n` responses each
of a length drawn uniformly from [--min-tokens, --max-tokens] (seeded). Variants:

- `padded`: `root_forward_logprobs`, one right-padded row per sample (today's path);
- `packed`: `packing.packed_logprobs` (what `train.packing` runs), one sequence holding
  each prompt once and then its rows' responses under a block-diagonal causal mask, the
  head on the loss positions only;
- `unshared`: the same with a copy of the prompt per row (`share_prompts=False`);
- `forest`: the prefix forest `single` runs (one row per prompt group, its prompt once),
  fed through the root forward with its 4-D mask and positions, the head from the earliest
  response position on.

The variants alternate run by run after one warm-up each; prints each one's median
seconds, its peak memory for one forward+backward (CUDA: the allocator's high-water mark;
CPU: the process's peak RSS over its RSS before the run, measured in a fresh child process
per variant, the high-water mark reset through /proc/self/clear_refs after the load),
and the largest logprob difference from `padded`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from tools.bench import Benchmark
from tools.bench.harness import (
    alternate,
    bench_cmd,
    fresh_process,
    parser,
    reset_rss_peak,
    rss_peak_since,
    timed,
)

Rows = tuple[list[list[int]], list[list[int]]]
Forward = Callable[[torch.nn.Module, list[list[int]], list[list[int]]], torch.Tensor]


def synthetic_rows(a: argparse.Namespace, vocab: int) -> Rows:
    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for g in range(a.groups):
        prompt = torch.randint(10, vocab, (a.prompt_tokens + 4 * g,), generator=gen).tolist()
        for _ in range(a.n):
            n = int(torch.randint(a.min_tokens, a.max_tokens + 1, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(10, vocab, (n,), generator=gen).tolist())
    return prompts, responses


def _padded(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]):  # noqa: ANN202
    from rftpipe.engines.train.forward import build_micro_batch, root_forward_logprobs

    mb = build_micro_batch(prompts, responses, pad_id=0).to(model.device)
    return root_forward_logprobs(model, mb, 1.0, True, entropy_grad=False)


def _packed(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]):  # noqa: ANN202
    from rftpipe.engines.train.packing import default_rows, pack_rows, packed_logprobs

    batch = pack_rows(default_rows(prompts, responses)).to(model.device)
    return packed_logprobs(model, batch, 1.0, True, entropy_grad=False)


def _unshared(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]):  # noqa: ANN202
    from rftpipe.engines.train.packing import default_rows, pack_rows, packed_logprobs

    batch = pack_rows(default_rows(prompts, responses), share_prompts=False).to(model.device)
    return packed_logprobs(model, batch, 1.0, True, entropy_grad=False)


def _forest(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]]):  # noqa: ANN202
    from rftpipe.algos.losses import entropy_from_logits, gather_logprobs
    from rftpipe.engines.train.forward import prefix_forest

    t_max = max(len(r) for r in responses)
    f = prefix_forest(prompts, responses, t_max)
    dev = model.device
    first = min(len(p) for p in prompts) - 1
    width = f.input_ids.shape[1]
    logits = model(
        input_ids=f.input_ids.to(dev),
        position_ids=f.position_ids.to(dev),
        attention_mask=f.attention_mask.to(dev),
        use_cache=False,
        logits_to_keep=width - first,
    ).logits
    # The forest's gather indexes (G * width) positions; the head kept width - first of each.
    g, col = f.gather // width, f.gather % width - first
    logits = logits[g.to(dev), col.clamp(min=0).to(dev)].float()
    resp = torch.zeros((len(responses), t_max), dtype=torch.long)
    for i, r in enumerate(responses):
        resp[i, : len(r)] = torch.tensor(r)
    lp = gather_logprobs(logits, resp.to(dev))
    with torch.no_grad():  # a metric, as the other variants' entropy_grad=False
        return lp, entropy_from_logits(logits.detach())


VARIANTS: dict[str, Callable] = {
    "padded": _padded,
    "packed": _packed,
    "unshared": _unshared,
    "forest": _forest,
}


def _mask(responses: list[list[int]], lp: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros_like(lp, dtype=torch.bool)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = True
    return mask


def run_once(fn: Callable, model: torch.nn.Module, rows: Rows) -> tuple[float, torch.Tensor]:
    """Seconds of one forward+backward of variant `fn`, and its logprobs."""
    model.zero_grad(set_to_none=True)

    def forward_backward() -> torch.Tensor:
        lp, _ = fn(model, *rows)
        torch.where(_mask(rows[1], lp), lp, 0.0).sum().backward()
        return lp

    seconds, lp = timed(forward_backward, model.device.type == "cuda")
    return seconds, lp.detach().cpu()


def peak_bytes(fn: Callable, model: torch.nn.Module, rows: Rows) -> int:
    """One forward+backward's peak memory over what was in use before it (CPU: in a fresh
    process, from its RSS after loading the model, since pages freed to the allocator
    after a warm-up would hide a later run's peak)."""
    if model.device.type == "cuda":
        run_once(fn, model, rows)  # warm-up: allocator pools, lazily built kernels
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_once(fn, model, rows)
        return torch.cuda.max_memory_allocated() - before
    before = reset_rss_peak()
    run_once(fn, model, rows)
    return rss_peak_since(before)


def build(a: argparse.Namespace) -> tuple[torch.nn.Module, Rows]:
    from rftpipe.engines.models import load_causal_lm, prepare_smollm2, prepare_tiny

    torch.set_num_threads(a.threads)
    path = prepare_smollm2() if a.model == "smollm2" else prepare_tiny()
    model = load_causal_lm(path, "float32").to(a.device)
    model.train()
    return model, synthetic_rows(a, model.config.vocab_size)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("packing", __doc__)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--variants", default="padded,packed,unshared,forest")
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # child process: one variant's peak
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    model, rows = build(a)
    if a.memory_of:
        print(json.dumps(peak_bytes(VARIANTS[a.memory_of], model, rows)))
        return 0
    names = a.variants.split(",")
    rounds = alternate({k: lambda k=k: run_once(VARIANTS[k], model, rows) for k in names}, a.runs)
    out = {k: r[1] for k, r in rounds.warmup.items()}
    times = {k: [r[0] for r in runs] for k, runs in rounds.runs.items()}
    peak = {}
    for k in names:
        if a.device == "cuda":
            peak[k] = peak_bytes(VARIANTS[k], model, rows)
            continue
        argv_child = [*(argv if argv is not None else sys.argv[1:]), "--memory-of", k]
        child = fresh_process(bench_cmd("packing", *argv_child), capture=True)
        if child.code:
            raise SystemExit(f"--memory-of {k} failed:\n{child.stderr[-3000:]}")
        peak[k] = int(child.stdout.strip().splitlines()[-1])
    print_report(a, rows, times, out, peak)
    return 0


def print_report(
    a: argparse.Namespace,
    rows: Rows,
    times: dict[str, list[float]],
    out: dict[str, torch.Tensor],
    peak: dict[str, int],
) -> None:
    prompts, responses = rows
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    from rftpipe.engines.train.packing import default_rows, pack_rows

    packed_n = pack_rows(default_rows(prompts, responses)).input_ids.shape[1]
    where = f"{a.threads} threads" if a.device == "cpu" else torch.cuda.get_device_name()
    print(
        f"{a.model}, {a.groups} groups x {a.n} rows, prompts ~{a.prompt_tokens}, responses "
        f"{a.min_tokens}-{a.max_tokens} ({tokens} tokens, padded {len(prompts)} x {width}, "
        f"packed 1 x {packed_n}), "
        f"{where}, median of {a.runs}"
    )
    mask = _mask(responses, out["padded"]) if "padded" in out else None
    for k in times:
        diff = ""
        if mask is not None:
            d = float((torch.where(mask, out[k] - out["padded"], 0.0)).abs().max())
            diff = f", max |lp - padded| {d:.1e}"
        print(
            f"  {k:7s} {statistics.median(times[k]):.3f} s, peak {peak[k] / 2**20:.0f} MiB{diff}"
            f"  ({', '.join(f'{t:.3f}' for t in times[k])})"
        )


BENCHMARK = Benchmark(
    name="packing",
    runs="the sharded backends' train forward+backward through the model's root on "
    "synthetic rows of spread lengths: padded, packed, packed without prompt sharing, the "
    "prefix forest; alternating",
    measures="median seconds and peak memory of each variant (CPU: a fresh process per "
    "variant), and the largest logprob difference from padded",
    main=main,
)


if __name__ == "__main__":
    sys.exit(main())
