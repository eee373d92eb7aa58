"""What an upcycled MoE policy costs in the train forward+backward: against the dense
model it was made from, and with routing replay against without; with `--decode`, what
one decode step costs at each batch size.

    python -m tools.bench moe [--model smollm2|tiny] [--experts 4] [--top-k 2]
                              [--groups 2] [--n 8] [--prompt-tokens 48]
                              [--min-tokens 8] [--max-tokens 32] [--runs 7] [--threads 2]
    python -m tools.bench moe --decode 8,48 [--prompt-tokens 30] [--steps 10] [--runs 7]

Upcycles the dense model (`model.upcycle`: E experts, top-k), then times one forward
(logprobs and entropy of every response token, through the prefix forest `single` runs)
plus the backward of their sum, on synthetic rows (`--groups` prompts, `--n` responses
each, lengths drawn uniformly, seeded), three ways, alternated run by run after a warm-up:

- `dense`: the dense model itself (no routers);
- `live`: the routers select as they do without replay (the hooks still count load and
  collect the load-balancing loss, as every MoE forward does);
- `replay`: every token's experts forced to routes recorded from a no-grad pass of the
  same rows (R3's and R2's path: the plan laid out, weights regathered from the softmax).

Prints each side's median seconds, the ratios replay/live and live/dense, the largest
logprob difference between replay and live (the recorded routes are the live selection,
so 0) and between live and dense (upcycling's float error), and the bytes routes take per
fed token.

`--decode B1,B2,...`: for each batch size B, B random prompts of `--prompt-tokens` tokens
are prefilled (no-grad, eval mode, a KV cache, as the HF rollout loop runs), then
`--steps` decode steps of one token per row are timed one by one; a run's figure is the
median step. The dense model and the MoE (routed live, no hooks) alternate run by run.
Prints per B each side's median of the runs' medians (milliseconds), MoE/dense, and the
milliseconds per row. Which rows share a decode call is `rollout.groups_per_call`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from tools.bench import Benchmark
from tools.bench.harness import alternate, parser, timed
from tools.bench.packing import synthetic_rows


def _models(a: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the dense model, its upcycled MoE)."""
    from rftpipe.config.schema import ModelConfig, UpcycleConfig
    from rftpipe.engines.models import load_causal_lm, resolve_policy_path

    path = {"smollm2": "builtin:smollm2-135m-instruct", "tiny": "builtin:tiny"}[a.model]
    dense = ModelConfig(path=path)
    cfg = ModelConfig(path=path, upcycle=UpcycleConfig(experts=a.experts, top_k=a.top_k))
    return (
        load_causal_lm(resolve_policy_path(dense), "float32"),
        load_causal_lm(resolve_policy_path(cfg), "float32"),
    )


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = parser("moe", __doc__)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", default="", help="batch sizes (comma-separated): time decode")
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args(argv)


def _decode_step_ms(model: torch.nn.Module, batch: int, a: argparse.Namespace) -> float:
    """The median milliseconds of `a.steps` decode steps after a prefill of `batch` rows."""
    gen = torch.Generator().manual_seed(batch)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(100, vocab, (batch, a.prompt_tokens), generator=gen)
    model.eval()
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        tok = ids[:, -1:]
        times = []
        for _ in range(a.steps):
            t, out = timed(
                lambda tok=tok: model(input_ids=tok, past_key_values=cache, use_cache=True)
            )
            tok = out.logits[:, -1:].argmax(-1)
            times.append(t)
    return 1e3 * statistics.median(times)


def _decode(a: argparse.Namespace, dense: torch.nn.Module, model: torch.nn.Module) -> dict:
    out: dict[str, dict[str, float]] = {}
    for b in (int(x) for x in a.decode.split(",")):
        rounds = alternate(
            {
                "dense": lambda b=b: _decode_step_ms(dense, b, a),
                "moe": lambda b=b: _decode_step_ms(model, b, a),
            },
            a.runs,
        )
        med = {k: statistics.median(v) for k, v in rounds.runs.items()}
        out[str(b)] = {
            "dense_ms": med["dense"],
            "moe_ms": med["moe"],
            "moe_over_dense": med["moe"] / med["dense"],
            "dense_ms_per_row": med["dense"] / b,
            "moe_ms_per_row": med["moe"] / b,
        }
    return {
        "model": a.model,
        "experts": a.experts,
        "top_k": a.top_k,
        "prompt_tokens": a.prompt_tokens,
        "steps": a.steps,
        "runs": a.runs,
        "threads": a.threads,
        "decode": out,
    }


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    torch.set_num_threads(a.threads)

    from rftpipe.engines import moe
    from rftpipe.engines.train.forward import grouped_logprobs

    dense, model = _models(a)
    if a.decode:
        json.dump(_decode(a, dense, model), sys.stdout, indent=2)
        print()
        return 0
    routers = moe.Routers.of(model)
    assert routers is not None
    prompts, responses = synthetic_rows(a, model.config.vocab_size)
    with torch.no_grad():
        recorded: list[torch.Tensor] = []
        with routers.recording(noise=0.0):
            rr = moe.RowRoutes(routers=routers, rows=[None] * len(prompts))
            grouped_logprobs(model, prompts, responses, 1.0, False, routes=rr)
            assert routers.last_slots is not None
            recorded = moe.cut_pairs(routers.take(), routers.last_slots, prompts, responses)

    def step(rows: list[torch.Tensor | None]) -> tuple[float, torch.Tensor]:
        def run() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            rr = moe.RowRoutes(routers=routers, rows=rows)
            lp, ent = grouped_logprobs(model, prompts, responses, 1.0, True, routes=rr)
            assert ent is not None
            (lp.sum() + ent.sum()).backward()
            routers.clear()
            return lp.detach()

        return timed(run)

    def dense_step() -> tuple[float, torch.Tensor]:
        def run() -> torch.Tensor:
            dense.zero_grad(set_to_none=True)
            lp, ent = grouped_logprobs(dense, prompts, responses, 1.0, True)
            assert ent is not None
            (lp.sum() + ent.sum()).backward()
            return lp.detach()

        return timed(run)

    sides = {
        "dense": dense_step,
        "live": lambda: step([None] * len(prompts)),
        "replay": lambda: step(list(recorded)),
    }
    rounds = alternate(sides, a.runs)
    med = {k: statistics.median(t for t, _ in v) for k, v in rounds.runs.items()}
    first = {k: v[1] for k, v in rounds.warmup.items()}
    diff = float((first["live"] - first["replay"]).abs().max())
    shape = routers.shape
    out = {
        "model": a.model,
        "experts": a.experts,
        "top_k": a.top_k,
        "rows": len(prompts),
        "tokens": sum(len(q) + len(r) for q, r in zip(prompts, responses, strict=True)),
        "runs": a.runs,
        "threads": a.threads,
        "median_s": med,
        "replay_over_live": med["replay"] / med["live"],
        "live_over_dense": med["live"] / med["dense"],
        "max_logprob_diff_replay_live": diff,
        "max_logprob_diff_live_dense": float((first["live"] - first["dense"]).abs().max()),
        "route_bytes_per_token": shape.per_token,
        "moe_layers": shape.layers,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


BENCHMARK = Benchmark(
    name="moe",
    runs="the train forward+backward (prefix forest) of a dense model, of its upcycled MoE "
    "routed live, and of the MoE with every token's experts replayed, alternated; with "
    "--decode, a decode step of each at each batch size",
    measures="median seconds per side, replay/live and live/dense ratios, max logprob "
    "differences, route bytes per token",
    main=main,
)
