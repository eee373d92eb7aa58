"""tools.bench: its registry (`list`, dispatch by name, every benchmark module registered
under its declared name) and the harness the benchmarks share. No model: seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tools.bench as bench
from tools.bench import harness
from tools.bench.harness import ROOT


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_list_names_every_benchmark_with_what_it_runs_and_measures() -> None:
    out = _bench("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[::2]] == list(bench.BENCHMARKS)
    assert all(" runs: " in line for line in lines[::2])
    assert all(line.split()[0] == "measures:" for line in lines[1::2])


def test_listing_imports_no_benchmark() -> None:
    """`list` reads the declarations from source: no benchmark module, no torch."""
    code = "import json, sys, tools.bench as b; b.listing(); print(json.dumps(list(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "torch" not in loaded
    assert not loaded & set(bench.BENCHMARKS.values())


def test_every_benchmark_module_is_registered_under_its_declared_name() -> None:
    """Each module directly in tools/bench/ (and each package there) but the machinery is a
    benchmark: it declares a `BENCHMARK` whose name is its registry key."""
    here = ROOT / "tools" / "bench"
    machinery = {"__init__", "__main__", "harness"}
    found = {p.stem for p in here.glob("*.py")} - machinery
    found |= {p.parent.name for p in here.glob("*/__init__.py")}
    registered = {m.removeprefix("tools.bench.") for m in bench.BENCHMARKS.values()}
    assert found == registered, found ^ registered
    for name, module in bench.BENCHMARKS.items():
        declared = bench.declaration(bench.source(module))
        assert declared is not None, f"{module} declares no BENCHMARK"
        assert declared["name"] == name, module
        assert declared["runs"] and declared["measures"], module


def test_a_loaded_benchmark_is_the_one_its_source_declares() -> None:
    for name in ("trl", "restart", "overhead"):  # the ones that import no torch
        loaded = bench.load(name)
        assert isinstance(loaded, bench.Benchmark) and loaded.name == name
        assert bench.declaration(bench.source(bench.BENCHMARKS[name])) == {
            "name": loaded.name,
            "runs": loaded.runs,
            "measures": loaded.measures,
        }


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["restart", "--help"], "--repeats"),
        (["overhead", "--help"], "RUN_DIR"),
        (["trl", "--help"], "--pairs"),
        (["--help"], "--pairs"),  # no name: the TRL comparison, with today's flags
    ],
)
def test_a_name_reaches_its_benchmarks_parser(args: list[str], flag: str) -> None:
    out = _bench(*args)
    assert out.returncode == 0, out.stderr
    name = args[0] if args[0] != "--help" else "trl"
    assert out.stdout.startswith(f"usage: python -m tools.bench {name}")
    assert flag in out.stdout


def test_an_unknown_name_exits_2_with_the_usage() -> None:
    out = _bench("no_such_benchmark")
    assert out.returncode == 2
    assert "unknown benchmark 'no_such_benchmark'" in out.stderr and "list" in out.stderr


def test_alternate_runs_each_side_once_per_round_after_the_warm_up() -> None:
    calls: list[str] = []

    def side(name: str):  # noqa: ANN202
        return lambda: calls.append(name) or f"{name}{calls.count(name)}"

    seen: list[tuple[int, dict[str, str]]] = []
    rounds = harness.alternate(
        {"a": side("a"), "b": side("b")}, runs=2, after_round=lambda i, r: seen.append((i, r))
    )
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert rounds.warmup == {"a": "a1", "b": "b1"}
    assert rounds.runs == {"a": ["a2", "a3"], "b": ["b2", "b3"]}
    assert seen == [(0, {"a": "a2", "b": "b2"}), (1, {"a": "a3", "b": "b3"})]
    assert harness.alternate({"a": side("a")}, runs=1, warmup=0).warmup == {}


def test_medians_and_tables() -> None:
    runs = [{"turns": [1.0, 4.0], "steps": [1.0]}, {"turns": [3.0, 2.0]}, {"turns": [2.0, 9.0]}]
    assert harness.medians(runs, "turns", 2) == [2.0, 4.0]
    assert harness.pooled_median(runs, "steps") == 1.0
    assert harness.pooled_median(runs, "missing") is None
    assert harness.key_medians([{"x": 1.0}, {"x": 3.0}], ["x"]) == {"x": 2.0}
    assert harness.markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    table = harness.comparison_table({"train s": {"img": 3.0, "txt": 1.5}}, ("img", "txt"))
    assert table.splitlines()[-1] == "| train s | 3.000 | 1.500 | 2.00 |"
    assert table.splitlines()[0] == "|  | img | txt | img / txt |"


def test_fresh_process_reports_exit_code_output_and_memory(tmp_path: Path) -> None:
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    child = harness.fresh_process([sys.executable, "-c", code], capture=True)
    assert (child.code, child.stdout, child.stderr) == (3, "out\n", "err\n")
    assert child.wall_s > 0 and child.peak_rss_gib > 0
    ranks = harness.fresh_ranks(
        [sys.executable, "-c", "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"],
        world=2,
        threads=1,
        capture=True,
    )
    assert [r.stdout for r in ranks] == ["0 2\n", "1 2\n"]
    md = harness.write_report(tmp_path / "r" / "x.json", {"a": [1]}, "| t |", "Title")
    assert json.loads((tmp_path / "r" / "x.json").read_text()) == {"a": [1]}
    assert md.read_text() == "# Title\n\n| t |\n"
