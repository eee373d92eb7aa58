"""The suite's own tools (tools/testing/): the runner's per-file seconds and its serial
phase's gate, proc_account.py's table, coverage_tiers.py's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT

from tools.testing import proc_account
from tools.testing.runner import GATE, _file_seconds


def test_file_seconds_add_up_each_files_tests(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.5"/>'
        '<testcase classname="tests.test_a" name="t2" time="2.0"/>'
        '<testcase classname="tests.test_b.TestGroup" name="t" time="0.5"/>'
        "</testsuite></testsuites>"
    )
    got = _file_seconds([report, tmp_path / "a phase that wrote nothing.xml"])
    assert got == {"tests/test_a.py": 3.5, "tests/test_b.py": 0.5}


def test_the_serial_phase_collects_then_waits_at_its_gate(tmp_path: Path) -> None:
    """A pytest started with the gate set collects, says so, and runs nothing until the
    gate file exists (tools.test creates it once the other phases have ended)."""
    gate, report = tmp_path / "go", tmp_path / "r.xml"
    test = "tests/test_test_tools.py::test_file_seconds_add_up_each_files_tests"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    proc = subprocess.Popen(
        [*cmd, f"--junitxml={report}"],
        cwd=ROOT,
        env={**os.environ, GATE: str(gate)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{gate}.waiting").exists():
            assert proc.poll() is None, f"ran without waiting: {proc.stdout.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "never reached the gate"
            time.sleep(0.1)
        time.sleep(1.0)
        assert proc.poll() is None and not report.exists(), "a test ran before the gate opened"
        gate.touch()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert 'tests="1"' in report.read_text() and "1 passed" in out


def test_proc_account_finds_a_busy_child_and_names_its_kind(tmp_path: Path) -> None:
    out = tmp_path / "acct.json"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.testing.proc_account",
            "--out",
            str(out),
            "--",
            "bash",
            "-c",
            f"sleep 0.3; {sys.executable} -c '{busy}' -m pytest-lookalike",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    table = proc_account.report(out)
    # The child spent 1 CPU s and its command line names pytest: its row says so.
    row = next(line for line in table.splitlines() if line.startswith("| pytest"))
    assert float(row.split("|")[3]) >= 0.8, table


def test_coverage_tiers_table_counts_the_fast_tiers_lines_against_the_whole_suites(
    tmp_path: Path,
) -> None:
    """Per package: statements, each tier's share, and the fast tier's covered lines over
    the whole suite's, which are those the fast tier or the rest of the suite ran."""
    from tools.testing.coverage_tiers import package, table

    def report(tier: str, files: dict[str, tuple[list[int], list[int]]]) -> None:
        (tmp_path / tier).mkdir()
        data = {
            f: {"executed_lines": run, "missing_lines": missing}
            for f, (run, missing) in files.items()
        }
        (tmp_path / tier / "coverage.json").write_text(json.dumps({"files": data}))

    # The rest of the suite, and the fast tier: the whole suite ran what either did.
    report(
        "rest",
        {
            "rftpipe/data/sources.py": ([1, 2, 3], [4, 5]),
            "rftpipe/dist.py": ([1, 2], [3, 4]),
            "jobs/submit.py": ([], [1]),
        },
    )
    report(
        "fast",
        {
            "rftpipe/data/sources.py": ([1, 4], [2, 3, 5]),
            "rftpipe/dist.py": ([], [1, 2, 3, 4]),
            "jobs/submit.py": ([1], []),
        },
    )
    assert package("rftpipe/engines/train/fsdp.py") == "rftpipe.engines"
    assert package("rftpipe/dist.py") == "rftpipe" and package("jobs/submit.py") == "jobs"
    rows = {r.split("|")[1].strip(): r for r in table(tmp_path).splitlines()[2:]}
    assert rows["`rftpipe.data`"].split("|")[2:] == [" 5 ", " 80 % ", " 40 % ", " 50 % ", ""]
    assert rows["`rftpipe`"].split("|")[2:] == [" 4 ", " 50 % ", " 0 % ", " 0 % ", ""]
    assert rows["**all**"].split("|")[2:] == [" 10 ", " 70 % ", " 30 % ", " 43 % ", ""]
