"""The test suite in phases: what the README's test command and `.ci/run` call.

    python -m tools.test                 # the whole suite (what CI runs)
    python -m tools.test --fast          # the fast tier: run it on every change
    python -m tools.test -- -k chaos -x  # anything after `--` goes to every pytest phase

1. The tests that can share the machine run on `--workers` processes (pytest-xdist, a
   test file to a worker, so the module fixtures a file's tests compare against are
   built once). Beside them run two lanes, each one test at a time in one more process:
   the `slurm` tests, against the one local cluster, which spend their minutes waiting
   for Slurm (time limits, preemption, requeues), not on the CPU; and the `vllm` tests,
   each vLLM engine binding its threads to the cores (two at once would fight over them)
   and mostly using one of them.
2. Then the `serial` tests, one at a time, alone: they hold timeouts of seconds that a
   loaded machine could trip. Their pytest starts with the others and collects while
   they run, then waits (tests/conftest.py) until they have ended.

Every phase reads one model cache (the tiny models are built once). The exit status is
the first failing phase's. `--record` writes each test file's seconds to
tests/durations.json, from which tests/conftest.py hands the longest files out first, so
no long file starts last and runs alone. docs/testing.md has the tiers and the figures.
`python -m tools.test` runs `main` here through tools/test.py, kept at its path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The tier that runs in minutes: every test not marked slow, and from a file whose tests
# are all slow the one marked `tier1` (docs/testing.md: its coverage against the whole
# suite's).
FAST = "not slow or tier1"

NO_TESTS = 5  # pytest's exit status when a selection is empty

# Each lane runs beside the shared phase, one test at a time; the serial phase runs last,
# alone. A test with two of these marks runs where the first listed puts it.
LANES = {"slurm": ("slurm",), "vllm": ("vllm", "not slurm")}
#: Each lane's RFTPIPE_TEST_ZYGOTE (tests/conftest.py): 0, no warm forks; vllm, forks from
#: an interpreter that imported vLLM.
LANE_ZYGOTE = {"slurm": "0", "vllm": "vllm"}
SHARED = ("not slurm", "not vllm", "not serial")
SERIAL = ("serial", "not slurm", "not vllm")
DURATIONS = ROOT / "tests" / "durations.json"
#: The serial phase's pytest waits, after collecting, until the file this names exists.
GATE = "RFTPIPE_TEST_GATE"


def _pytest(args: list[str], **kw: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", *args]
    print(f"tools.test: {' '.join(cmd[1:])}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, **kw)  # type: ignore[call-overload]


def _status(code: int) -> int:
    return 0 if code == NO_TESTS else code


def _file_seconds(reports: list[Path]) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown) from pytest's JUnit reports."""
    out: dict[str, float] = {}
    for report in reports:
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                path = case.get("classname", "").split(".")
                name = f"{'/'.join(p for p in path if p[:4] != 'Test')}.py"
                out[name] = out.get(name, 0.0) + float(case.get("time", 0))
    return {k: round(v, 1) for k, v in sorted(out.items())}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the tier, the parallel phase's processes, `--record`, a further
    `-m` selection and what goes to every pytest after `--`."""
    p = argparse.ArgumentParser(prog="python -m tools.test", description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="the fast tier only")
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes of the parallel phase (default: one a core)",
    )
    p.add_argument(
        "--record", action="store_true", help=f"write each file's seconds to {DURATIONS.name}"
    )
    p.add_argument("-m", dest="marks", default="", help="a further pytest -m selection")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest after `--`")
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error(f"--workers must be >= 1, got {a.workers}")
    return a


@dataclass
class _Run:
    """One call's phases: the selection they share, the temporary folder of their logs,
    JUnit reports and gate, and the processes `main` stops if it is interrupted."""

    select: list[str]
    pytest_args: list[str]
    tmp: Path
    reports: list[Path] = field(default_factory=list)
    started: list[subprocess.Popen] = field(default_factory=list)

    def args(self, *marks: str) -> list[str]:
        """pytest's arguments for the phase of `marks`, with a JUnit report of its own."""
        self.reports.append(self.tmp / f"phase{len(self.reports)}.xml")
        selection = " and ".join([*self.select, *marks])
        return ["-m", selection, "-q", f"--junitxml={self.reports[-1]}", *self.pytest_args]


def _prepare_environment(tmp: Path) -> None:
    """What every phase inherits: bytecode written, and one model cache."""
    # Bytecode is written (under the checkout's git-ignored __pycache__ folders) even
    # where the environment says not to, as this sandbox's does: otherwise every
    # interpreter of the suite compiles the rftpipe modules it imports, and every pytest
    # process rewrites the assertions of every test file it collects (about 7 CPU s a
    # process). Installed packages have their bytecode from pip either way.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if not os.environ.get("RFTPIPE_TEST_CACHE"):
        os.environ["RFTPIPE_TEST_CACHE"] = str(tmp / "cache")


def _start(run: _Run, workers: int) -> tuple[dict[str, subprocess.Popen], subprocess.Popen]:
    """Start the lanes, the serial phase (to collect, then wait at `run.tmp`/serial.go) and
    the shared phase; return the shared phase and the lanes by name, and the serial phase."""
    # In the order tests/conftest.py sorts them, the longest file first: pytest-xdist 3.8
    # otherwise hands out the files with the most tests first (`--loadscope-reorder`, its
    # default), and the chaos file, 5 tests and the longest, started last.
    xdist = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]
    xdist = xdist if workers > 1 else []
    lanes: dict[str, subprocess.Popen] = {}
    # The shared phase's run workers are forked from warm interpreters
    # (tools/testing/zygote.py, tests/conftest.py), and the vLLM lane's from one that
    # imported vLLM too (about 9 CPU s a worker on top of torch's and transformers'); the
    # Slurm lane's and the serial phase's start as new ones: Slurm's tasks are not the local
    # launcher's, and a server's imports beside the serial tests would load the machine
    # their timeouts assume idle.
    cold = {**os.environ, "RFTPIPE_TEST_ZYGOTE": "0"}
    for lane, marks in LANES.items():
        env = {**os.environ, "RFTPIPE_TEST_ZYGOTE": LANE_ZYGOTE[lane]}
        with (run.tmp / f"{lane}.log").open("w") as sink:
            lanes[lane] = _pytest(run.args(*marks), stdout=sink, stderr=subprocess.STDOUT, env=env)
            run.started.append(lanes[lane])
    # The serial phase collects now, while the others run (about 10 s of imports and
    # assertion rewriting, on the critical path if it started afterwards), then waits
    # in tests/conftest.py until the gate exists.
    with (run.tmp / "serial.log").open("w") as sink:
        serial = _pytest(
            run.args(*SERIAL),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**cold, GATE: str(run.tmp / "serial.go")},
        )
        run.started.append(serial)
    return {"shared phase": _pytest([*xdist, *run.args(*SHARED)]), **lanes}, serial


def _finish(
    run: _Run, procs: dict[str, subprocess.Popen], serial: subprocess.Popen, t0: float
) -> list[int]:
    """Wait for the shared phase and the lanes, show the lanes' output, then open the
    serial phase's gate and wait for it; print the times and return every exit status."""
    ended: dict[str, float] = {}  # seconds from the start to each one's end
    while len(ended) < len(procs):
        for name, proc in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.monotonic() - t0
        time.sleep(0.5)
    lanes = [name for name in procs if name in LANES]
    for lane in lanes:
        print(f"tools.test: the {lane} tests, run beside the shared phase:")
        sys.stdout.write((run.tmp / f"{lane}.log").read_text())
    t2 = time.monotonic()
    (run.tmp / "serial.go").touch()
    serial.wait()
    t3 = time.monotonic()
    print("tools.test: the serial tests, run after the others:")
    sys.stdout.write((run.tmp / "serial.log").read_text())
    beside = ", ".join(f"{lane} lane {ended[lane]:.0f} s" for lane in lanes)
    print(
        f"tools.test: shared phase {ended['shared phase']:.0f} s ({beside} beside it), "
        f"serial phase {t3 - t2:.0f} s; {t3 - t0:.0f} s in all"
    )
    return [proc.returncode for proc in [*procs.values(), serial]]


def _record(reports: list[Path]) -> None:
    """Write each test file's seconds to DURATIONS; files this call did not run keep theirs."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    merged = dict(sorted({**known, **_file_seconds(reports)}.items()))
    DURATIONS.write_text(json.dumps(merged, indent=0) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the suite in its phases (the module's docstring): the first failing phase's
    exit status, 0 if none failed."""
    a = _parse(argv)
    select = [f"({s})" for s in (FAST if a.fast else "", a.marks) if s]
    run = _Run(select, a.pytest_args, Path(tempfile.mkdtemp(prefix="rftpipe-tests-")))
    t0 = time.monotonic()
    try:
        _prepare_environment(run.tmp)
        procs, serial = _start(run, a.workers)
        codes = _finish(run, procs, serial, t0)
        if a.record:
            _record(run.reports)
    finally:
        for proc in run.started:
            if proc.poll() is None:  # interrupted: stop the lanes and the serial phase too
                proc.terminate()
                proc.wait()
        shutil.rmtree(run.tmp, ignore_errors=True)
    return next((c for c in map(_status, codes) if c), 0)


if __name__ == "__main__":
    sys.exit(main())
