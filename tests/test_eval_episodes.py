"""Held-out evaluation of multi-turn episodes (`rollout.env` with `eval.size > 0`, issue 24):
greedy and sampled episodes of the held-out problems on the tiny model through the real HF
engine, chat template and environment, scored as training scores them; the metric name
checked at load; and, through the real entry point, a kill during the evaluation and two
ranks giving the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ROOT, TESTS_ON_PATH, episode_prompts, eval_rows, events, stage_history, submit

from rftpipe.config.loader import ConfigError, load_config
from rftpipe.config.schema import (
    EnvConfig,
    EvalConfig,
    RewardConfig,
    RewardFunctionConfig,
    RolloutConfig,
    RunConfig,
)
from rftpipe.data.sampler import rank_slice
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny
from rftpipe.engines.rollout.hf import HFGenerateEngine
from rftpipe.inspect.summary import summarize as inspect_summary
from rftpipe.inspect.verify import verify_run
from rftpipe.rewards import resolve_all
from rftpipe.run.metrics import summarize
from rftpipe.stages import evaluation

ENV = EnvConfig(path="envs_toy:EvenChars", max_turns=2, max_total_tokens=96, workers=0)
ROLLOUT = RolloutConfig(n=2, max_new_tokens=6, env=ENV)
REWARD = RewardConfig(functions=(RewardFunctionConfig(path="dense_even_tokens"),))
EVAL = EvalConfig(size=4, samples=2, k=(1, 2), problems_per_call=2, metric="env", threshold=0.9)


@pytest.fixture(scope="module")
def tiny():
    path = prepare_tiny()
    torch.manual_seed(0)
    model, tok = load_causal_lm(path, "float32"), load_tokenizer(path)
    engine = HFGenerateEngine(model, ROLLOUT, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    return engine, tok


def _evaluate(tiny, prompts, rank: int = 0) -> pa.Table:
    engine, tok = tiny
    inp = evaluation.EvalInputs(
        step=3, rank=rank, run_seed=0, prompts=prompts, eval=EVAL, rollout=ROLLOUT, reward=REWARD
    )
    return evaluation.run(engine, tok, resolve_all(REWARD, None, ROLLOUT.max_new_tokens), inp)


def test_held_out_episodes_are_greedy_and_sampled_and_scored_like_training(
    tiny, monkeypatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # in-process: envs_toy imports here
    engine, tok = tiny
    prompts = episode_prompts(tok, 3)
    table = _evaluate(tiny, prompts)
    rows = table.to_pylist()
    assert [(r["prompt_id"], r["sample_idx"], r["mode"]) for r in rows] == [
        (p.prompt_id, k, "greedy" if k < 0 else "sampled") for p in prompts for k in (-1, 0, 1)
    ]
    for r in rows:
        # EvenChars answers every turn: each episode runs both turns.
        assert r["num_turns"] == 2 and r["episode_status"] == "max_turns"
        assert len(r["turn_rewards"]) == 2 and len(r["loss_mask"]) == r["response_length"]
        messages = json.loads(r["messages"])
        assert [m["role"] for m in messages[-3:]] == ["assistant", "user", "assistant"]
        assert r["response"] == messages[-1]["content"]  # the last action, as training rows
        # The return: the environment's rewards plus the reward functions', as in training.
        assert r["reward_env"] == pytest.approx(sum(r["turn_rewards"]))
        assert r["reward"] == pytest.approx(r["reward_env"] + r["reward_dense_even_tokens"])
        assert r["correct"] == (r["reward_env"] >= EVAL.threshold)  # eval.metric: env
    # A greedy episode's first turn is the greedy continuation that `generate` gives (which
    # drops the EOS), and it is the same however often it is run; the samples differ.
    first = [r for r in rows if r["mode"] == "greedy"]
    ref = engine.greedy([list(p.token_ids) for p in prompts[:2]], ROLLOUT.max_new_tokens)
    eos = {tok.eos_token_id}
    for r, want in zip(first, ref, strict=False):
        turn0 = r["response_token_ids"][: r["loss_mask"].index(0)]
        assert [t for t in turn0 if t not in eos] == want
    assert _evaluate(tiny, prompts).equals(table)
    sampled = [r["response_token_ids"] for r in rows if r["mode"] == "sampled"]
    assert sampled[0] != sampled[1]
    # Metrics: greedy accuracy and pass@k as for single-turn rows, and turns per episode.
    m = summarize(pa.Table.from_pylist(rows), [1, 2])
    assert m["eval/problems"] == 3 and m["eval/greedy_turns_mean"] == 2.0
    assert m["eval/greedy_first_turn_accuracy"] == 0.0  # no episode ends after one turn
    assert m["eval/greedy_accuracy"] == sum(r["correct"] for r in first) / 3

    # Two ranks' shares (whole calls of eval.problems_per_call) give the same rows.
    ids = list(range(len(prompts)))
    shares = [
        _evaluate(tiny, [prompts[i] for i in rank_slice(ids, rank, 2, 2)], rank) for rank in (0, 1)
    ]
    assert pa.concat_tables(shares).drop_columns(["rank"]).equals(table.drop_columns(["rank"]))


def test_eval_metric_is_checked_at_load() -> None:
    env = ["rollout.env.path=envs_toy:EvenChars", "eval.size=4"]
    cfg = load_config(RunConfig, None, [*env, "eval.metric=env", "reward.functions=[]"])
    assert cfg.eval.metric == "env" and cfg.rollout.env is not None
    bad = {
        # No environment: no environment return to evaluate.
        ("eval.size=4", "eval.metric=env"): "'env'",
        (*env, "eval.metric=acuracy"): "'acuracy'",
    }
    for overrides, fragment in bad.items():
        with pytest.raises(ConfigError, match="eval.metric") as err:
            load_config(RunConfig, None, list(overrides))
        assert "\n" not in str(err.value) and fragment in str(err.value)


# ---------------------------------------------------------------------------------------------
# Through the real entry point
# ---------------------------------------------------------------------------------------------

RUN = (
    "rollout.env.path=envs_toy:EvenChars",
    "rollout.env.max_turns=2",
    "rollout.env.max_total_tokens=96",
    "reward.functions=[]",
    "eval.size=6",
    "eval.holdout_fraction=0.3",
    "eval.samples=2",
    "eval.k=[1,2]",
    "eval.problems_per_call=2",
    "eval.metric=env",
    "eval.threshold=0.9",
    "total_steps=1",
)
ENV_PATH = TESTS_ON_PATH


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_evaluation_reruns_to_the_rows_of_two_ranks(tmp_path: Path) -> None:
    """One rank killed in the middle of the initial evaluation's first turn, then resumed;
    two ranks (FSDP2) uninterrupted: the same step-0 evaluation rows, bitwise."""
    run = tmp_path / "killed"
    env = {**ENV_PATH, "RFTPIPE_FAULT": "episode_mid_turn", "RFTPIPE_FAULT_SKIP": "0"}
    assert submit(run, *RUN, env=env).returncode != 0
    # Killed in the evaluation of the initial weights: before step 1 began.
    assert not (run / "stages" / "step=0" / "eval" / "MANIFEST.json").exists()
    assert not (run / "stages" / "step=1").exists()
    out = submit(run, *RUN, env=ENV_PATH)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["point"] for e in events(run) if e["event"] == "fault"] == ["episode_mid_turn"]
    assert stage_history(run)[(0, "eval")].count("commit") == 1
    rows = eval_rows(run, 0)
    assert set(rows.column("mode").to_pylist()) == {"greedy", "sampled"}
    assert max(rows.column("num_turns").to_pylist()) == 2
    summary = json.loads((run / "eval.json").read_text())
    assert sorted(summary["steps"], key=int) == ["0", "1"]
    assert summary["before"]["eval/greedy_turns_mean"] == 2.0
    assert rows.num_rows == summary["before"]["eval/problems"] * 3
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval/pass@2" in metrics[0] and metrics[1]["episode/turns_mean"] > 1
    # The run-directory tools read a run with episode evaluation rows.
    audit = verify_run(run)
    # Two evaluations, step 1's five stages and its newest turn (`rollout.t2`).
    assert not audit.corrupt and audit.stages == 2 + 5 + 1
    assert [r["step"] for r in inspect_summary(run)] == [1]

    two = tmp_path / "two"
    out = submit(two, *RUN, "train.backend=fsdp2", env=ENV_PATH, extra=("--tasks-per-node", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert eval_rows(two, 0).equals(rows)
    shards = sorted((two / "stages" / "step=0" / "eval").glob("part-r*.parquet"))
    assert [set(pq.read_table(p).column("rank").to_pylist()) for p in shards] == [{0}, {1}]
