"""The sampler: exactly-once per epoch, world-size independent, resumable from one integer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rftpipe.config.schema import DataConfig, FileDataConfig
from rftpipe.data import SamplerState, global_window, load_prompts, rank_slice
from rftpipe.errors import UserError
from rftpipe.models import build_tiny_tokenizer


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
