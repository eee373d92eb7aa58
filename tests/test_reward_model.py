"""The `reward_model` component: scores equal a direct forward of the same texts, whatever
the batching, truncation and normalisation; bad paths are refused at resolve time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reward_fns import rollouts
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rftpipe.config.loader import ConfigError, from_dict
from rftpipe.config.schema import RewardConfig
from rftpipe.engines.models import prepare_tiny, prepare_tiny_reward_model
from rftpipe.errors import UserError
from rftpipe.rewards import resolve_all
from rftpipe.stages import score


def _config(**model: object) -> RewardConfig:
    entry = {
        "path": "reward_model",
        "name": "rm",
        "model": {"path": "builtin:tiny-reward", **model},
    }
    return from_dict(RewardConfig, {"functions": ["dense_even_tokens", entry], "weights": [1, 2]})


def _texts_and_rows(n_prompts: int = 16, n: int = 4) -> tuple[list[str], object]:
    table = rollouts(prompts=n_prompts, n=n)
    rows = table.to_pylist()
    tok = AutoTokenizer.from_pretrained(prepare_tiny_reward_model())
    texts = [
        tok.apply_chat_template(
            [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ],
            tokenize=False,
        )
        for r in rows
    ]
    return texts, table


def _direct(texts: list[str], max_tokens: int | None = None) -> list[float]:
    """One unpadded forward per text through a plain `from_pretrained` (the last
    `max_tokens` tokens only, if given)."""
    path = prepare_tiny_reward_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, add_special_tokens=False, return_tensors="pt")["input_ids"]
            if max_tokens is not None:
                ids = ids[:, -max_tokens:]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.kernels
def test_scores_equal_direct_forward(batch_size: int) -> None:
    texts, table = _texts_and_rows()
    cfg = _config(batch_size=batch_size)
    t = score.run(cfg, resolve_all(cfg, None), table).to_pydict()
    want = _direct(texts)
    # Rows differ in length, so batches of 4 pad; padding must not move a score.
    assert len({len(x) for x in texts}) > 1
    assert t["reward_rm"] == pytest.approx(want, abs=1e-6, rel=0)
    # The scores are not all alike (a broken model scoring a constant would pass the above
    # only if the direct forward were broken the same way).
    assert max(want) - min(want) > 1e-3
    dense, rm = t["reward_dense_even_tokens"], t["reward_rm"]
    assert t["reward"] == pytest.approx([d + 2 * r for d, r in zip(dense, rm, strict=True)])


@pytest.mark.kernels
def test_left_truncation_scale_and_shift() -> None:
    texts, table = _texts_and_rows()
    cfg = _config(batch_size=4, max_length=12, scale=-3.0, shift=0.5)
    t = score.run(cfg, resolve_all(cfg, None), table).to_pydict()
    want = [-3.0 * x + 0.5 for x in _direct(texts, max_tokens=12)]
    assert t["reward_rm"] == pytest.approx(want, abs=1e-5, rel=0)
    # Cutting the texts did change the scores (so the check above tests truncation).
    assert t["reward_rm"] != pytest.approx([-3.0 * x + 0.5 for x in _direct(texts)], abs=1e-4)


@pytest.mark.kernels
def test_bfloat16_scores_close_to_float32() -> None:
    """The GPU option, run on the CPU: bf16 weights and compute, scores within bf16's
    rounding of the fp32 ones (and not equal to them, so the dtype was applied)."""
    _, table = _texts_and_rows(4, 2)
    got = {}
    for dtype in ("float32", "bfloat16"):
        cfg = _config(batch_size=4, dtype=dtype)
        got[dtype] = score.run(cfg, resolve_all(cfg, None), table).column("reward_rm").to_pylist()
    assert got["bfloat16"] == pytest.approx(got["float32"], abs=0.05, rel=0)
    assert got["bfloat16"] != got["float32"]


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/nonexistent/rm", "no config.json"),
        ("causal", "not a sequence-classification model"),
    ],
)
def test_bad_reward_model_path(path: str, needle: str, tmp_path: Path) -> None:
    spec = str(prepare_tiny()) if path == "causal" else path
    cfg = _config(path=spec)
    with pytest.raises(UserError, match=needle) as err:
        resolve_all(cfg, None)
    assert "reward.functions" in str(err.value) and spec in str(err.value)


def test_model_field_only_with_reward_model() -> None:
    with pytest.raises(ConfigError, match="reward_model"):
        from_dict(RewardConfig, {"functions": [{"path": "reward_model"}]})
    with pytest.raises(ConfigError, match="not reward_model"):
        from_dict(
            RewardConfig,
            {"functions": [{"path": "dense_even_tokens", "model": {"path": "x"}}]},
        )
    with pytest.raises(ConfigError, match="no signature or timeout_s"):
        from_dict(
            RewardConfig,
            {"functions": [{"path": "reward_model", "timeout_s": 5, "model": {"path": "x"}}]},
        )


@pytest.mark.slow
def test_end_to_end_with_rule_reward(tmp_path: Path) -> None:
    """The tiny policy scored by `dense_even_tokens` and the tiny reward model: the model's
    column is committed, enters `reward` with its weight, and is the same in a second run."""
    from helpers import submit, trajectories

    overrides = (
        "total_steps=2",
        "reward.functions=[dense_even_tokens, "
        "{path: reward_model, name: rm, model: {path: 'builtin:tiny-reward', batch_size: 3}}]",
        "reward.weights=[1.0,0.5]",
    )
    tables = []
    for name in ("a", "b"):
        out = submit(tmp_path / name, *overrides)
        assert out.returncode == 0, out.stderr[-3000:]
        tables.append(trajectories(tmp_path / name))
    t = tables[0].to_pydict()
    assert len(t["reward_rm"]) == 2 * 4 * 4
    assert len(set(t["reward_rm"])) > 1
    want = [d + 0.5 * r for d, r in zip(t["reward_dense_even_tokens"], t["reward_rm"], strict=True)]
    assert t["reward"] == pytest.approx(want, abs=1e-12)
    assert tables[0].equals(tables[1])
    # The committed scores are the model's on the committed texts.
    rows = tables[0].slice(0, 5)
    cfg = _config(batch_size=2)
    rescored = score.run(cfg, resolve_all(cfg, None), rows.select(_ROLLOUT_COLUMNS))
    assert rescored.column("reward_rm").to_pylist() == pytest.approx(
        rows.column("reward_rm").to_pylist(), abs=1e-6, rel=0
    )


@pytest.mark.slow
def test_each_rank_scores_its_own_rows(tmp_path: Path) -> None:
    """Two ranks (fsdp2), each with its own copy of the reward model, score the rows that
    one rank scores alone (to float rounding: the rows share other batches)."""
    from helpers import submit, trajectories

    rm = "{path: reward_model, name: rm, model: {path: 'builtin:tiny-reward', batch_size: 4}}"
    overrides = ("total_steps=1", f"reward.functions=[{rm}]", "train.backend=fsdp2")
    tables = {}
    for tasks in ("1", "2"):
        out = submit(tmp_path / tasks, *overrides, extra=("--tasks-per-node", tasks))
        assert out.returncode == 0, out.stderr[-3000:]
        tables[tasks] = trajectories(tmp_path / tasks)
    assert set(tables["2"].column("rank").to_pylist()) == {0, 1}
    one, two = (tables[k].column("reward_rm").to_pylist() for k in ("1", "2"))
    assert len(one) == 16 and two == pytest.approx(one, abs=1e-6, rel=0)


_ROLLOUT_COLUMNS = [
    "step",
    "prompt_id",
    "sample_idx",
    "prompt",
    "response",
    "answer",
    "metadata",
    "response_token_ids",
    "finish_reason",
]
