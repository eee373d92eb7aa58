"""Greedy accuracy on held-out prompts, before the first and after the last step."""

from __future__ import annotations

import logging

from rftpipe.data import load_eval_prompts
from rftpipe.rewards import EXTRACTORS
from rftpipe.runtime import Runtime
from rftpipe.store import atomic_write_json, read_json

log = logging.getLogger(__name__)


def greedy_accuracy(rt: Runtime) -> dict[str, float]:
    cfg = rt.cfg
    held = load_eval_prompts(cfg.data, cfg.eval, rt.tokenizer)
    outs = rt.rollout_engine.greedy([p.token_ids for p in held.prompts], cfg.rollout.max_new_tokens)
    extract = EXTRACTORS[cfg.reward.extractor]
    scores = []
    for p, toks in zip(held.prompts, outs, strict=True):
        text = rt.tokenizer.decode(toks, skip_special_tokens=True)
        scores.append(
            float(
                held.scorer.score_answer(
                    extract(text), {"answer": p.answer, "metadata": p.metadata}
                )
            )
        )
    train_ids = {(p.text, p.answer) for p in rt.prompts.prompts}
    overlap = sum((p.text, p.answer) in train_ids for p in held.prompts)
    return {
        "accuracy": sum(scores) / len(scores),
        "exact": sum(s == 1.0 for s in scores) / len(scores),
        "n": len(scores),
        "overlap_with_train": overlap,
    }


def maybe_eval(rt: Runtime, when: str, step: int) -> None:
    """Record `when` ('before' at step 0, 'after' at the last step) in RUN/eval.json.

    Each is computed once per step: a run extended with a larger `total_steps` evaluates
    'after' again at its new last step.
    """
    if rt.cfg.eval.size == 0 or (when == "before" and step != 0):
        return
    path = rt.run.root / "eval.json"
    done = read_json(path) if path.exists() else {}
    if done.get(when, {}).get("step") == step:
        return
    result = greedy_accuracy(rt)
    log.info(
        "held-out greedy accuracy %s: %.3f (exact %.3f, n=%d)",
        when,
        result["accuracy"],
        result["exact"],
        result["n"],
    )
    if rt.dist.is_main:
        atomic_write_json(path, {**done, when: {**result, "step": step}})
