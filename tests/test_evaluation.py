"""Held-out evaluation: the split, pass@k, and the durable `eval` stage of real runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import eval_rows, events, stage_history, submit

from rftpipe.config.schema import DataConfig, EvalConfig, ReasoningGymConfig
from rftpipe.data.prompts import content_key, load_prompts, split_held_out
from rftpipe.engines.models import build_tiny_tokenizer
from rftpipe.errors import UserError
from rftpipe.run.metrics import pass_at_k, summarize

ADDITION = ReasoningGymConfig(
    name="basic_arithmetic",
    size=60,
    seed=1,
    kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]},
)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 1 / 4),
        (4, 1, 4, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (8, 3, 4, 1 - 5 / 70),  # 1 - C(5,4)/C(8,4)
        (8, 8, 8, 1.0),
    ],
)
def test_pass_at_k_matches_the_formula(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_summarize_per_source_and_overall() -> None:
    """Two problems of source a (greedy right / wrong) and one of b; 2 samples each."""
    rows = [
        (1, "greedy", "a", True),
        (1, "sampled", "a", True),
        (1, "sampled", "a", False),
        (2, "greedy", "a", False),
        (2, "sampled", "a", False),
        (2, "sampled", "a", False),
        (3, "greedy", "b", True),
        (3, "sampled", "b", True),
        (3, "sampled", "b", True),
    ]
    table = pa.table(
        {
            "prompt_id": [r[0] for r in rows],
            "mode": [r[1] for r in rows],
            "metadata": [json.dumps({"data_source": r[2]}) for r in rows],
            "correct": [r[3] for r in rows],
        }
    )
    m = summarize(table, [1, 2])
    assert m["eval/problems"] == 3 and m["eval/a/problems"] == 2 and m["eval/b/problems"] == 1
    assert m["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    assert m["eval/a/greedy_accuracy"] == 0.5 and m["eval/b/greedy_accuracy"] == 1.0
    assert m["eval/a/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/a/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)


def _data() -> DataConfig:
    return DataConfig(reasoning_gym=ADDITION, max_prompt_tokens=128)


def test_holdout_carves_problems_out_of_training() -> None:
    tok = build_tiny_tokenizer()
    full = load_prompts(_data(), tok)
    ecfg = EvalConfig(size=100, holdout_fraction=0.25, seed=7)
    train, held = split_held_out(_data(), ecfg, full, tok)
    assert held is not None
    train_keys = {content_key(p) for p in train.prompts}
    held_keys = [content_key(p) for p in held.prompts]
    assert held_keys and not train_keys & set(held_keys)
    assert len(set(held_keys)) == len(held_keys)  # each problem once
    assert not {p.prompt_id for p in train.prompts} & {p.prompt_id for p in held.prompts}
    # Every prompt is on one side: training keeps all repeats of its problems.
    assert train_keys | set(held_keys) == {content_key(p) for p in full.prompts}
    assert len(train) + sum(content_key(p) in set(held_keys) for p in full.prompts) == len(full)
    # The split is a function of the salt: another seed holds out other problems.
    _, other = split_held_out(_data(), EvalConfig(size=100, holdout_fraction=0.25), full, tok)
    assert other is not None and {content_key(p) for p in other.prompts} != set(held_keys)
    # The training data (and so the run's data fingerprint) changed.
    assert train.fingerprint() != full.fingerprint()
    assert math.isclose(len(held_keys) / len(train_keys | set(held_keys)), 0.25, abs_tol=0.15)


def test_generated_held_out_drops_what_training_has() -> None:
    tok = build_tiny_tokenizer()
    full = load_prompts(_data(), tok)
    # Problems drawn under a far-away seed (reasoning-gym seeds item i with seed + i, so
    # near seeds give shifted copies): some new, none kept if trained on.
    train, held = split_held_out(_data(), EvalConfig(size=30, seed=10_000), full, tok)
    assert train is full and held is not None and len(held) > 0
    assert not {content_key(p) for p in held.prompts} & {content_key(p) for p in full.prompts}
    assert min(p.prompt_id for p in held.prompts) > max(p.prompt_id for p in full.prompts)
    # A generator whose every problem is also a training problem leaves nothing to hold out.
    tiny = DataConfig(
        reasoning_gym=ReasoningGymConfig(
            name="basic_arithmetic",
            size=400,
            seed=1,
            kwargs={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        ),
        max_prompt_tokens=128,
    )
    every = load_prompts(tiny, tok)
    gen = EvalConfig(size=5, seed=9)
    with pytest.raises(UserError, match="eval.holdout_fraction") as info:
        split_held_out(tiny, gen, every, tok)
    assert "\n" not in str(info.value)


EVAL = (
    "eval.size=10",
    "eval.holdout_fraction=0.3",
    "eval.every=2",
    "eval.samples=4",
    "eval.problems_per_call=2",
    "eval.k=[1,4]",
    "eval.metric=dense_even_tokens",
    "eval.threshold=0.5",
    "total_steps=4",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_eval_stage_is_durable_and_world_size_independent(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    out = submit(ref, *EVAL)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((ref / "eval.json").read_text())
    assert sorted(summary["steps"], key=int) == ["0", "2", "4"]
    assert summary["before"]["eval/overlap_with_train"] == 0
    assert summary["before"]["eval/problems"] > 0
    assert summary["before"]["eval/basic_arithmetic/problems"] == summary["before"]["eval/problems"]
    # The evaluations saw moving weights (the dense reward trains fast at lr 3e-3).
    tokens = [eval_rows(ref, s).column("response_token_ids").to_pylist() for s in (0, 4)]
    assert tokens[0] != tokens[1]
    rows = eval_rows(ref, 2)
    assert set(rows.column("mode").to_pylist()) == {"greedy", "sampled"}
    assert rows.num_rows == summary["steps"]["2"]["eval/problems"] * (1 + 4)
    metrics = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert "eval/pass@4" in metrics[2] and "eval/pass@4" not in metrics[1]

    # Killed right after step 2's sync commit (its eval not yet run), then right after
    # that eval's commit: the resumes (from the initial weights: no checkpoint yet) replay
    # steps 1-2, run step 2's eval once with step 2's weights, and never run it again.
    run = tmp_path / "killed"
    # stage_after_commit hits: step 0's eval (1), then 5 per step: the 11th is step 2's sync.
    for skip in (10, 0):
        env = {"RFTPIPE_FAULT": "stage_after_commit", "RFTPIPE_FAULT_SKIP": str(skip)}
        assert submit(run, *EVAL, env=env).returncode != 0
        last = [e for e in events(run) if e["event"] == "commit"][-1]
        assert (last["step"], last["stage"]) == (2, "sync" if skip else "eval"), last
    out = submit(run, *EVAL)
    assert out.returncode == 0, out.stderr[-3000:]
    history = stage_history(run)
    for step in (0, 2, 4):
        assert history[(step, "eval")].count("commit") == 1, history[(step, "eval")]
        seq = history[(step, "eval")]
        assert "begin" not in seq[seq.index("commit") + 1 :], seq
        assert eval_rows(run, step).equals(eval_rows(ref, step)), step
    assert json.loads((run / "eval.json").read_text()) == summary

    # Two ranks: the same problems, completions and scores (the initial weights: the
    # trainers' reduction orders differ afterwards).
    two = tmp_path / "two"
    out = submit(
        two, *EVAL, "total_steps=1", "train.backend=fsdp2", extra=("--tasks-per-node", "2")
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert eval_rows(two, 0).equals(eval_rows(ref, 0))
    shards = sorted((two / "stages" / "step=0" / "eval").glob("part-r*.parquet"))
    assert [set(pq.read_table(p).column("rank").to_pylist()) for p in shards] == [{0}, {1}]
