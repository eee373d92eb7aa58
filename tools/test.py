"""The test suite in phases: what the README's test command and `.ci/run` call.

    python -m tools.test                 # the whole suite (what CI runs)
    python -m tools.test --fast          # the fast tier: run it on every change
    python -m tools.test -- -k chaos -x  # anything after `--` goes to every pytest phase

1. The tests that can share the machine run on `--workers` processes (pytest-xdist, a
   test file to a worker, so the module fixtures a file's tests compare against are
   built once). Beside them, in one more process, the `slurm` tests run one at a time
   against the one local cluster: they spend their minutes waiting for Slurm (time
   limits, preemption, requeues), not on the CPU.
2. Then the `serial` tests, one at a time: they start vLLM (which binds its threads to
   the cores) or time out within seconds, and need the machine to themselves.

Every phase reads one model cache (the tiny models are built once). The exit status is
the first failing phase's. docs/testing.md has the tiers and the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The tier that runs in minutes: every test not marked slow, and from a file whose tests
# are all slow the one marked `tier1` (docs/testing.md: its coverage against the whole
# suite's).
FAST = "not slow or tier1"

NO_TESTS = 5  # pytest's exit status when a selection is empty


def _pytest(args: list[str], **kw: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", *args]
    print(f"tools.test: {' '.join(cmd[1:])}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, **kw)  # type: ignore[call-overload]


def _status(code: int) -> int:
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

    def args(*marks: str) -> list[str]:
        return ["-m", " and ".join([*select, *marks]), "-q", *a.pytest_args]

    xdist = ["-n", str(a.workers), "--dist", "loadfile"] if a.workers > 1 else []
    with tempfile.TemporaryDirectory(prefix="rftpipe-tests-") as tmp:
        if not os.environ.get("RFTPIPE_TEST_CACHE"):
            os.environ["RFTPIPE_TEST_CACHE"] = str(Path(tmp) / "cache")
        slurm_log = Path(tmp) / "slurm.log"
        with slurm_log.open("w") as sink:
            slurm = _pytest(args("slurm"), stdout=sink, stderr=subprocess.STDOUT)
            shared = _pytest([*xdist, *args("not serial", "not slurm")]).wait()
            slurm.wait()
        print("tools.test: the slurm tests (run beside the phase above):", flush=True)
        sys.stdout.write(slurm_log.read_text())
        serial = _pytest(args("serial", "not slurm")).wait()
    return _status(shared) or _status(slurm.returncode) or _status(serial)


if __name__ == "__main__":
    sys.exit(main())
