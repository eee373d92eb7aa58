"""The sampler: exactly-once per epoch, world-size independent, resumable from one integer."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rftpipe.config.schema import DataConfig, DatasetSourceConfig, FileDataConfig
from rftpipe.data.prompts import load_prompts
from rftpipe.data.sampler import (
    SamplerState,
    global_window,
    mixed_window,
    rank_slice,
    schedule,
    source_counts,
)
from rftpipe.data.sources import ID_STRIDE, load_source_rows
from rftpipe.engines.models import build_tiny_tokenizer
from rftpipe.errors import UserError


@pytest.mark.parametrize("n,per_step", [(20, 4), (10, 3), (7, 7), (5, 8)])
def test_every_prompt_once_per_epoch_across_boundaries(n: int, per_step: int) -> None:
    taken: list[int] = []
    state = SamplerState()
    for _ in range(12):
        w = global_window(n, seed=3, shuffle=True, state=state, count=per_step)
        taken += w
        state = SamplerState(consumed=state.consumed + len(w))
    for e in range(len(taken) // n):
        assert sorted(taken[e * n : (e + 1) * n]) == list(range(n))
    assert taken[:n] != list(range(n))  # really shuffled


def test_resume_from_state_equals_uninterrupted() -> None:
    full = global_window(13, 1, True, SamplerState(), 40)
    part = global_window(13, 1, True, SamplerState(), 17) + global_window(
        13, 1, True, SamplerState(consumed=17), 23
    )
    assert full == part


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_partition_the_window(world: int) -> None:
    window = list(range(10))
    parts = [rank_slice(window, r, world) for r in range(world)]
    assert sum(parts, []) == window


@pytest.mark.parametrize(("world", "unit"), [(1, 2), (2, 2), (3, 2), (2, 3), (4, 4)])
def test_rank_slices_keep_whole_units(world: int, unit: int) -> None:
    window = list(range(11))
    parts = [rank_slice(window, r, world, unit) for r in range(world)]
    assert sum(parts, []) == window
    units = {tuple(window[i : i + unit]) for i in range(0, len(window), unit)}
    for part in parts:  # each share is a run of whole units of the global order
        cut = [tuple(part[i : i + unit]) for i in range(0, len(part), unit)]
        assert set(cut) <= units


def test_file_source_with_column_mapping_and_truncation(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"q": "short", "a": "1", "id": 7}, {"q": "x" * 200, "a": "2", "id": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tok = build_tiny_tokenizer()
    base = dict(
        source="file",
        file=FileDataConfig(path=str(path), prompt_column="q", answer_column="a", id_column="id"),
        max_prompt_tokens=64,
    )
    with pytest.raises(UserError, match="row 1"):
        load_prompts(DataConfig(**base, overlong="error"), tok)
    kept = load_prompts(DataConfig(**base, overlong="filter"), tok)
    assert [p.prompt_id for p in kept.prompts] == [7]
    cut = load_prompts(DataConfig(**base, overlong="truncate"), tok)
    assert [p.prompt_id for p in cut.prompts] == [7, 9] and len(cut.prompts[1].token_ids) == 64


# ------------------------------------------------------------------ datasets and mixing


def verl_rows(n: int, source: str = "openai/gsm8k") -> list[dict]:
    """Rows in verl's GSM8K Parquet layout."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}"},
        }
        for i in range(n)
    ]


def chat_ids(tok: object, conv: list[dict]) -> list[int]:
    out = tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def datasets_cfg(*sources: DatasetSourceConfig, **kw: object) -> DataConfig:
    return DataConfig(source="datasets", datasets=sources, max_prompt_tokens=256, **kw)


def test_verl_parquet_as_is(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(3)), path)
    tok = build_tiny_tokenizer()
    ps = load_prompts(datasets_cfg(DatasetSourceConfig(path=str(path), format="verl")), tok)
    p = ps.prompts[2]
    assert (p.prompt_id, p.text, p.answer, p.data_source) == (
        2,
        "What is 2 + 2?",
        "4",
        "openai/gsm8k",
    )
    assert p.metadata["extra_info"] == {"split": "train", "index": 2, "answer": "#### 4"}
    assert p.metadata["data_source"] == "openai/gsm8k" and p.metadata["ability"] == "math"
    assert list(p.token_ids) == chat_ids(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    # The rows alone, for callers that template themselves (held-out evaluation).
    rows = load_source_rows(DatasetSourceConfig(path=str(path), format="verl"), 1)
    assert rows[0].prompt_id == ID_STRIDE and rows[0].messages == (
        {"role": "user", "content": "What is 0 + 0?"},
    )


def test_chat_prompts_keep_their_own_system_message(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    convs = [
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1?"}],
        [{"role": "user", "content": "2+2?"}],
    ]
    path.write_text("\n".join(json.dumps({"prompt": c, "answer": "x"}) for c in convs))
    tok = build_tiny_tokenizer()
    src = DatasetSourceConfig(path=str(path), data_source="toy")
    ps = load_prompts(datasets_cfg(src, system_prompt="Think."), tok)
    system = {"role": "system", "content": "Think."}
    for p, conv in zip(ps.prompts, [convs[0], [system, *convs[1]]], strict=True):
        assert list(p.token_ids) == chat_ids(tok, conv)
    assert ps.data_sources() == {"toy"}


def test_saved_hf_datasets(tmp_path: Path) -> None:
    import datasets

    rows = verl_rows(4)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(tmp_path / "dict"))
    tok = build_tiny_tokenizer()
    one = load_prompts(
        datasets_cfg(DatasetSourceConfig(path=str(tmp_path / "one"), format="verl")), tok
    )
    assert [p.answer for p in one.prompts] == ["0", "2", "4", "6"]
    split = DatasetSourceConfig(path=str(tmp_path / "dict"), format="verl", split="test")
    assert len(load_prompts(datasets_cfg(split), tok)) == 4
    with pytest.raises(UserError, match=r"data.datasets\[0\].split.*has no split 'dev'"):
        load_prompts(
            datasets_cfg(DatasetSourceConfig(path=str(tmp_path / "dict"), split="dev")), tok
        )


def test_schedule_period_follows_the_weights() -> None:
    assert schedule([1.0]) == [0]
    assert schedule([2, 1]) == [0, 1, 0]
    period = schedule([0.7, 0.3])
    assert len(period) == 10 and period.count(0) == 7
    # Smooth: the minority source is never two positions apart from its share.
    assert max(len(run) for run in "".join(map(str, period)).split("1")) <= 3


@pytest.mark.parametrize("weights", [(2.0, 1.0), (1.0, 1.0, 3.0), (0.25, 0.75)])
def test_mix_uses_each_prompt_once_per_epoch_of_its_dataset(weights: tuple[float, ...]) -> None:
    sizes = [5, 3, 7][: len(weights)]
    period = schedule(weights)
    state, taken = SamplerState(), []
    for _ in range(40):
        w = mixed_window(sizes, period, 3, True, state, 4)
        taken += w
        state = SamplerState(consumed=state.consumed + len(w))
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    for k, n in enumerate(sizes):
        mine = [i - offsets[k] for i in taken if offsets[k] <= i < offsets[k] + n]
        assert len(mine) == source_counts(period, k, len(taken))
        for e in range(len(mine) // n):
            assert sorted(mine[e * n : (e + 1) * n]) == list(range(n))
        # Its share of the stream is its weight's (to within one period).
        share = weights[k] / sum(weights)
        assert abs(len(mine) - share * len(taken)) <= len(period)
    # Resumed from the one integer: the same stream.
    again = mixed_window(sizes, period, 3, True, SamplerState(), 57) + mixed_window(
        sizes, period, 3, True, SamplerState(consumed=57), len(taken) - 57
    )
    assert again == taken


def test_mixed_prompt_set_ids_and_windows(tmp_path: Path) -> None:
    a, b = tmp_path / "a.parquet", tmp_path / "b.jsonl"
    pq.write_table(pa.Table.from_pylist(verl_rows(4, "gsm8k")), a)
    b.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(3)))
    cfg = datasets_cfg(
        DatasetSourceConfig(path=str(a), format="verl", weight=1.0),
        DatasetSourceConfig(path=str(b), weight=2.0),
    )
    ps = load_prompts(cfg, build_tiny_tokenizer())
    assert ps.sizes == [4, 3]
    assert [p.prompt_id for p in ps.prompts] == [
        0,
        1,
        2,
        3,
        ID_STRIDE,
        ID_STRIDE + 1,
        ID_STRIDE + 2,
    ]
    assert ps.data_sources() == {"gsm8k", "b"}
    w = ps.window(0, True, SamplerState(), 6)
    assert sum(i >= 4 for i in w) == 4  # weight 2 of 3
    single = load_prompts(datasets_cfg(DatasetSourceConfig(path=str(b))), build_tiny_tokenizer())
    assert single.window(5, True, SamplerState(consumed=2), 5) == global_window(
        3, 5, True, SamplerState(consumed=2), 5
    )
    assert single.fingerprint() != ps.fingerprint()


def test_default_data_unchanged() -> None:
    """The shipped tiny config's prompts, ids and answers hash as before datasets existed."""
    from rftpipe.config.loader import load_config
    from rftpipe.config.schema import RunConfig

    cfg = load_config(RunConfig, Path(__file__).parent.parent / "configs" / "tiny_dense.yaml")
    fp = load_prompts(cfg.data, build_tiny_tokenizer()).fingerprint()
    assert fp == "dd08f7aba2485f0b30fc4d07c36d392b5f6dedb524f61231dbdf4f7740a0e0c2"


@pytest.mark.parametrize(
    ("rows", "kw", "needle"),
    [
        ([{"prompt": "q", "answer": "1"}], {"format": "verl"}, "answer_column: column 'reward_model.ground_truth'"),
        ([{"prompt": "q", "reward_model": {"ground_truth": "1"}}], {"format": "verl"}, "data_source_column: column 'data_source'"),
        ([{"prompt": "q"}], {}, "answer_column: column 'answer'"),
        ([{"prompt": [{"role": "user", "content": "q"}], "answer": "1"}, {"prompt": [{"role": "usr", "content": "q"}], "answer": "1"}], {}, "row 1 of"),
        ([{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}], {}, "no user message"),
        ([{"prompt": 3, "answer": "1"}], {}, "neither a string nor chat messages"),
    ],
)  # fmt: skip
def test_bad_dataset_rows_refused(tmp_path: Path, rows: list, kw: dict, needle: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(UserError, match=re.escape(needle)):
        load_source_rows(DatasetSourceConfig(path=str(path), **kw))


def test_dataset_fingerprint_covers_what_rewards_see(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    path = tmp_path / "d.parquet"
    rows = verl_rows(3)
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = datasets_cfg(DatasetSourceConfig(path=str(path), format="verl"))
    before = load_prompts(cfg, tok).fingerprint()
    rows[1]["extra_info"]["split"] = "test"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_prompts(cfg, tok).fingerprint() != before


def test_datasets_config_checks() -> None:
    from rftpipe.config.loader import ConfigError, load_config
    from rftpipe.config.schema import RunConfig

    one = "data.datasets=[{path: x.parquet, format: verl}]"
    cfg = load_config(RunConfig, None, ["data.source=datasets", one])
    src = cfg.data.datasets[0]
    assert (src.prompt_col, src.answer_col, src.data_source_col) == (
        "prompt",
        "reward_model.ground_truth",
        "data_source",
    )
    plain = DatasetSourceConfig(path="x.jsonl", answer_column="")
    assert (plain.answer_col, plain.data_source_col) == (None, None)
    for overrides, needle in [
        (["data.source=datasets"], "source is 'datasets' but datasets is empty"),
        ([one], "datasets is set but source is 'reasoning_gym'"),
        (["data.source=datasets", "data.datasets=[{path: x, weight: 0}]"], "weight must be"),
        (["data.source=datasets", "data.datasets=[{path: x, format: hf}]"], "format"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(RunConfig, None, overrides)


# A reasoning-gym task as the tiny config has it; the cache is this test's own.
RG_SCRIPT = """
import json, sys
from rftpipe.config.schema import DataConfig, ReasoningGymConfig
from rftpipe.data.sources import reasoning_gym_rows

cfg = DataConfig(reasoning_gym=ReasoningGymConfig(
    name="basic_arithmetic", size=6, seed=5, kwargs={"min_terms": 2, "max_terms": 2}))
rows, ds = reasoning_gym_rows(cfg, 6, 5)
imported = "reasoning_gym" in sys.modules
score = ds.score_answer(rows[0].answer, {"answer": rows[0].answer, "metadata": rows[0].metadata})
print(json.dumps({"imported": imported, "score": score, "rows": repr(rows)}))
"""


def test_generated_task_rows_are_cached_exactly_and_the_generator_built_only_to_score(
    tmp_path: Path,
) -> None:
    """The first process generates the rows and keeps them in the machine's cache; the next
    reads the same rows (tuples in their metadata included) without importing
    reasoning-gym, which it imports to score; a corrupt cache file is generated anew."""
    import subprocess
    import sys

    env = {**os.environ, "RFTPIPE_CACHE": str(tmp_path)}

    def run() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", RG_SCRIPT], capture_output=True, text=True, env=env, check=True
        )
        return json.loads(out.stdout)

    first = run()
    (cached,) = (tmp_path / "data" / "reasoning_gym").iterdir()
    second = run()
    assert first["imported"] and not second["imported"]
    assert second["rows"] == first["rows"] and "(2, 2)" in first["rows"]
    assert first["score"] == second["score"] == 1.0
    cached.write_text('{"settings": ')
    third = run()
    assert third["imported"] and third["rows"] == first["rows"]
    assert json.loads(cached.read_text())["settings"]["seed"] == 5


@pytest.mark.parametrize(
    "value",
    [{1: "an int key"}, float("nan"), {"$tuple": [1]}, b"bytes"],
    ids=["int-key", "nan", "tuple-tag", "bytes"],
)
def test_values_json_would_change_are_not_cached(value: object) -> None:
    from rftpipe.data.sources import _from_json, _json_exactly

    assert _json_exactly({"metadata": value}) is None
    kept = {"m": [(1, (2, "x")), {"a": [1.5, None, True]}]}
    text = _json_exactly(kept)
    assert text is not None and repr(_from_json(text)) == repr(kept)


def _labelled(path: Path, labels: list[str]) -> DatasetSourceConfig:
    """A JSON-lines dataset whose rows carry `label` (and a distinct answer each)."""
    rows = [{"prompt": f"q{i}", "answer": str(i), "label": lab} for i, lab in enumerate(labels)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return DatasetSourceConfig(path=str(path))


def test_balance_by_gives_every_step_as_many_prompts_of_each_value(tmp_path: Path) -> None:
    """`data.balance_by`: a single file of 3 labels in a lopsided, clustered order; every
    window of 3 x k prompts holds k of each label, each label's prompts once per epoch of
    its own, and the windows depend on `consumed` alone (a resume draws the same)."""
    import random

    labels = ["a"] * 9 + ["b"] * 4 + ["c"] * 2
    random.Random(0).shuffle(labels)
    source = _labelled(tmp_path / "d.jsonl", labels)
    tok = build_tiny_tokenizer()
    ps = load_prompts(datasets_cfg(source, balance_by="label"), tok)
    assert sorted(ps.sizes) == [2, 4, 9] and len(ps) == len(labels)
    label = [p.metadata["label"] for p in ps.prompts]
    taken: list[int] = []
    state = SamplerState()
    for _ in range(12):
        w = ps.window(7, True, state, 6)
        assert sorted(label[i] for i in w) == ["a", "a", "b", "b", "c", "c"]
        taken += w
        state = SamplerState(consumed=state.consumed + len(w))
    for value, size in (("a", 9), ("b", 4), ("c", 2)):
        mine = [i for i in taken if label[i] == value]
        for e in range(len(mine) // size):
            assert len(set(mine[e * size : (e + 1) * size])) == size, value
    assert ps.window(7, True, SamplerState(consumed=30), 12) == taken[30:42]
    # Unbalanced, the same stream is not: some window of 6 is lopsided.
    plain = load_prompts(datasets_cfg(source), tok)
    windows = [plain.window(7, True, SamplerState(consumed=6 * s), 6) for s in range(12)]
    plain_label = [p.metadata["label"] for p in plain.prompts]
    assert any(len({plain_label[i] for i in w}) < 3 for w in windows)
    assert plain.fingerprint() != ps.fingerprint()


def test_balance_by_answer_and_a_struct_field_within_each_dataset(tmp_path: Path) -> None:
    """`answer` names each dataset's answer column, `a.b` a struct field; two datasets of
    weights 1 and 2 keep their shares, each split equally among its values."""
    a = tmp_path / "a.parquet"
    rows = verl_rows(6)
    for i, r in enumerate(rows):
        r["reward_model"]["ground_truth"] = "yes" if i % 3 else "no"
    pq.write_table(pa.Table.from_pylist(rows), a)
    b = _labelled(tmp_path / "b.jsonl", ["x", "y"] * 3).path
    cfg = datasets_cfg(
        DatasetSourceConfig(path=str(a), format="verl", weight=1.0),
        DatasetSourceConfig(path=b, weight=2.0, answer_column="label"),
        balance_by="answer",
    )
    ps = load_prompts(cfg, build_tiny_tokenizer())
    assert ps.sizes == [2, 4, 3, 3] and ps.weights == (0.5, 0.5, 1.0, 1.0)
    w = ps.window(0, True, SamplerState(), 6)
    answers = sorted(ps.prompts[i].answer for i in w)
    assert answers == ["no", "x", "x", "y", "y", "yes"]
    by_field = load_prompts(
        datasets_cfg(
            DatasetSourceConfig(path=str(a), format="verl"), balance_by="reward_model.ground_truth"
        ),
        build_tiny_tokenizer(),
    )
    assert by_field.sizes == [2, 4]


def test_balance_by_refuses_an_id_a_missing_value_and_other_sources(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    many = _labelled(tmp_path / "many.jsonl", [f"l{i}" for i in range(70)])
    with pytest.raises(
        UserError, match=r"data.datasets\[0\] has 70 distinct values of 'label' > 64"
    ):
        load_prompts(datasets_cfg(many, balance_by="label"), tok)
    with pytest.raises(
        UserError,
        match=r"data.balance_by: data.datasets\[0\]: row 0 of '.*many.jsonl' has no value of 'colour'",
    ):
        load_prompts(datasets_cfg(many, balance_by="colour"), tok)
    with pytest.raises(ValueError, match="balance_by needs source 'datasets', not 'reasoning_gym'"):
        DataConfig(balance_by="answer")


def test_a_holdout_that_takes_a_whole_value_is_refused(tmp_path: Path) -> None:
    """A value whose every prompt is held out would leave its part of the stream empty."""
    from rftpipe.config.schema import EvalConfig
    from rftpipe.data.prompts import _held_out, content_key, split_held_out

    cfg = datasets_cfg(_labelled(tmp_path / "d.jsonl", ["a"] * 8 + ["b"]), balance_by="label")
    tok = build_tiny_tokenizer()
    train = load_prompts(cfg, tok)
    b = next(p for p in train.prompts if p.metadata["label"] == "b")
    seed = next(s for s in range(100) if _held_out(content_key(b), s, 0.5))
    with pytest.raises(
        UserError, match=r'holds out every prompt of data.datasets\[0\] rows whose label is "b"'
    ):
        split_held_out(cfg, EvalConfig(size=4, holdout_fraction=0.5, seed=seed), train, tok)
