"""The GSM8K example end to end: verl's Parquet layout in, a verl compute_score scoring it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, submit, trajectories

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "gsm8k_verl"
TESTS = Path(__file__).resolve().parent


@pytest.mark.tier1
def test_example_data_is_what_its_script_writes(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        from make_data import rows
    finally:
        sys.path.remove(str(EXAMPLE))
    committed = pq.read_table(EXAMPLE / "gsm8k_mini.parquet").to_pylist()
    assert committed == rows() and len(committed) == 30
    for r in committed:
        assert r["extra_info"]["answer"].endswith("#### " + r["reward_model"]["ground_truth"])


def test_gsm8k_example_runs_two_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    gsm8k = "{path: examples.gsm8k_verl.gsm8k_reward:compute_score, signature: verl, name: gsm8k}"
    echo = "{path: reward_fns:verl_echo, signature: verl}"
    res = submit(
        run,
        "model.path=builtin:tiny",
        "total_steps=2",
        "data.max_prompt_tokens=400",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "train.micro_batch_size=8",
        "logging.progress=false",
        "launch.threads=1",
        f"reward.functions=[{gsm8k}, math_verify, {echo}]",
        "reward.weights=[1.0, 0.5, 0.0]",
        config=EXAMPLE / "config.yaml",
        env={"PYTHONPATH": f"{TESTS}:{ROOT}"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    t = trajectories(run).to_pylist()
    assert len(t) == 2 * 4 * 4
    source = pq.read_table(EXAMPLE / "gsm8k_mini.parquet").to_pylist()
    for row in t:
        want = source[row["prompt_id"]]
        assert row["reward_status"] == "ok" and row["reward_error"] is None
        # The verl function got the row's data_source, ground truth and extra_info.
        assert row["reward_verl_echo_data_source"] == "openai/gsm8k"
        assert row["reward_verl_echo_ground_truth"] == want["reward_model"]["ground_truth"]
        assert row["reward_verl_echo_extra_index"] == want["extra_info"]["index"]
        assert row["reward_verl_echo_extra_split"] == "train"
        assert row["answer"] == want["reward_model"]["ground_truth"]
        assert json.loads(row["metadata"])["extra_info"] == want["extra_info"]
        for col in ("reward_gsm8k", "reward_gsm8k_flexible", "reward_gsm8k_format"):
            assert row[col] in (0.0, 1.0)
        assert row["reward_math_verify"] in (0.0, 1.0)
        assert row["reward"] == row["reward_gsm8k"] + 0.5 * row["reward_math_verify"]
    # Eight distinct prompts over the two steps (one epoch has 30).
    assert len({r["prompt_id"] for r in t}) == 8


def test_two_datasets_routed_to_their_functions(tmp_path: Path) -> None:
    """GSM8K rows mixed 3:1 with a chat JSONL of another data source; each function scores
    its own source's rows and leaves the others' column null."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "\n".join(
            json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)})
            for i in range(5)
        )
    )
    datasets = f"[{{path: {EXAMPLE / 'gsm8k_mini.parquet'}, format: verl, weight: 3}}, " + (
        f"{{path: {chat}, data_source: say}}]"
    )
    gsm8k = (
        "{path: examples.gsm8k_verl.gsm8k_reward:compute_score, signature: verl, name: gsm8k, "
        "data_sources: [openai/gsm8k]}"
    )
    run = tmp_path / "run"
    res = submit(
        run,
        "model.path=builtin:tiny",
        "total_steps=2",
        "data.max_prompt_tokens=400",
        f"data.datasets={datasets}",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "train.micro_batch_size=8",
        "logging.progress=false",
        "launch.threads=1",
        f"reward.functions=[{gsm8k}, {{path: dense_even_tokens, data_sources: [say]}}]",
        "reward.weights=[1.0, 1.0]",
        config=EXAMPLE / "config.yaml",
        env={"PYTHONPATH": f"{TESTS}:{ROOT}"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    t = trajectories(run).to_pylist()
    say = [r for r in t if r["prompt_id"] >= 1_000_000_000]
    gsm = [r for r in t if r["prompt_id"] < 1_000_000_000]
    # 8 prompts in 3:1 turns: 6 GSM8K, 2 chat, n=4 samples each.
    assert (len(gsm), len(say)) == (6 * 4, 2 * 4)
    assert all(r["reward_gsm8k"] is None and r["reward_dense_even_tokens"] is not None for r in say)
    assert all(r["reward_dense_even_tokens"] is None and r["reward_gsm8k"] is not None for r in gsm)
    assert all(r["reward_status"] == "ok" for r in t)
    assert {json.loads(r["metadata"])["data_source"] for r in say} == {"say"}
    assert all(r["prompt"].startswith("Say ") for r in say)
