"""The built-in reward functions, and the component that runs them in this process.

Each in-process built-in is a factory: from the reward config (and the dataset's scorer,
or the rollout's response budget) it makes the function that scores one row. The
registry in `rftpipe.rewards` names them; `math_verify_score` runs in the worker pool
instead, by its import path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rftpipe.config.schema import RewardConfig, RewardFunctionConfig
from rftpipe.errors import UserError
from rftpipe.rewards.types import Outcome, RewardFn, RewardSample

Extractor = Callable[[str], str | None]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

EXTRACTORS: dict[str, Extractor] = {
    # The whole response is the answer: the policy must learn to answer tersely.
    "full": lambda r: r.strip().rstrip(".").strip() or None,
    "last_number": lambda r: m[-1] if (m := _NUMBER.findall(r)) else None,
    "answer_tag": lambda r: m.group(1).strip() if (m := _TAG.search(r)) else None,
}

_FORMAT_CHECKS: dict[str, Callable[[RewardSample], bool]] = {
    "full": lambda s: s.finish_reason == "stop" and "\n" not in s.response.strip(),
    "last_number": lambda s: s.finish_reason == "stop" and bool(_NUMBER.search(s.response)),
    "answer_tag": lambda s: len(_TAG.findall(s.response)) == 1,
}


def accuracy(cfg: RewardConfig, scorer: Any) -> RewardFn:
    extract = EXTRACTORS[cfg.extractor]

    def accuracy(s: RewardSample) -> float:
        if s.answer is None:
            raise ValueError("accuracy needs an answer column")
        if cfg.require_stop and s.finish_reason != "stop":
            return 0.0
        guess = extract(s.response)
        if scorer is not None and hasattr(scorer, "score_answer"):
            # The dataset's own verifier (reasoning-gym), fed the extracted answer.
            return float(scorer.score_answer(guess, {"answer": s.answer, "metadata": s.metadata}))
        return float(guess is not None and guess == s.answer.strip())

    return accuracy


def format_reward(cfg: RewardConfig, scorer: Any) -> RewardFn:
    check = _FORMAT_CHECKS[cfg.extractor]
    return lambda s: float(check(s))


def dense_even_tokens(cfg: RewardConfig, scorer: Any) -> RewardFn:
    """Synthetic dense reward for tiny random models: the share of even token ids.

    A random-init model never earns a verifier reward, so tests use this to get nonzero
    advantage variance in every group and a learnable signal.
    """

    def dense(s: RewardSample) -> float:
        ids = s.response_token_ids
        return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))

    return dense


def overlong(cfg: RewardConfig, response_budget: int) -> RewardFn:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", arXiv:2503.14476, Eq. 13).

    With ``L_max = rollout.max_new_tokens`` and ``L_cache = reward.overlong_buffer``:
    0 up to ``L_max - L_cache`` tokens, then falling linearly to ``-overlong_penalty`` at
    ``L_max`` (and ``-overlong_penalty`` beyond, which our engines never produce). Added to
    the task reward, it tells a truncated response from a wrong one without the cliff of a
    hard length penalty.
    """
    if not 1 <= cfg.overlong_buffer <= response_budget:
        raise UserError(
            f"reward.overlong_buffer={cfg.overlong_buffer} must be in [1, "
            f"rollout.max_new_tokens={response_budget}]"
        )
    start = response_budget - cfg.overlong_buffer

    def overlong(s: RewardSample) -> float:
        excess = min(len(s.response_token_ids) - start, cfg.overlong_buffer)
        return -cfg.overlong_penalty * max(0, excess) / cfg.overlong_buffer

    return overlong


def math_verify_score(s: RewardSample) -> float:
    """1.0 if the response's final mathematical answer equals the reference by
    math-verify (parse both, then verify: LaTeX, fractions, decimals, sets, boxed answers;
    `\\frac{1}{2}` equals 0.5), else 0.0. Runs in the worker pool (the `math_verify` entry
    of `rftpipe.rewards.BUILTINS`): sympy can take unbounded time on adversarial input,
    and the pool kills it."""
    from math_verify import parse, verify

    if s.answer is None:
        raise ValueError("math_verify needs an answer column")
    gold = parse(s.answer)
    if not gold:
        raise ValueError(f"math_verify cannot parse the reference answer {s.answer!r}")
    return float(verify(gold, parse(s.response)))


@dataclass(slots=True)
class InProcess:
    """A built-in, called in this process (ours, fast, never hangs)."""

    spec: RewardFunctionConfig
    fn: RewardFn

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        out: list[Outcome | None] = []
        for s in samples:
            try:
                out.append(Outcome("ok", self.fn(s)))
            except Exception as exc:
                out.append(Outcome("error", error=f"{type(exc).__name__}: {exc}"))
                if fail_fast:
                    return out + [None] * (len(samples) - len(out))
        return out
