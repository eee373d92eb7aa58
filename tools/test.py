"""The test suite in two phases, what the README's test command and `.ci/run` call.

    python -m tools.test                 # the whole suite (what CI runs)
    python -m tools.test --fast          # the fast tier: run it on every change
    python -m tools.test -- -k chaos -x  # anything after `--` goes to both pytest phases

Phase 1 runs every test not marked `serial` on `--workers` processes (pytest-xdist, a
test file to a worker, so the module fixtures a file's tests compare against are built
once). Phase 2 runs the `serial` tests one at a time: they start vLLM, use the one local
Slurm cluster, or time out within seconds, and need the machine to themselves. The exit
status is the first phase's failure, else the second's. docs/testing.md has the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The tier that runs in minutes: every test not marked slow, and, from a file whose
# tests are all slow, the one marked `tier1` (docs/testing.md: its coverage against the
# whole suite's).
FAST = "not slow or tier1"

NO_TESTS = 5  # pytest's exit status when a selection is empty


def _phase(name: str, args: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", *args]
    print(f"tools.test: {name}: {' '.join(cmd[1:])}", flush=True)
    code = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    return 0 if code == NO_TESTS else code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.test", description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="the fast tier only")
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes of the parallel phase (default: one a core)",
    )
    p.add_argument("-m", dest="marks", default="", help="a further pytest -m selection")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest after `--`")
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error(f"--workers must be >= 1, got {a.workers}")
    select = [f"({s})" for s in (FAST if a.fast else "", a.marks) if s]
    base = ["-q", *a.pytest_args]

    def marks(*extra: str) -> list[str]:
        return ["-m", " and ".join([*select, *extra])]

    parallel = ["-n", str(a.workers), "--dist", "loadfile"] if a.workers > 1 else []
    first = _phase("parallel phase", [*parallel, *marks("not serial"), *base])
    second = _phase("serial phase", [*marks("serial"), *base])
    return first or second


if __name__ == "__main__":
    sys.exit(main())
