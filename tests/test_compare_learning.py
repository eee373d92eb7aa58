"""tools.studies.compare_learning: two sides' curves from run directories' committed files."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tools.studies import compare_learning


def _run(root: Path, accuracy: dict[int, list[float]], held: dict[int, float]) -> Path:
    """A run directory with what the tool reads: hive-partitioned trajectories and
    metrics.jsonl with the held-out evaluations."""
    for step, acc in accuracy.items():
        part = root / "trajectories" / f"step={step}"
        part.mkdir(parents=True)
        pq.write_table(pa.table({"reward_accuracy": acc}), part / "part-0.parquet")
    lines = [json.dumps({"step": s, "eval/greedy_accuracy": v}) for s, v in held.items()]
    lines.insert(1, json.dumps({"step": 1, "train/kl": 0.0}))  # other metrics lines
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_means_per_side_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a0 = _run(tmp_path / "a0", {1: [0.0, 1.0], 2: [1.0, 1.0]}, {0: 0.25, 2: 0.5})
    a1 = _run(tmp_path / "a1", {1: [0.0, 0.0], 2: [1.0, 0.0]}, {0: 0.25, 2: 1.0})
    b0 = _run(tmp_path / "b0", {1: [1.0, 1.0], 2: [1.0, 1.0]}, {0: 0.25, 2: 0.75})
    out = tmp_path / "c.png"
    argv = ["--a", "A", str(a0), str(a1), "--b", "B", str(b0), "--out", str(out)]
    assert compare_learning.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["A"]["mean"] == {"0": 0.25, "2": 0.75}
    assert report["B"]["mean"] == {"0": 0.25, "2": 0.75}
    assert report["A"]["runs"][str(a1)] == {"0": 0.25, "2": 1.0}
    assert compare_learning._train_accuracy(a0) == {1: 0.5, 2: 1.0}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
