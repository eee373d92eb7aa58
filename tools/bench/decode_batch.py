"""The HF loop's decode batch: rows that ended leaving it (`rollout.compact_decode=auto`)
against the static batch that feeds every row until the call's last row ends.

    python -m tools.bench decode_batch [--model smollm2|tiny] [--groups 6] [--n 8]
                                       [--max-new 16] [--short 4:14] [--long-frac 0.15]
                                       [--runs 5] [--threads 2]
    python -m tools.bench decode_batch --costs [--model smollm2|tiny] [--widths 64,256]
                                       [--batches 48,24,12,4] [--runs 7]

One call of `--groups` chat prompts x `--n` samples, as the rollout stage makes it
(`generate_rows` on runs of equal prompts: each prompt prefilled once, its cache shared by
its samples), with each row's length set by its own limit so both sides decode the same
tokens: a `--long-frac` share of the rows runs to `--max-new`, the others to a length drawn
uniformly from `--short` (seeded). The default mimics the default run's responses (mean
about 9.5 tokens, most steps holding a row at the 16-token limit); a long tail is, say,
`--max-new 96 --short 8:40 --long-frac 0.1`.

Sides, alternated run by run after a warm-up: `static` (`decode_batch.STATIC`), `auto`
(`AUTO`, the default) and `every` (each ended row leaves at once). Prints per side the
median seconds of the call, the decode rows fed against the static batch's, the ratios to
static, and whether the sides' tokens are equal and their largest logprob difference.

`--costs`: what a decode forward costs per batch size, and what an exact row selection of
the KV cache (keeping three quarters of the rows) costs, at each cache width: the two
sides of "compaction pays" (rftpipe/engines/rollout/decode_batch.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable

import torch
from transformers import DynamicCache

from rftpipe.config.schema import RolloutConfig
from rftpipe.data.prompts import template_prompt
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_smollm2, prepare_tiny
from rftpipe.engines.rollout import decode_batch
from rftpipe.engines.rollout.base import SampleOutput
from rftpipe.engines.rollout.hf import HFGenerateEngine
from tools.bench import Benchmark
from tools.bench.harness import alternate, parser, timed

SIDES = {"static": decode_batch.STATIC, "auto": decode_batch.AUTO, "every": decode_batch.EVERY}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("decode_batch", __doc__)
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--short", default="4:14", help="A:B, the short rows' lengths")
    p.add_argument("--long-frac", type=float, default=0.15)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--costs", action="store_true", help="time a decode forward and a selection")
    p.add_argument("--widths", default="64,256")
    p.add_argument("--batches", default="48,24,12,4")
    return p.parse_args(argv)


def _model(name: str) -> tuple[torch.nn.Module, object]:
    path = prepare_smollm2() if name == "smollm2" else prepare_tiny()
    return load_causal_lm(path, "float32").eval(), load_tokenizer(path)


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    return 1e3 * statistics.median(timed(fn)[0] for _ in range(runs))


def _costs(a: argparse.Namespace, model: torch.nn.Module) -> dict:
    """Per cache width and batch size: a decode forward's ms, and a selection's ms."""
    g = torch.Generator().manual_seed(0)
    return {
        f"width={width} rows={rows}": _cost_at(model, width, rows, a.runs, g)
        for width in map(int, a.widths.split(","))
        for rows in map(int, a.batches.split(","))
    }


@torch.no_grad()
def _cost_at(
    model: torch.nn.Module, width: int, rows: int, runs: int, g: torch.Generator
) -> dict[str, float]:
    ids = torch.randint(0, 1000, (rows, width), generator=g)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    mask = torch.ones(rows, width + 1, dtype=torch.long)
    pos = torch.full((rows, 1), width)
    keep = torch.arange(rows * 3 // 4)

    def step() -> None:
        model(
            input_ids=ids[:, :1],
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(width)

    def select() -> None:
        for layer in cache.layers:
            layer.keys.index_select(0, keep)  # type: ignore[union-attr]
            layer.values.index_select(0, keep)  # type: ignore[union-attr]

    return {"decode_forward_ms": _median_ms(step, runs), "select_3/4_ms": _median_ms(select, runs)}


def _limits(a: argparse.Namespace) -> list[int]:
    lo, hi = map(int, a.short.split(":"))
    rnd = random.Random(0)
    rows = a.groups * a.n
    return [a.max_new if rnd.random() < a.long_frac else rnd.randint(lo, hi) for _ in range(rows)]


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    torch.set_num_threads(a.threads)
    model, tok = _model(a.model)
    if a.costs:
        json.dump(_costs(a, model), sys.stdout, indent=2)
        print()
        return 0
    cfg = RolloutConfig(n=a.n, max_new_tokens=a.max_new, min_new_tokens=a.max_new)
    # No EOS ends a row (min_new_tokens = max_new_tokens masks it): each row's own limit does.
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)  # type: ignore[attr-defined]
    prompts = [
        template_prompt(tok, "Be brief.", f"What is {7 + 3 * g} plus {11 + 5 * g}?")
        for g in range(a.groups)
    ]
    rows = [p for p in prompts for _ in range(a.n)]
    seeds = list(range(len(rows)))
    limits = _limits(a)

    def side(rule: decode_batch.CompactRule) -> object:
        def run() -> tuple[float, list[SampleOutput], int]:
            engine.compaction = rule
            s, out = timed(lambda: engine.generate_rows(rows, seeds, limits))
            return s, out, engine.take_decode_counts().row_steps

        return run

    rounds = alternate({name: side(rule) for name, rule in SIDES.items()}, a.runs)
    secs = {k: statistics.median(r[0] for r in v) for k, v in rounds.runs.items()}
    first = rounds.warmup
    fed = {k: first[k][2] for k in SIDES}
    worst = {
        k: max(
            abs(x - y)
            for s, o in zip(first["static"][1], first[k][1], strict=True)
            for x, y in zip(s.logprobs, o.logprobs, strict=True)
        )
        for k in SIDES
    }
    out = {
        "rows": len(rows),
        "mean_length": statistics.mean(limits),
        "median_s": secs,
        "vs_static": {k: secs[k] / secs["static"] for k in SIDES},
        "rows_fed": fed,
        "rows_fed_vs_static": {k: fed[k] / fed["static"] for k in SIDES},
        "tokens_equal": {
            k: [s.tokens for s in first[k][1]] == [s.tokens for s in first["static"][1]]
            for k in SIDES
        },
        "max_logprob_diff": worst,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


BENCHMARK = Benchmark(
    name="decode_batch",
    runs="one HF rollout call of rows with set lengths, ended rows leaving the decode batch "
    "(auto, every) against the static batch, alternated; with --costs, a decode forward per "
    "batch size and a KV-cache row selection per width",
    measures="median seconds per side and ratios to static, rows fed, token equality and max "
    "logprob difference; decode and selection milliseconds",
    main=main,
)
