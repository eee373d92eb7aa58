"""tools.studies.simulate_staleness: its schedules against their closed forms, the GPU
cost model's limits, and the CPU check's reading of a bench record."""

from __future__ import annotations

import pytest

from tools.studies.simulate_staleness import GpuModel, StepCost, cpu_check, steady_step

COST = StepCost(generation=4.0, advantage=1.0, train=3.0, sync=0.5)


def test_sequential_adds_every_stage_and_the_recomputation_from_k1() -> None:
    assert steady_step("sequential", 0, COST) == pytest.approx(4 + 1 + 3 + 0.5)
    assert steady_step("sequential", 1, COST) == pytest.approx(4 + 1 + 3 + 1 + 0.5)


def test_overlap_waits_for_the_longer_thread_then_syncs() -> None:
    assert steady_step("overlap", 1, COST) == pytest.approx(max(4, 1 + 3 + 1) + 0.5)
    with pytest.raises(ValueError, match="k >= 1"):
        steady_step("overlap", 0, COST)


@pytest.mark.parametrize(
    ("k", "handoff", "expected"),
    [
        # k = 0: each step's generation waits for the step before's weights (and no
        # proximal recomputation: 4.5 s of training and sync).
        (0, 0.5, 4 + 4.5 + 0.5),
        # k = 1, two resources one step apart: the slower one, or half the cycle.
        (1, 0.5, max(4, 5.5, (4 + 5.5 + 0.5) / 2)),
        (1, 4.0, max(4, 5.5, (4 + 5.5 + 4.0) / 2)),
        # Enough slack: the slower resource alone.
        (4, 4.0, 5.5),
    ],
)
def test_the_free_pipeline_of_separate_rollout_ranks(
    k: int, handoff: float, expected: float
) -> None:
    assert steady_step("disaggregated", k, COST, handoff_s=handoff) == pytest.approx(expected)


def test_generation_is_bounded_below_by_the_longest_response() -> None:
    """More rollout GPUs shorten generation, but never below one engine decoding the
    longest response alone; training scales with its GPUs."""
    m = GpuModel()
    floor = m.max_response * 2 * m.params / m.hbm_bytes_s
    times = [m.generation_s(g) for g in (8, 16, 64, 2048)]
    assert times == sorted(times, reverse=True)
    assert times[-1] >= floor and times[-1] < 1.5 * floor
    assert m.train_s(16) == pytest.approx(2 * m.train_s(32))
    assert max(m.lengths()) == m.max_response and min(m.lengths()) >= 1


def test_cpu_check_reads_the_synchronous_runs_only() -> None:
    stage_s = {"rollout": 3.0, "score": 1.0, "advantage": 1.0, "train": 3.0, "sync": 0.5}
    one_core = {k: 2 * v for k, v in stage_s.items()}
    record = {
        "results": {
            "k0": {"stage_s": stage_s, "steady_step_s": 8.5},
            "k0-t1": {"stage_s": one_core, "steady_step_s": 17.0},
            "k1-overlap": {"stage_s": {}, "steady_step_s": 11.0},
        }
    }
    (row,) = cpu_check(record, handoff_s=0.0)
    # One core each: max(generation 8, advantage 2 + train 6 + recompute 2) + sync 1.
    assert row["variant"] == "k1-overlap" and row["predicted_step_s"] == 11.0
    assert row["error"] == 0.0
