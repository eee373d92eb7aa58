"""tools.studies.learning_staleness: the overrides each run gets (the recipe alike for
every k) and the summary's means and differences from k = 0."""

from __future__ import annotations

import pytest

from tools.studies.learning_staleness import run_overrides, summarize


def test_the_recipe_goes_to_every_k_and_overlap_only_from_k1() -> None:
    recipe = ["train.lr_schedule=linear"]
    assert run_overrides(0, 3, recipe) == ["seed=3", "rollout.staleness=0", *recipe]
    assert run_overrides(2, 1, recipe) == [
        "seed=1",
        "rollout.staleness=2",
        *recipe,
        "rollout.overlap=true",
        "launch.threads=1",
    ]
    assert run_overrides(1, 0) == [
        "seed=0",
        "rollout.staleness=1",
        "rollout.overlap=true",
        "launch.threads=1",
    ]


def _run(*held: float) -> dict:
    return {"held_out_greedy": {str(10 * i): v for i, v in enumerate(held)}}


def test_summary_means_over_seeds_and_differences_from_k0() -> None:
    runs = {
        "0": {"0": _run(0.1, 0.9, 0.8), "1": _run(0.1, 0.7, 1.0)},
        "1": {"0": _run(0.1, 0.5, 0.9), "1": _run(0.1, 0.6, 0.8)},
    }
    out = summarize(runs)
    assert out["0"]["mean_held_out_greedy"] == {"0": 0.1, "10": 0.8, "20": 0.9}
    assert out["1"]["mean_held_out_greedy"] == {"0": 0.1, "10": 0.55, "20": 0.85}
    assert out["1"]["minus_k0"] == pytest.approx({"0": 0.0, "10": -0.25, "20": -0.05})
    assert out["1"]["seeds"] == ["0", "1"]
