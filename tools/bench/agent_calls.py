"""Agent episodes on the HF loop: each episode's KV cache kept from one call to the next
(`rollout.agent.keep_kv_cache=true`, the default) against every call's whole prompt
prefilled again (`false`).

    python -m tools.bench agent_calls [--model tiny|smollm2] [--episodes 8] [--n 2] [--calls 4]
                                      [--max-new 32] [--msg-tokens 100] [--runs 3] [--threads 1]

Runs `stages.agents.run` (the rollout stage's agent driver: the endpoint, one agent
process per episode, one engine call per call index) on `--episodes` episodes, `--n`
samples of each of `--episodes / --n` chat prompts. Each episode's agent (`chat`, below:
plain `openai` client code) makes `--calls` calls, appending each answer and a user
message of about `--msg-tokens` tokens. Every call samples exactly `--max-new` tokens
(`min_new_tokens` = `max_new_tokens`), so both sides do the same work even where float
rounding changes a sampled token.

The sides alternate run by run after one warm-up each; prints per side the median over
`--runs` of each call index's engine call and of the whole stage (agents' processes
included), and between the two sides' first runs whether the episodes' tokens are equal
and the largest logprob difference.

This module is also the agent: its top level imports nothing heavy (nor does
`tools.bench.harness`'s), as every agent process imports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from tools.bench import Benchmark
from tools.bench.harness import parser, timed

SIDES = ("kept", "reprefill")


async def chat(
    task: dict[str, Any], client: Any, model: str, calls: int, message: str, max_tokens: int
) -> float:
    """`calls` chat calls, each answer appended as returned and followed by `message`."""
    messages: list[dict[str, Any]] = [dict(m) for m in task["messages"]]
    for _ in range(calls):
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens
        )
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": message})
    return 0.0


def run_side(a: argparse.Namespace, model: Any, tok: Any, kept: bool) -> dict[str, Any]:
    from rftpipe.config.schema import AgentConfig, RolloutConfig
    from rftpipe.engines.rollout.hf import HFGenerateEngine
    from rftpipe.stages import agents
    from tools.bench.turns import NoLog, TimedEngine, chat_prompts, observation

    agent = AgentConfig(
        path="tools.bench.agent_calls:chat",
        kwargs={
            "calls": a.calls,
            "message": observation(tok, a.msg_tokens),
            "max_tokens": a.max_new,
        },
        max_calls=a.calls,
        max_total_tokens=1 << 20,
        keep_kv_cache=kept,
    )
    cfg = RolloutConfig(
        n=a.n,
        max_new_tokens=a.max_new,
        min_new_tokens=a.max_new,
        groups_per_call=a.episodes // a.n,
        agent=agent,
    )
    engine = TimedEngine(HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id), "cpu")
    inp = agents.AgentInputs(
        cfg=cfg,
        agent=agent,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=[chat_prompts(tok, a.episodes // a.n)],
    )
    total, (out, _) = timed(lambda: agents.run(inp, engine, tok, NoLog()))
    eps = out.episodes
    assert all(len(e.turn_offsets) == a.calls and not e.branches for e in eps), "every call"
    return {
        "calls": engine.calls,
        "total": total,
        "tokens": [e.response for e in eps],
        "logprobs": [lp for e in eps for lp in e.logprobs],
        "response_tokens": statistics.mean(len(e.response) for e in eps),
        "prompt_tokens": statistics.mean(len(e.prompt_ids) for e in eps),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_smollm2, prepare_tiny
    from tools.bench.turns import kept_against_reprefill

    p = parser("agent_calls", __doc__)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--msg-tokens", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = {"tiny": prepare_tiny, "smollm2": prepare_smollm2}[a.model]()
    model = load_causal_lm(path, "float32")
    tok = load_tokenizer(path)
    first, report = kept_against_reprefill(
        SIDES,
        lambda kept: run_side(a, model, tok, kept),
        a.runs,
        per_call=("calls", "call_s", a.calls),
        total="stage_s",
    )
    out: dict[str, Any] = {
        "model": a.model,
        "threads": a.threads,
        "episodes": a.episodes,
        "calls": a.calls,
        "max_new": a.max_new,
        "prompt_tokens": first["prompt_tokens"],
        "response_tokens": first["response_tokens"],
        **report,
    }
    print(json.dumps(out))
    return 0


BENCHMARK = Benchmark(
    name="agent_calls",
    runs="agent episodes (stages.agents: the endpoint, one agent process per episode) with "
    "each episode's KV cache kept from call to call (kept) against whole prefills "
    "(reprefill), alternating",
    measures="median seconds of each call index's engine call and of the whole stage per "
    "side; whether both sampled the same tokens, and their largest logprob difference",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
